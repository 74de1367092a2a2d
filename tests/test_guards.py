"""The rejection guards (tokenmill/guards.py) and the run summary (tokenmill/run_summary.py).

Unit tests of the rule, then real Snakemake runs (local profile) on tiny configs: an empty
source, a mostly broken source and a stage over its reject share each fail the run with one
guard line naming the category, the stage, the share and the top reasons; the failed rule's
outputs are gone, so Snakemake still sees the job as to do.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml
from helpers import copy_run, copy_workflow, failed, snakemake

from tokenmill import guards, run_summary
from tokenmill.contracts import REJECTED, ParquetWriter, rejected_row, rejected_table
from tokenmill.settings import load_section


def limit(max_fraction=0.5, min_count=10):
    return load_section({"prepare": {"max_fraction": max_fraction, "min_count": min_count}},
                        "reject_limits").prepare  # fmt: skip


def test_defaults_come_from_the_schema_and_generate_shares_the_shape():
    limits = load_section({}, "reject_limits")
    assert (limits.prepare.max_fraction, limits.prepare.min_count) == (0.5, 10)
    assert limits.tokenize.max_fraction == limits.merge.max_fraction == 0.5
    gen = load_section({"sampling": {"max_new_tokens": 8}}, "generation")
    assert (gen.reject_limit.max_fraction, gen.reject_limit.min_count) == (0.05, 10)
    # a partial limit keeps the other key's default of its own use site
    gen = {"sampling": {"max_new_tokens": 8}, "reject_limit": {"min_count": 3}}
    gen = load_section(gen, "generation")
    assert (gen.reject_limit.max_fraction, gen.reject_limit.min_count) == (0.05, 3)
    with pytest.raises(Exception, match="reject_limits.merge"):
        load_section({"merge": {"max_fraction": 2}}, "reject_limits")


@pytest.mark.parametrize(
    ("judged", "rejected", "kept", "shard", "fails"),
    [
        (100, 50, 50, False, False),  # at the limit: passes
        (100, 51, 49, False, True),
        (15, 9, 6, False, False),  # over the share but fewer than min_count
        (1, 1, 0, False, True),  # a category that keeps nothing
        (1, 1, 0, True, False),  # a shard of one: too little to judge
        (2, 2, 0, True, True),
        (0, 0, 0, True, False),
        # a shard's share is a sample of its category's (limit 50 %): over the limit by
        # chance passes, its category's verdict decides ...
        (100, 51, 49, True, False),
        (600, 330, 270, True, False),
        (100, 80, 20, True, False),
        # ... a share chance cannot explain at the limit fails
        (100, 85, 15, True, True),
        (600, 400, 200, True, True),
    ],
)
def test_over_limit(judged, rejected, kept, shard, fails):
    why = guards.over_limit(judged, rejected, kept, limit(), key="k", shard=shard)
    assert (why is not None) == fails, why


def test_max_fraction_one_turns_the_guard_off(tmp_path):
    assert guards.over_limit(10, 10, 0, limit(1.0), key="k") is None
    guards.check("prepare", "c", 0, 0, tmp_path / "none.parquet", limit(1.0), key="k")


def _rejected_file(path: Path, rows: list[dict]) -> Path:
    with ParquetWriter(path, REJECTED, "prepare", {}) as w:
        w.write(rejected_table(rows))
    return path


def test_message_names_category_stage_share_and_top_reasons_and_removes_outputs(tmp_path, capsys):
    rows = [rejected_row("prepare", "c", "unparseable", "bad JSON", f"a.jsonl:{i}") for i in
            range(2, 32)]  # fmt: skip
    rows += [rejected_row("prepare", "c", "over_max_prompts", "not chosen", "a.jsonl:40")] * 50
    rej = _rejected_file(tmp_path / "rej.parquet", rows)
    out = tmp_path / "out.parquet"
    out.write_bytes(b"x")
    status = guards.enforce(
        [out, rej], "prepare", "c", 81, 1, rej, limit(), key="reject_limits.prepare",
        exempt=("over_max_prompts",),
    )  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 1 and len(err) == 1, err
    assert err[0].startswith(guards.GUARD_PREFIX)
    # the exempt reason is neither counted nor judged: 30 of 31
    assert "category 'c', stage prepare: 30 of 31 rejected (96.8% > reject_limits.prepare" in err[0]
    assert "unparseable 30 (e.g. a.jsonl:2: bad JSON)" in err[0]
    assert not out.exists() and not rej.exists()


# --------------------------------------------------------------------------------------------
# Real runs


def _tiny_config(workdir: Path, categories: dict, **top) -> Path:
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["categories"] = categories
    config.update(top)
    path = workdir / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _messages(text: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": text}]})


def _guard_lines(text: str) -> list[str]:
    """The guards' own lines (the jobs' logs, which Snakemake prints)."""
    return sorted(
        {x.strip() for x in text.splitlines() if x.strip().startswith(guards.GUARD_PREFIX)}
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_empty_broken_and_over_share_sources_fail_the_run_and_leave_nothing_complete(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    data = workdir / "mydata"
    data.mkdir()
    (data / "empty.jsonl").write_text("")
    broken = [_messages("the one good prompt")] + ["{not json"] * 30
    (data / "broken.jsonl").write_text("\n".join(broken) + "\n")
    long = [_messages(f"prompt {i} " + "word " * 200) for i in range(12)]
    (data / "long.jsonl").write_text("\n".join(long) + "\n")
    cats = {
        name: {"sources": [f"mydata/{name}.jsonl"], "format": "messages", "shards": 1}
        for name in ("empty", "broken", "long")
    }
    cfg = _tiny_config(workdir, cats, max_prompt_tokens=64)
    # the profile's own retries (2): a CPU job's failure is its data, so it runs once
    proc = snakemake(workdir, "--configfile", str(cfg), "--keep-going")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, failed(proc)
    lines = _guard_lines(out)
    assert len(lines) == 3, out[-6000:]
    empty, broken_line, long_line = (next(x for x in lines if f"'{c}'" in x) for c in
                                      ("empty", "broken", "long"))  # fmt: skip
    assert out.count("Error in rule prepare_prompts") == 2, out[-6000:]
    assert out.count("Error in rule tokenize_prompts") == 1, out[-6000:]
    # the job's log (show-failed-logs) and the cause line at the end: twice, not four times
    assert out.count(empty) == 2, out[-6000:]
    assert "stage prepare: no records at all: mydata/empty.jsonl is empty (0 bytes)" in empty
    assert re.search(
        r"stage prepare: 30 of 31 rejected \(96\.8% > reject_limits\.prepare", broken_line
    )
    assert "unparseable 30 (e.g. mydata/broken.jsonl:2" in broken_line
    assert re.search(
        r"stage tokenize: 12 of 12 rejected \(100\.0% > reject_limits\.tokenize", long_line
    )
    # the run's last ten lines name each failed job: stage, category, the guard's line, log
    last = [x.strip() for x in out.strip().splitlines()[-10:]]
    for stage, c, guard in (("prepare", "empty", empty), ("prepare", "broken", broken_line),
                            ("tokenize", "long", long_line)):  # fmt: skip
        assert f"{stage} {c}: {guard} (log results/logs/{stage}/{c}.log)" in last, last
    summary = out[out.index("tokenmill: run FAILED") :]
    assert "  long: tokenize failed (1 job, cause below); not merged yet\n" in summary, summary
    assert "job logs: results/logs" in summary
    # nothing half-written: the failed rules' outputs do not exist, and Snakemake still sees
    # those jobs as to do
    res = workdir / "results"
    assert not (res / "prompts" / "empty.parquet").exists()
    assert not (res / "prompts" / "broken.parquet").exists()
    assert not (res / "rejected" / "prepare" / "broken.parquet").exists()
    assert (res / "prompts" / "long.parquet").exists()  # its prepare passed
    assert not (res / "tokenized" / "long").exists()
    assert not (res / "rejected" / "tokenize" / "long.parquet").exists()
    dry = snakemake(workdir, "--configfile", str(cfg), "-n")
    assert dry.returncode == 0, failed(dry)
    for job in ("prepare_prompts", "tokenize_prompts"):
        assert job in dry.stdout, dry.stdout[-3000:]
    # a raised limit lets the mostly broken category through (its one prompt kept)
    cfg = _tiny_config(workdir, {"broken": cats["broken"]},
                       reject_limits={"prepare": {"max_fraction": 1.0}})  # fmt: skip
    proc = snakemake(workdir, "--configfile", str(cfg), "--retries", "0",
                     "results/prompts/broken.parquet")  # fmt: skip
    assert proc.returncode == 0, failed(proc)
    assert "broken: not merged yet, 30 rejected (prepare unparseable 30)" in proc.stderr


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.engines
def test_merge_over_its_share_of_truncated_outputs_fails_the_run(demo_workdir, tmp_path):
    """The demo's function_calling shards lose outputs cut at max_new_tokens at merge: with a
    merge limit below that share the category's verdict fails the run in one line naming
    `truncated` and its shards (no shard alone is proof: a few of a dozen can be chance at the
    limit), the merged shards stay (the journal paid for them), and nothing publishes them."""
    workdir = copy_run(demo_workdir, tmp_path / "run")
    cfg = yaml.safe_load((workdir / "config.yaml").read_text())
    cfg["reject_limits"] = {"merge": {"max_fraction": 0.01, "min_count": 1}}
    (workdir / "strict.yaml").write_text(yaml.safe_dump(cfg))
    shards = sorted((workdir / "results" / "rejected" / "merge" / "function_calling").glob("*"))
    import pyarrow.parquet as pq

    truncated = [s for s in shards if "truncated" in pq.read_table(s).column("reason").to_pylist()]
    assert truncated, "the demo run truncated nothing in function_calling"
    verdict = "results/rejected/verdict/function_calling.json"
    # the limits are operational (not a rerun trigger): force the verdict, and only it runs
    proc = snakemake(workdir, verdict, "--configfile", "strict.yaml", "--forcerun",
                     "judge_category")  # fmt: skip
    assert proc.returncode != 0, failed(proc)
    said = proc.stdout + proc.stderr
    assert "localrule judge_category" in said and "rule merge_shard" not in said, said[-3000:]
    lines = _guard_lines(proc.stdout + proc.stderr)
    assert lines and all("category 'function_calling', stage merge:" in x for x in lines), lines
    assert "truncated" in lines[0] and "over its 3 shards" in lines[0], lines
    assert not (workdir / verdict).exists()
    assert all((workdir / f"results/dataset/function_calling/{s.stem}.parquet").exists()
               for s in shards)  # fmt: skip


def _summary_settings(results, categories):
    """The layout and settings of a config declaring `categories` (one shard each)."""
    from tokenmill.layout import Layout
    from tokenmill.settings import Settings

    cats = {c: {"sources": ["d.jsonl"], "format": "messages", "shards": 1} for c in categories}
    config = {"tokenizer": {"path": "t"}, "categories": cats, "results_dir": str(results)}
    settings = Settings.from_config(config)
    return Layout.of(settings), settings


def test_summary_of_a_partial_results_folder(tmp_path):
    """The closing summary reads the declared files and the jobs' records: a failed CPU job's
    guard line (its log, its output absent), a failed GPU job's last attempt, each with its
    stage, category, shard and log, LAST; an earlier run's failure is not this run's."""
    from tokenmill import contracts
    from tokenmill.jobs import harness

    res = tmp_path / "results"
    (res / "rejected" / "merge" / "c").mkdir(parents=True)
    rows = [rejected_row("merge", "c", "truncated", "cut", None, f"p{i}") for i in range(3)]
    _rejected_file(res / "rejected" / "merge" / "c" / "000.parquet", rows)
    lay, two = _summary_settings(res, ["c", "d"])
    merge_log = Path(lay.log("merge", "c", "000"))
    merge_log.parent.mkdir(parents=True)
    merge_log.write_text(f"noise\n{guards.GUARD_PREFIX} category 'c' shard 000, stage merge\n")
    attempt = contracts.Attempt(
        stage="generate", category="d", shard="000", id="h:1:1", host="h", pid=1,
        slurm=contracts.SlurmJob(None, None, 0, None), started=harness.now_iso(),
        ended=harness.now_iso(), status="failed", cause="engine exited at start: CUDA OOM",
        deterministic=False, gpus=1, wall_s=3.0, log="logs/generate/d/000/generate.log",
    )  # fmt: skip
    harness.append_attempt(Path(lay.attempts("generate", "d", "000")), attempt)
    since = time.time() - 60
    lines = run_summary.summary_lines(lay, two, ok=False, since=since)
    text = "\n".join(lines)
    assert lines[0] == "tokenmill: run FAILED; per category:"
    # a failed stage's rejections are its cause's (the guard removed its outputs), not a count
    assert "  c: merge failed (1 job, cause below); not merged yet\n" in text, text
    assert "  d: generate failed (1 job, cause below); not merged yet\n" in text, text
    assert lines[-3] == "tokenmill: 2 jobs failed; the cause of each:", lines
    assert lines[-2] == (
        "  generate d/000: engine exited at start: CUDA OOM (log logs/generate/d/000/generate.log)"
    )
    assert lines[-1] == (
        f"  merge c/000: {guards.GUARD_PREFIX} category 'c' shard 000, stage merge (log "
        f"{merge_log})"
    )
    later = run_summary.summary_lines(lay, two, ok=False, since=since + 3600)  # a later run's
    assert "failed" not in "\n".join(later[1:]), later
    lines = run_summary.summary_lines(*_summary_settings(res, ["c"]), ok=True)
    text = "\n".join(lines)
    assert lines[0] == "tokenmill: run finished; per category:"
    assert "c: not merged yet, 3 rejected (merge truncated 3); 3 truncated" in text
    assert f"report {res / 'report.html'} (not made yet: the same command with --report" in text


def test_stats_fails_a_category_that_kept_nothing_across_its_shards():
    from tokenmill.dataset.stats import kept_nothing

    merge = {"in": 3, "kept": 0, "rejected": 3, "reasons": {"truncated": 3}}
    summary = {
        "categories": {
            "a": {"stages": {"merge": merge}},
            "b": {"stages": {"merge": {"in": 2, "kept": 2, "rejected": 0, "reasons": {}}}},
            "c": {"stages": {"merge": {"in": 0, "kept": 0, "rejected": 0, "reasons": {}}}},
        }
    }
    lines = kept_nothing(summary, limit())
    assert len(lines) == 1 and lines[0].startswith(guards.GUARD_PREFIX), lines
    assert "category 'a', stage merge: 3 of 3 rejected in all its shards: nothing kept" in lines[0]
    assert "top reasons: truncated 3" in lines[0] and "no statistics were written" in lines[0]
    assert kept_nothing(summary, limit(1.0)) == []


def test_prepare_does_not_count_its_own_choices(tmp_path, capsys):
    """Duplicates and prompts not sampled by max_prompts are the pipeline's choices, not faults
    of the data: 30 copies of one prompt and a max_prompts cut pass the guard."""
    from tokenmill.prepare import stage

    lines = [_messages("the same prompt")] * 30 + [_messages(f"p{i}") for i in range(30)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    cat = {"sources": ["d.jsonl"], "format": "messages", "max_prompts": 5}
    out, rej = tmp_path / "p.parquet", tmp_path / "r.parquet"
    argv = ["--category", "c", "--category-config", json.dumps(cat), "--out", str(out),
            "--rejected", str(rej), "--basedir", str(tmp_path)]  # fmt: skip
    assert stage.main(argv) == 0, capsys.readouterr().err
    reasons = {r["reason"] for r in guards.rejected_rows(rej)}
    assert reasons == {"duplicate_prompt", "over_max_prompts"}


def _category_run(seed: int, rate: float, shards=16, prompts=600, window=32):
    """One seeded run of a category through the guards as generate and its verdict apply
    them: each shard's RejectionGuard sees its prompts started `window` ahead of their answers
    (a concurrency window) and judges early and at the end; then the category's share over
    its shards. (tripped shards, the category's verdict line or None, per-shard refusals)."""
    import random

    from tokenmill.generate.client import OK, REJECTED, RejectionGuard, TooManyRejections

    rng = random.Random(seed)
    lim = load_section({"reject_limit": {"max_fraction": 0.05, "min_count": 10},
                        "sampling": {"max_new_tokens": 8}}, "generation").reject_limit  # fmt: skip
    tripped, refused = [], []
    for shard in range(shards):
        guard = RejectionGuard(lim.max_fraction, lim.min_count)
        outcomes = [REJECTED if rng.random() < rate else OK for _ in range(prompts)]
        try:
            for i, status in enumerate(outcomes):
                while guard.started < min(prompts, i + window):
                    guard.started += 1
                guard.add({"status": status, "prompt_id": f"p{i}", "message": "refused"})
            guard.check(final=True)
        except TooManyRejections:
            tripped.append(shard)
        refused.append(outcomes.count(REJECTED))
    judged, rejected = shards * prompts, sum(refused)
    verdict = guards.over_limit(judged, rejected, judged - rejected, lim, key="k")
    return tripped, verdict, refused


def test_a_shard_never_trips_by_chance_and_the_category_is_judged_on_its_share():
    """Issue 28: 16 shards of 600 prompts at a true 3.9 % refusal rate and a 5 % limit. Judged
    shard by shard on the share, most runs failed (a shard at 5.4 %, 5.7 % by chance); judged
    as guards.shard_over_limit does, no shard trips in 20 seeded runs and every category
    passes. A true 8 % passes every shard (no shard alone is proof) and trips its category's
    verdict, in one line, every time."""
    lim = 0.05
    old_rule_failures = 0
    for seed in range(20):
        tripped, verdict, refused = _category_run(seed, 0.039)
        assert tripped == [] and verdict is None, (seed, tripped, verdict)
        old_rule_failures += any(r >= 10 and r / 600 > lim for r in refused)
    # the per-shard share rule this replaces would have failed some of these same runs
    assert old_rule_failures >= 5, old_rule_failures
    for seed in range(20):
        _, verdict, _ = _category_run(100 + seed, 0.08)
        assert verdict is not None and "> k.max_fraction 5.0%" in verdict, (seed, verdict)
        assert "\n" not in verdict
    # a systemic failure (every prompt refused) still stops each shard within a few prompts
    tripped, verdict, _ = _category_run(7, 1.0, shards=2, prompts=100)
    assert tripped == [0, 1] and verdict is not None
