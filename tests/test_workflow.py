"""End to end: the real Snakemake workflow on the bundled sample data, with the reference
engine in managed mode, then the incremental-rebuild promises:

- a second run does nothing;
- editing one prompt reruns prepare and tokenize of that category only, then generate,
  merge and export of exactly one shard (the engine receives exactly one request), and
  every other data file keeps its bytes;
- changing the chat template kwargs re-tokenizes every category;
- changing an operational key (concurrency, retries, timeouts, resources, start-up limits,
  the journal's location, the config file's name) reruns nothing, and changing a key that
  shapes the tokens reruns generate and merge of every shard, and nothing upstream;
- a controller killed with SIGKILL leaves Snakemake's lock: the next start fails and says how
  to unlock; a config with absolute paths for everything runs to the end (provenance included).;
- merge counts the loss tokens for the draft vocabulary: per-shard counts equal a plain
  recount of the merged rows, the d2t/t2d mapping round-trips, and an edited shard changes only
  its own counts file (and the sums above it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import BIN, ROOT, copy_run, copy_workflow, snakemake, tool_env
from test_merge import python_loss_counts  # the plain recount, shared with the merge tests

from tokenmill import contracts

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


JOB_HEADER = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")


def jobs_in(log: str) -> set[tuple[str, str]]:
    """(rule, wildcards) of every job a snakemake log (or dry run) lists."""
    jobs, current = set(), None
    for line in log.splitlines():
        header = JOB_HEADER.match(line.strip())
        if header:
            current = header.group(1)
            jobs.add((current, ""))
            continue
        if current and line.strip().startswith("wildcards:"):
            jobs.discard((current, ""))
            jobs.add((current, line.split(":", 1)[1].strip()))
            current = None
    return jobs


def digests(root: Path, pattern: str) -> dict[str, str]:
    """sha256 of the pipeline's files; the journal (results/journal, compacted into Parquet
    files as shards complete) is not an output."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.glob(pattern))
        if p.relative_to(root).parts[0] != "journal"
    }


@pytest.fixture(scope="module")
def finished_run(demo_workdir, tmp_path_factory):
    """The session's demo run (conftest.py), copied: the tests below edit it and rerun."""
    return copy_run(demo_workdir, tmp_path_factory.mktemp("wf") / "demo")


def stop_token_ids(workdir: Path, config: dict) -> set[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(workdir / config["tokenizer"]["path"] / "tokenizer.json"))
    ids = {
        tok.token_to_id(t) if isinstance(t, str) else t for t in config["generation"]["stop_tokens"]
    }
    assert None not in ids, ids
    return ids


def check_dataset(workdir: Path, results: Path, config: dict) -> int:
    """Every kept row is exactly prompt_ids + output_ids (loss on the output, a stop token
    last), and per shard rejected + kept = generated. Returns the number of kept rows."""
    stops = stop_token_ids(workdir, config)
    total_kept = 0
    for category, cat in config["categories"].items():
        shards = sorted((results / "tokenized" / category).glob("*.parquet"))
        assert len(shards) == cat["shards"]
        kept_in_category = 0
        for shard in shards:
            prompts = {
                r["prompt_id"]: r["prompt_ids"]
                for r in pq.read_table(shard, columns=["prompt_id", "prompt_ids"]).to_pylist()
            }
            gen_rows = pq.read_table(results / "generated" / category / shard.name).to_pylist()
            if cat.get("context") == "regenerated":
                # One generated row per turn, with the prompt it was sent; the demo's template
                # (Kimi-like, thinking) is not prefix-exact: one dataset row per turn.
                for r in gen_rows:
                    if r["turn"] == 0:
                        assert r["turn_prompt_ids"] == prompts[r["prompt_id"]]
                    assert r["prefix_exact"] is False
                prompts = {r["sample_key"]: r["turn_prompt_ids"] for r in gen_rows}
                generated = {r["sample_key"]: r["output_ids"] for r in gen_rows}
                key = "sample_key"
            else:
                generated = {r["prompt_id"]: r["output_ids"] for r in gen_rows}
                key = "prompt_id"
            rows = pq.read_table(results / "dataset" / category / shard.name).to_pylist()
            rejected = pq.read_table(results / "rejected/merge" / category / shard.name)
            from_generated = [
                r for r in rejected.column("reason").to_pylist() if r != "not_generated"
            ]
            assert len(rows) + len(from_generated) == len(generated), (category, shard.name)
            for row in rows:
                prompt, output = prompts[row[key]], generated[row[key]]
                assert row["input_ids"] == prompt + output
                assert row["loss_mask"] == [0] * len(prompt) + [1] * len(output)
                assert output and output[-1] in stops, (row["prompt_id"], output[-5:])
            assert (results / "export" / category / (shard.stem + ".jsonl")).exists()
            kept_in_category += len(rows)
        assert kept_in_category > 0, f"the demo kept no row of {category}"
        total_kept += kept_in_category
    return total_kept


