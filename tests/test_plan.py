"""`tokenmill plan` against runs whose real numbers are known: the sample data tokenized by a
real snakemake run (prompts and prompt tokens = the tokenized shards' totals, every request
still to send), a pilot through the fake SGLang server (its samples journaled and counted), and
the finished pipeline (nothing left to send; the mean output length = the generated shards')."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import fake_sglang
import helpers
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import BIN, ROOT, copy_workflow, tool_env

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def snakemake(workdir: Path, *args: str) -> None:
    proc = helpers.snakemake(workdir, "--configfile", "plan.yaml", *args)
    assert proc.returncode == 0, helpers.failed(proc)


def plan(workdir: Path, *args: str, config: str = "plan.yaml", rc: int = 0):
    proc = subprocess.run(
        [str(BIN / "tokenmill"), "plan", "--configfile", config, *args],
        cwd=workdir, env=tool_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == rc, proc.stdout + proc.stderr
    if "--json" in args and rc == 0:
        return json.loads(proc.stdout)
    return proc.stdout + proc.stderr


def by_category(p: dict) -> dict:
    return {r["category"]: r for r in p["categories"]}


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """The sample data's code (2 shards), chat (1 shard) and multiturn (`context: regenerated`,
    1 shard) categories, tokenized for real."""
    workdir = copy_workflow(tmp_path_factory.mktemp("plan"))
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["categories"] = {k: cfg["categories"][k] for k in ("code", "chat", "multiturn")}
    cfg["categories"]["chat"]["shards"] = 1
    cfg["categories"]["multiturn"]["shards"] = 1
    cfg["generation"]["sampling"]["max_new_tokens"] = 32
    cfg["generation"]["concurrency"] = 4
    cfg["dataset"]["export_jsonl"] = False
    (workdir / "plan.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    snakemake(workdir, "--until", "tokenize_prompts")
    return workdir


def tokenized_totals(workdir: Path, category: str) -> tuple[int, int]:
    rows = tokens = 0
    for path in sorted((workdir / "results/tokenized" / category).glob("*.parquet")):
        table = pq.read_table(path)
        rows += table.num_rows
        tokens += pc.sum(pc.list_value_length(table.column("prompt_ids"))).as_py()
    return rows, tokens


def test_before_generation_every_prompt_is_still_to_send(tokenized):
    p = by_category(plan(tokenized, "--json"))
    for cat, shards in (("code", 2), ("chat", 1)):
        rows, tokens = tokenized_totals(tokenized, cat)
        r = p[cat]
        assert (r["prompts"], r["prompt_tokens"], r["shards"]) == (rows, tokens, shards), r
        assert r["to_send"] == rows > 0 and r["journaled"] == 0, r
        assert r["output_source"] == "max_new_tokens (upper bound)"
        assert r["expected_output_tokens"] == rows * 32
        assert r["gpu_hours"] is None  # no throughput given
        assert r["to_send_upper_bound"] is False
    # Conversations: every turn of every conversation is still to send (at most: a conversation
    # may end early), and the table says it is an upper bound.
    conv = pq.read_table(tokenized / "results/tokenized/multiturn/000.parquet")
    r = p["multiturn"]
    assert r["prompts"] == conv.num_rows and r["to_send_upper_bound"] is True
    assert r["to_send"] == sum(conv.column("num_turns").to_pylist()) > conv.num_rows
    assert r["expected_output_tokens"] == r["to_send"] * 32
    assert f"<={r['to_send']}" in plan(tokenized)
    # The prefix-cache ceilings of the tokenized prompts, block-aligned: as prefix_reuse's exact
    # ceiling over the category and over its shards, from the token ids themselves.
    from tokenmill import prefix_reuse as pr

    for cat in ("code", "chat", "multiturn"):
        paths = sorted((tokenized / "results/tokenized" / cat).glob("*.parquet"))
        keys = [[pr.key(ids) for ids in pq.read_table(f).column("prompt_ids").to_pylist()]
                for f in paths]  # fmt: skip
        c = p[cat]["cache_ceiling"]
        assert c["block"] == 16
        assert c["category_per_block"] == pr.ceiling(sum(keys, []), 16).share("per_block")
        assert c["shards_per_block"] == pr.sharded_ceiling(keys, 16).share("per_block")
        assert c["shards_per_block"] <= c["category_per_block"] <= c["category_per_token"]
    assert p["code"]["cache_ceiling"]["category_per_block"] > 0  # a shared system prompt
    text = plan(tokenized, "--throughput", "100")
    assert "category" in text and "GPU h" in text and "total" in text, text
    assert "cache ceil shards/cat" in text, text
    t = by_category(plan(tokenized, "--throughput", "100", "--json"))["code"]
    assert t["job_hours"] == round(t["expected_output_tokens"] / 100 / 3600, 3)
    # gpus: 0 (the demo's CPU engine): GPU-hours are unknown, not 0; a small --throughput is
    # echoed as given
    assert t["gpus_per_job"] == 0 and t["gpu_hours"] is None
    text = plan(tokenized, "--throughput", "0.05")
    assert "throughput: 0.05 output tok/s per generate job (--throughput)" in text, text
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert "unknown" in total and " 0.0 " not in total, text


def test_pilot_journals_its_samples_and_measures_them(tokenized, tmp_path):
    workdir = tmp_path / "wf"
    shutil.copytree(tokenized, workdir, symlinks=True)
    cfg = yaml.safe_load((workdir / "plan.yaml").read_text())
    counter = tmp_path / "requests.jsonl"
    cfg["generation"]["launch"]["command"] = [
        "{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}",
        "--port", "{port}", "--counter-file", str(counter),
    ]  # fmt: skip
    (workdir / "pilot.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    before = by_category(plan(workdir, "--json", config="pilot.yaml"))
    p = plan(workdir, "--pilot", "3", "--json", config="pilot.yaml")
    assert fake_sglang.count_requests(counter) == 9 and p["pilot"]["requests"] == 9
    assert p["throughput_source"] == "pilot" and p["throughput_tok_s"] > 0
    for cat, r in by_category(p).items():
        assert r["output_source"] == "pilot n=3", r
        assert r["journaled"] == 3, r
        if cat != "multiturn":
            assert r["to_send"] == before[cat]["to_send"] - 3, r
        else:  # three first turns sent; a conversation they ended drops its later turns
            assert r["to_send"] <= before[cat]["to_send"] - 3, r
        assert r["job_hours"] is not None and r["gpu_hours"] is None  # gpus: 0
        # the fake answers 1-5 tokens and a stop token: nothing cut at max_new_tokens=32
        assert (r["truncated"], r["truncated_share"]) == (0, 0.0), r
        assert 2 <= r["max_new_tokens_for_keep"] <= 6, r
    assert p["pilot"]["output_tokens"] > 0
    # The next plan reads the pilot's samples from the journal: nothing is paid twice.
    after = by_category(plan(workdir, "--json", config="pilot.yaml"))
    assert {c: (r["journaled"], r["output_source"]) for c, r in after.items()} == {
        "code": (3, "journal n=3"),
        "chat": (3, "journal n=3"),
        "multiturn": (3, "journal n=3"),
    }
    assert after["multiturn"]["to_send"] == by_category(p)["multiturn"]["to_send"]


def test_after_the_run_nothing_is_left_and_lengths_are_measured(tokenized):
    snakemake(tokenized)
    p = by_category(plan(tokenized, "--json"))
    for cat in ("code", "chat"):
        rows, tokens = tokenized_totals(tokenized, cat)
        lengths = []
        for path in (tokenized / "results/generated" / cat).glob("*.parquet"):
            lengths += pc.list_value_length(pq.read_table(path).column("output_ids")).to_pylist()
        r = p[cat]
        assert (r["prompts"], r["prompt_tokens"], r["to_send"]) == (rows, tokens, 0), r
        assert r["journaled"] == rows and r["expected_output_tokens"] == 0, r
        assert r["output_source"] == f"journal n={len(lengths)}", r
        assert r["mean_output_tokens"] == round(sum(lengths) / len(lengths), 1), r
    # Conversations: the journal replayed turn by turn, as the generate job did, finds every
    # generated turn (more than one per conversation) and nothing left to send.
    r = p["multiturn"]
    turns = pq.read_table(tokenized / "results/generated/multiturn/000.parquet")
    lengths = pc.list_value_length(turns.column("output_ids")).to_pylist()
    assert (r["to_send"], r["expected_output_tokens"]) == (0, 0), r
    assert r["journaled"] == turns.num_rows > r["prompts"], r
    assert r["mean_output_tokens"] == round(sum(lengths) / len(lengths), 1), r


def test_bad_arguments_and_config_fail_clearly(tokenized, tmp_path):
    out = plan(tokenized, "--throughput", "-1", rc=2)
    assert "--throughput must be a positive number" in out
    cfg = yaml.safe_load((tokenized / "plan.yaml").read_text())
    cfg["generation"]["resources"]["gpus"] = "eight"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(cfg))
    out = plan(tokenized, config=str(tmp_path / "bad.yaml"), rc=1)
    assert "config key 'generation.resources.gpus'" in out, out


def test_one_throughput_and_the_counts_asked_in_the_table(tokenized, tmp_path):
    """The client's own progress line and the plan's throughput are one measurement; the table
    says pilot n=2 when 2 were asked."""
    workdir = tmp_path / "wf"
    shutil.copytree(tokenized, workdir, symlinks=True)
    cfg = yaml.safe_load((workdir / "plan.yaml").read_text())
    cfg["generation"]["launch"]["command"] = [
        "{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}",
        "--port", "{port}", "--startup-delay", "2", "--latency", "0.2",
    ]  # fmt: skip
    (workdir / "pilot.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = plan(workdir, "--pilot", "2", config="pilot.yaml")
    client = re.findall(r"progress \d+/\d+ .*out_tok/s=([\d.]+)", out)
    table = re.findall(r"throughput: ([\d.]+) output tok/s per generate job \(pilot", out)
    assert client and table, out
    # the same tokens over the same requests (the engine's 2 s start-up in neither)
    assert float(table[0]) == pytest.approx(float(client[-1]), rel=0.1), out
    assert out.count("throughput:") == 1
    assert re.search(r"pilot n=2\s", out), out


def test_before_any_run_plan_prints_the_one_command_to_run(tmp_path):
    workdir = copy_workflow(tmp_path / "fresh")
    out = plan(workdir, config="config.yaml")
    warnings = [line for line in out.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, out
    assert warnings[0].endswith(
        "run first (CPU only, no engine): snakemake --profile profiles/local --configfile "
        "config.yaml --until tokenize_prompts"
    ), out


@pytest.mark.parametrize(
    ("outputs", "keep", "expected"),
    [
        ([], 0.95, (0, None, None)),
        ([(10, False)] * 19 + [(40, False)], 0.95, (0, 0.0, 10)),
        ([(10, False)] * 19 + [(40, False)], 1.0, (0, 0.0, 40)),
        ([(i, False) for i in range(1, 20)] + [(32, True)], 0.95, (1, 0.05, 19)),
        ([(5, False)] * 18 + [(32, True)] * 2, 0.95, (2, 0.1, None)),  # too many cut: unknown
    ],
)
def test_truncated_share_and_the_max_new_tokens_that_keeps_a_share(outputs, keep, expected):
    from tokenmill.plan import truncation

    t = truncation(outputs, keep)
    assert (t["truncated"], t["truncated_share"], t["max_new_tokens_for_keep"]) == expected