def test_full_pipeline_outputs(finished_run):
    results = finished_run / "results"
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    kept = check_dataset(finished_run, results, config)
    summary = json.loads((results / "stats/summary.json").read_text())
    assert summary["overall"]["lengths"]["total_tokens"]["count"] == kept  # dataset rows
    # merge kept counts prompts, or conversations in a `context: regenerated` category
    merge_kept = {c: s["stages"]["merge"]["kept"] for c, s in summary["categories"].items()}
    assert summary["overall"]["stages"]["merge"]["kept"] == sum(merge_kept.values())
    plain = [c for c, cat in config["categories"].items() if cat.get("context") != "regenerated"]
    assert sum(merge_kept[c] for c in plain) == sum(
        pq.ParquetFile(f).metadata.num_rows
        for c in plain
        for f in (results / "dataset" / c).glob("*.parquet")
    )
    assert summary["conservation"]["ok"], summary["conservation"]
    # The demo runs on CPU (gpus: 0): no GPU-hours are invented.
    assert summary["overall"]["generation"]["gpu_hours"] is None
    assert summary["overall"]["generation"]["output_tokens_per_s"] > 0
    for name in ("stats/summary.json", "dataset/README.md", "provenance.json"):
        assert (results / name).exists(), name
    # The journal lives outside results/: `make clean` (rm -rf results .snakemake) keeps it.
    # (a completed shard's journal is compacted into {shard}.parquet)
    assert any((finished_run / "journal").rglob("*.parquet"))
    assert not (results / "journal").exists()
    size = yaml.safe_load((finished_run / "config.yaml").read_text())["dataset"]["draft_vocab_size"]
    for name in (f"d2t-{size}.npy", f"t2d-{size}.npy", "vocab_mapping.pt", "vocab_mapping.json"):
        assert (results / "dataset" / "vocab_mapping" / name).exists(), name


def check_counts_match_the_dataset(results: Path) -> dict[int, int]:
    """Every shard's counts file equals a recount of its dataset shard, each category sum the
    sum of its shards, _all.parquet the sum of all; returns the overall counts."""
    from tokenmill.dataset import draft_vocab as dv

    overall: dict[int, int] = {}
    shards = sorted((results / "dataset").glob("*/*.parquet"))
    assert shards
    for category in sorted({p.parent.name for p in shards}):
        per_category: dict[int, int] = {}
        for shard in (p for p in shards if p.parent.name == category):
            counts = dv.read_counts(results / "token_counts" / category / shard.name)
            got = {int(i): int(counts[i]) for i in np.flatnonzero(counts)}
            assert got == python_loss_counts(shard), shard
            for k, v in got.items():
                per_category[k] = per_category.get(k, 0) + v
        total = dv.read_counts(results / "token_counts" / f"{category}.parquet")
        assert {int(i): int(total[i]) for i in np.flatnonzero(total)} == per_category
        for k, v in per_category.items():
            overall[k] = overall.get(k, 0) + v
    total = dv.read_counts(results / "token_counts" / "_all.parquet")
    assert {int(i): int(total[i]) for i in np.flatnonzero(total)} == overall
    return overall


def test_token_counts_draft_vocab_and_coverage(finished_run, tmp_path):
    results = finished_run / "results"
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    overall = check_counts_match_the_dataset(results)
    # The mapping round-trips; the stop token (<|im_end|>, also the eos: id 4) ends every row,
    # so the counts alone put it in (nothing is forced by default, as in both trainers).
    size = config["dataset"]["draft_vocab_size"]
    target = json.loads((finished_run / "sample/model/config.json").read_text())["vocab_size"]
    mapping = results / "dataset" / "vocab_mapping"
    d2t, t2d = np.load(mapping / f"d2t-{size}.npy"), np.load(mapping / f"t2d-{size}.npy")
    assert d2t.dtype == np.int64 and d2t.shape == (size,)
    assert t2d.dtype == np.bool_ and t2d.shape == (target,)
    assert int(t2d.sum()) == size
    assert all(t2d[d2t[i] + i] for i in range(size))
    assert t2d[4]
    # It is the `size` most frequent loss ids (ties by id): recomputed here from the recount.
    ranked = sorted(overall, key=lambda t: (-overall[t], t))
    assert len(ranked) > size, "the demo's draft size should leave some ids out"
    expected = set(ranked[:size])
    assert set(np.flatnonzero(t2d).tolist()) == expected
    summary = json.loads((mapping / "vocab_mapping.json").read_text())
    assert summary["always_include_ids"] == []
    covered = sum(overall[t] for t in expected if t in overall) / sum(overall.values())
    assert summary["draft_coverage"] == pytest.approx(covered)
    # Stats: the coverage table per category and overall, and the plot.
    stats = json.loads((results / "stats/summary.json").read_text())
    assert set(stats["categories"]) == set(config["categories"])  # vocab_mapping is none
    cov = stats["overall"]["token_coverage"]
    assert cov["loss_tokens"] == sum(overall.values()) and cov["distinct_ids"] == len(overall)
    # The draft row is the written mapping's coverage (one owner: vocab_mapping.json).
    assert cov["top_n"][0] == {
        "n": size,
        "ids": size,
        "capped": False,
        "draft": True,
        "mapping": True,
        "share": round(summary["draft_coverage"], 6),
    }
    assert cov["top_n"][0]["share"] == round(covered, 6)
    assert "## Token coverage (loss-masked tokens)" in (results / "stats/summary.md").read_text()
    assert (results / "stats/token_coverage.png").stat().st_size > 1000
    # The dataset folder still loads by category with the mapping folder beside the categories.
    import datasets

    chat = datasets.load_dataset(
        str(results / "dataset"), name="chat", split="train", cache_dir=str(tmp_path / "hf")
    )
    assert len(chat) == sum(
        pq.ParquetFile(p).metadata.num_rows for p in (results / "dataset/chat").glob("*.parquet")
    )


def test_multiturn_demo_category_counts(finished_run):
    """The `context: regenerated` demo category: later turns were generated on the model's own
    turns (test_multiturn.py checks the prompts token by token), and stats and the dataset card
    count conversations, turns and samples as the files hold them."""
    results = finished_run / "results"

    def rows(stage):
        return [r for f in sorted((results / stage / "multiturn").glob("*.parquet"))
                for r in pq.read_table(f).to_pylist()]  # fmt: skip

    tokenized, generated, dataset = rows("tokenized"), rows("generated"), rows("dataset")
    assert {r["prompt_id"] for r in generated} == {r["prompt_id"] for r in tokenized}
    assert max(r["turn"] for r in generated) >= 2  # third turns, on two answers of the model's
    summary = json.loads((results / "stats/summary.json").read_text())
    c = summary["categories"]["multiturn"]["conversations"]
    assert c["conversations"] == len(tokenized)
    assert c["turns_in_data"] == sum(r["num_turns"] for r in tokenized)
    assert c["turns_generated"] == len(generated) == c["turns_kept"] + c["turns_rejected"]
    assert c["turns_not_asked"] == c["turns_in_data"] - c["turns_answered"]
    assert c["samples"] == len(dataset) == c["turn_samples"]  # Kimi-like: one row per turn
    ends: dict[str, int] = {}
    for pid in {r["prompt_id"] for r in generated}:
        (end,) = {r["conversation_end"] for r in generated if r["prompt_id"] == pid}
        ends[end] = ends.get(end, 0) + 1
    assert c["ends"] == ends
    # the bundled tool conversation: the tiny model does not make the dataset's call
    assert ends.get("tool_call_diverged") == 1
    stages = summary["categories"]["multiturn"]["stages"]
    assert stages["generate"]["kept"] == stages["merge"]["in"] == len(tokenized)
    md = (results / "stats/summary.md").read_text()
    assert "## Conversations regenerated turn by turn" in md
    card = (results / "dataset/README.md").read_text()
    assert "## Multi-turn conversations" in card
    assert f"| multiturn | {len(tokenized)} | {c['turns_kept']} | 0 | {len(dataset)} |" in card


def test_second_run_does_nothing(finished_run):
    proc = snakemake(finished_run, "-n")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout[-4000:]


def _edit_one_code_prompt(workdir: Path) -> None:
    path = workdir / "sample/data/code/code_sample.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    record = json.loads(lines[0])
    record["instruction"] += " Use only the standard library."
    lines[0] = json.dumps(record) + "\n"
    path.write_text("".join(lines))


def _prompt_ids(results: Path, category: str) -> set[str]:
    return set(pq.read_table(results / f"prompts/{category}.parquet")["prompt_id"].to_pylist())


def test_editing_one_prompt_reruns_one_shard(finished_run):
    results = finished_run / "results"
    before = digests(results, "*/*/*.parquet") | digests(results, "prompts/*.parquet")
    sums_before = digests(results, "token_counts/*.parquet")
    ids_before = _prompt_ids(results, "code")

    _edit_one_code_prompt(finished_run)
    dry = snakemake(finished_run, "-n")
    assert dry.returncode == 0, dry.stderr[-4000:]
    planned = {job for job in jobs_in(dry.stdout + dry.stderr) if job[1]}
    # The dry run cannot see past the tokenize checkpoint: it plans the whole `code`
    # category (and nothing of any other category); the real run then skips the shards
    # whose bytes did not change.
    assert {wc.split(",")[0] for _, wc in planned} == {"category=code"}, planned
    assert {("prepare_prompts", "category=code"), ("tokenize_prompts", "category=code")} <= planned

    run = snakemake(finished_run)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]

    # The edit removed one prompt and added another: the shards that held them, and those
    # whose prompts moved (shard_by: prefix: a cut between shards may move with them), are
    # the only ones that may change; the tokenized files say which.
    (old,) = ids_before - _prompt_ids(results, "code")
    (new,) = _prompt_ids(results, "code") - ids_before
    tokenized_after = digests(results, "tokenized/code/*.parquet")
    shards = {
        Path(p).stem for p, d in tokenized_after.items() if before.get(p) != d
    }  # fmt: skip
    holds = {
        Path(p).stem
        for p in tokenized_after
        if new in pq.read_table(results / p, columns=["prompt_id"]).column(0).to_pylist()
    }
    assert holds <= shards, (holds, shards)

    ran = jobs_in(run.stdout + run.stderr)
    per_shard = {(rule, wc) for rule, wc in ran if "shard=" in wc}
    expected = {
        (rule, f"category=code, shard={shard}")
        for rule in ("generate_shard", "merge_shard", "export_jsonl")
        for shard in shards
    }
    assert per_shard == expected, per_shard
    # The counts are summed again for the edited category only, then overall.
    sums = {wc for rule, wc in ran if rule == "sum_token_counts"}
    assert sums == {"category=code"}, sums

    # The engine received exactly one request: the edited prompt.
    requested = sum(
        json.loads((results / f"generated/code/{shard}.meta.json").read_text())["counts"][
            "requested"
        ]
        for shard in shards
    )
    assert requested == 1

    after = digests(results, "*/*/*.parquet") | digests(results, "prompts/*.parquet")
    changed = {path for path in before if before[path] != after.get(path)}
    # The edited shard's counts file may change (it does unless the new answer holds the same
    # tokens as the old); no other counts file does.
    counts_changed = {p for p in changed if p.startswith("token_counts/")}
    assert counts_changed <= {f"token_counts/code/{shard}.parquet" for shard in shards}
    assert changed - counts_changed == {"prompts/code.parquet"} | {
        f"{stage}/code/{shard}.parquet"
        for stage in ("tokenized", "generated", "dataset")
        for shard in shards
    }, changed
    sums_after = digests(results, "token_counts/*.parquet")
    assert {p for p in sums_before if sums_before[p] != sums_after[p]} <= {
        "token_counts/code.parquet",
        "token_counts/_all.parquet",
    }
    check_counts_match_the_dataset(results)  # the recounted shard is right, the others too


def test_changing_the_chat_template_kwargs_retokenizes_everything(finished_run, tmp_path):
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    config["tokenizer"]["chat_template_kwargs"] = {"thinking": False}
    configfile = tmp_path / "nothink.yaml"
    configfile.write_text(yaml.safe_dump(config))
    dry = snakemake(finished_run, "-n", "--configfile", str(configfile))
    assert dry.returncode == 0, dry.stderr[-4000:]
    tokenize = {wc for rule, wc in jobs_in(dry.stdout + dry.stderr) if rule == "tokenize_prompts"}
    assert tokenize == {f"category={c}" for c in config["categories"]}, tokenize
    prepare = {wc for rule, wc in jobs_in(dry.stdout + dry.stderr) if rule == "prepare_prompts"}
    assert not prepare, prepare


def _set(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        config = config[key]
    config[last] = value


# Keys that change how a job runs, never its tokens (with the values a user would set after
# an out-of-memory kill, a slow start or a busy server).
OPERATIONAL = {
    "generation.concurrency": 4,
    "generation.request_timeout_s": 120,
    "generation.progress_interval_s": 5,
    "generation.retry": {
        "max_attempts": 3,
        "backoff_initial_s": 0.5,
        "backoff_max_s": 5.0,
        "fail_fast_after": 5,
    },
    "generation.reject_limit": {"max_fraction": 0.2, "min_count": 50},
    "generation.server_model": "tiny",
    "generation.resources": {"gpus": 8, "cpus": 16, "mem_mb": 256000, "runtime_min": 600},
    "generation.launch.startup_timeout_s": 3600,
    "generation.launch.max_restarts": 5,
    "generation.launch.env": {"OMP_NUM_THREADS": "1"},
    "generation.api_key_env": "TOKENMILL_NO_SUCH_KEY",
    "journal_dir": "elsewhere/journal",
    "reject_limits": {"prepare": {"max_fraction": 0.9}, "merge": {"min_count": 50}},
}


def test_operational_keys_rerun_nothing(finished_run, tmp_path):
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    for key, value in OPERATIONAL.items():
        _set(config, key, value)
    # a launch flag that only says how the engine logs (not part of the fingerprint)
    config["generation"]["launch"]["command"] += ["--log-level", "warning"]
    configfile = tmp_path / "operational.yaml"  # another file name, too
    configfile.write_text(yaml.safe_dump(config))
    run = snakemake(finished_run, "--configfile", str(configfile))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert not jobs_in(run.stdout + run.stderr), run.stdout[-4000:] + run.stderr[-4000:]
    assert "Nothing to be done" in run.stdout + run.stderr


@pytest.mark.parametrize(
    "key, value",
    [
        ("generation.sampling.max_new_tokens", 200),
        ("generation.stop_tokens", ["<|im_end|>", 3]),
        ("generation.seed_policy", "per_sample"),
        ("generation.engine", "vllm"),
    ],
)
def test_token_keys_rerun_generation_only(finished_run, tmp_path, key, value):
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    _set(config, key, value)
    if key == "generation.seed_policy":
        # The reference engine is launched without --enable-deterministic-inference; this
        # operational opt-out lets the config pass (it is not part of the fingerprint).
        config["generation"]["allow_ignored_seeds"] = True
    configfile = tmp_path / "tokens.yaml"
    configfile.write_text(yaml.safe_dump(config))
    dry = snakemake(finished_run, "-n", "--configfile", str(configfile))
    assert dry.returncode == 0, dry.stdout[-4000:] + dry.stderr[-4000:]
    planned = jobs_in(dry.stdout + dry.stderr)
    shards = {
        f"category={c}, shard={s:03d}"
        for c, cat in config["categories"].items()
        for s in range(cat["shards"])
    }
    per_rule = {rule: {wc for r, wc in planned if r == rule} for rule, _ in planned}
    assert per_rule.pop("generate_shard") == shards, planned
    assert per_rule.pop("merge_shard") == shards, planned
    assert per_rule.pop("export_jsonl") == shards, planned
    # Stop tokens given as strings are resolved to ids by tokenize (into the shards' metadata)
    # and by token_facts (the stop ids merge checks).
    stops = key == "generation.stop_tokens"
    upstream = {"tokenize_prompts", "token_facts"} if stops else set()
    downstream = {"summarize_stats", "write_dataset_card", "write_provenance", "all"}
    # the loss-token sums and the draft vocabulary follow the merged shards
    downstream |= {"sum_token_counts", "sum_all_token_counts", "draft_vocab"}
    downstream |= {"judge_category"}  # each category's rejection share over its shards
    assert set(per_rule) == downstream | upstream, planned


def tokenmill(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "tokenmill"), *args], cwd=workdir, capture_output=True, text=True, timeout=300
    )


def test_verify_passes_and_names_a_tampered_file(finished_run, tmp_path):
    ok = tokenmill(finished_run, "verify", "results/provenance.json", "results")
    assert ok.returncode == 0, ok.stdout + ok.stderr

    copy = tmp_path / "published"
    shutil.copytree(finished_run / "results", copy)
    victim = copy / "dataset/chat/000.parquet"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    bad = tokenmill(finished_run, "verify", "results/provenance.json", str(copy))
    assert bad.returncode == 1
    assert "dataset/chat/000.parquet" in bad.stdout + bad.stderr


def test_reproduce_from_provenance_matches_byte_for_byte(reproduced_run, tmp_path):
    """The published dataset folder alone (a copy of results/dataset, which verifies) reproduces
    the demo in a fresh checkout with no results and no journal (conftest's reproduced_run):
    every stage byte-identical, every sample generated again and identical, the training
    shards the published bytes. A checkout whose inputs differ from the manifest refuses to
    start, saying why."""
    said = reproduced_run
    for step in ("verify", "reproduce_config", "run"):
        assert said[step]["rc"] == 0, (step, said[step]["out"])
    checkout, published = said["checkout"], said["published"]
    report = json.loads((checkout / "repro/reproduce/report.json").read_text())
    stages = report["byte_identical_stages"]
    assert report["ok"] and stages["identical"] and not stages["different"], stages
    samples = report["generated_samples"]
    assert samples["total"] > 0 and samples["identical"] == samples["total"], samples
    # The reproduced training data are the published files, byte for byte (the card and the
    # vocabulary summary may differ: throughput, paths).
    listed = json.loads((published / "provenance.json").read_text())["outputs"]
    shards = [e for e in listed if e["path"].endswith(".parquet")]
    assert shards
    for e in shards:
        have = hashlib.sha256((checkout / "repro/dataset" / e["path"]).read_bytes()).hexdigest()
        assert have == e["sha256"], e["path"]

    # A checkout whose inputs differ from the manifest refuses to start, saying why.
    edited = copy_workflow(tmp_path / "edited")
    shutil.copy2(checkout / "repro.yaml", edited / "repro.yaml")
    _edit_one_code_prompt(edited)
    refused = snakemake(edited, "-n", "--configfile", "repro.yaml")
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert "cannot reproduce" in said and "code_sample.jsonl" in said, said


def test_the_cards_provenance_commands_run_on_a_copy_of_the_folder(demo_workdir, tmp_path):
    """The dataset card tells whoever has only the folder how to check and regenerate it: its
    two commands, run as written on a copy of the folder, verify it and write a config."""
    folder = tmp_path / "published"
    shutil.copytree(demo_workdir / "results" / "dataset", folder)
    card = (folder / "README.md").read_text()
    commands = re.findall(r"`(tokenmill (?:verify|reproduce-config) [^`]+)`", card)
    assert [c.split()[1] for c in commands] == ["verify", "reproduce-config"], card
    for command in commands:
        argv = shlex.split(command.replace("<this folder>", str(folder)))[1:]
        proc = tokenmill(tmp_path, *argv)
        assert proc.returncode == 0, (command, proc.stdout + proc.stderr)
    made = yaml.safe_load((tmp_path / "repro.yaml").read_text())
    assert set(made["categories"]) == set(
        yaml.safe_load((ROOT / "config.yaml").read_text())["categories"]
    )


def test_gpu_hours_come_from_each_jobs_meta_not_todays_resources(demo_workdir, tmp_path):
    """Truthful cost: every generate job's meta records what it held (GPUs per node, nodes,
    engine version). Changing generation.resources after the run reruns no generate job, and
    the statistics, run again, keep the GPU-hours the metas give: not wall time x the new
    gpus (the demo's jobs held none: null before and after, where the old rule said 2 x wall)."""
    # A copy of the session's untouched demo run: the module's finished_run is edited by the
    # tests before this one, and a config derived from it would rerun their edits.
    finished_run = copy_run(demo_workdir, tmp_path / "demo")
    results = finished_run / "results"
    metas = [json.loads(m.read_text()) for m in (results / "generated").glob("*/*.meta.json")]
    held = [m["held"] for m in metas]
    assert held
    # the version the engine reported, where it reports one
    assert all(m["held"]["engine_version"] == m["server_info"].get("version") for m in metas)
    if "SLURM_JOB_ID" not in os.environ:  # the demo's config: gpus 0 on one node
        assert all((h["gpus_per_node"], h["nodes"], h["gpus"]) == (0, 1, 0) for h in held), held
    before = json.loads((results / "stats/summary.json").read_text())
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    config["generation"]["resources"]["gpus"] = 2
    configfile = tmp_path / "gpus2.yaml"
    configfile.write_text(yaml.safe_dump(config))
    run = snakemake(finished_run, "--configfile", str(configfile), "--forcerun", "summarize_stats")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    rules = {rule for rule, _ in jobs_in(run.stdout + run.stderr)}
    assert "summarize_stats" in rules and "generate_shard" not in rules, rules
    assert not rules & {"prepare_prompts", "tokenize_prompts", "merge_shard"}, rules
    after = json.loads((results / "stats/summary.json").read_text())
    scopes = [("overall", before["overall"], after["overall"])]
    scopes += [(c, s, after["categories"][c]) for c, s in before["categories"].items()]
    for name, old, new in scopes:
        for key in ("gpus", "gpu_hours", "output_tokens_per_gpu_hour"):
            assert new["generation"][key] == old["generation"][key], (name, key)
    assert after["overall"]["generation"]["wall_time_s"] > 0


@pytest.fixture(scope="module")
def absolute_run(tmp_path_factory):
    """The `code` category with absolute paths for everything, as on a cluster (/scratch/...
    data, /models/... model, results and journal elsewhere). Its first controller is killed
    with SIGKILL once it holds Snakemake's lock; then a restart, --unlock, and a full run."""
    root = tmp_path_factory.mktemp("abs")
    workdir = root / "wf"
    workdir.mkdir()
    copy_workflow(workdir)
    models, scratch = root / "models", root / "scratch"
    shutil.copytree(ROOT / "sample/model", models / "tiny")
    shutil.copytree(ROOT / "sample/data/code", scratch / "code")
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["results_dir"] = str(root / "out" / "results")
    config["journal_dir"] = str(root / "out" / "journal")
    config["tokenizer"]["path"] = config["generation"]["model"] = str(models / "tiny")
    code = config["categories"]["code"] | {"sources": [str(scratch / "code" / "*.jsonl")]}
    config["categories"] = {"code": code}
    configfile = root / "absolute.yaml"
    configfile.write_text(yaml.safe_dump(config))
    args = ["--configfile", str(configfile)]

    argv = [str(BIN / "snakemake"), "--profile", "profiles/local", "--cores", "2", *args]
    controller = subprocess.Popen(
        argv, cwd=workdir, env=tool_env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    locks, deadline = workdir / ".snakemake" / "locks", time.monotonic() + 300
    while not any(locks.glob("*.lock")):
        assert controller.poll() is None, "the controller ended before it took the lock"
        assert time.monotonic() < deadline, "no lock after 300 s"
        time.sleep(0.1)
    os.killpg(controller.pid, signal.SIGKILL)  # the controller and the jobs it started
    controller.wait()
    return {
        "workdir": workdir,
        "root": root,
        "config": config,
        "locked": snakemake(workdir, *args),
        "unlock": snakemake(workdir, *args, "--unlock"),
        "run": snakemake(workdir, *args),
    }


def test_killed_controller_lock_says_how_to_unlock(absolute_run):
    locked = absolute_run["locked"]
    said = locked.stdout + locked.stderr
    assert locked.returncode != 0
    assert "Directory cannot be locked" in said, said[-4000:]
    hint = next(line for line in said.splitlines() if line.strip().startswith("snakemake "))
    assert "--profile profiles/local" in hint and "--configfile" in hint, hint
    assert hint.strip().endswith("--unlock"), hint
    assert absolute_run["unlock"].returncode == 0, absolute_run["unlock"].stderr[-4000:]
    run = absolute_run["run"]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    assert "tokenmill: Snakemake's lock" not in run.stdout + run.stderr


def test_absolute_paths_everywhere_provenance_and_verify(absolute_run):
    run, config, root = absolute_run["run"], absolute_run["config"], absolute_run["root"]
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    results = Path(config["results_dir"])
    assert check_dataset(absolute_run["workdir"], results, config) > 0
    manifest = json.loads((results / "provenance.json").read_text())
    inputs = [e["path"] for e in manifest["inputs"]["code"]]
    assert inputs == [str(root / "scratch/code/code_sample.jsonl")], inputs
    tok_files = {e["path"] for e in manifest["tokenizer"]["files"]}
    assert str(root / "models/tiny/tokenizer.json") in tok_files, tok_files
    assert manifest["model"]["id"] == str(root / "models/tiny")
    assert any(Path(config["journal_dir"]).rglob("*.parquet"))
    ok = tokenmill(
        absolute_run["workdir"], "verify", str(results / "provenance.json"), str(results)
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr

    from tokenmill.config import check_config
    from tokenmill.provenance.reproduce import reproduce_problems

    resolved = check_config(json.loads(json.dumps(config)), absolute_run["workdir"])
    typed = contracts.Provenance.from_json(manifest)
    assert reproduce_problems(typed, resolved, absolute_run["workdir"]) == []
