"""stats + card: known numbers on a small hand-built results tree, conservation, loaders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_merge import (
    GEN_CFG,
    build_tokenizer,
    gen_row,
    rules,
    write_generated,
    write_tokenized,
)

from tokenmill import contracts
from tokenmill.dataset import card, draft_vocab, export, merge, stats, validate, verdict

CONFIG = {
    "results_dir": "results",
    "tokenizer": {"path": "tok", "revision": None, "chat_template_kwargs": {"thinking": True}},
    "categories": {
        "chat": {"sources": ["data/chat.jsonl"], "format": "sharegpt", "shards": 2},
        "code": {"sources": ["data/code.jsonl"], "format": "instruction", "shards": 1},
    },
    "generation": GEN_CFG,
    "dataset": {
        "max_sequence_tokens": 12,
        "think_end_token": "</think>",
        "draft_vocab_size": 3,
        "draft_vocab_formats": ["speculators"],  # no torch needed for vocab_mapping.pt
    },
}


def job_record(cat: str, shard: str, wall: float, gen_s: float | None = None, gpus=None,
               nodes: int = 1, from_journal: int = 0, attempts: int = 1) -> dict:  # fmt: skip
    """A generate job record (contracts.GenerateJobRecord) of `attempts` attempts of `wall`
    seconds each (the last one ok), on `gpus` GPUs per node (None: external servers)."""
    total = None if gpus is None else gpus * nodes
    slurm = contracts.SlurmJob("42", "node1", 0, None)
    tries = [
        contracts.Attempt(
            stage="generate", category=cat, shard=shard, id=f"node1:1:{shard}:{i}",
            host="node1", pid=1, slurm=slurm, started=f"2024-01-01T00:0{i}:00+00:00",
            ended=f"2024-01-01T00:0{i}:{int(wall):02d}+00:00",
            status="ok" if i == attempts - 1 else "failed",
            cause=None if i == attempts - 1 else "boom", deterministic=False, gpus=total,
            wall_s=wall, log="logs/generate.log",
        )
        for i in range(attempts)
    ]  # fmt: skip
    timing = contracts.GenerateTiming(
        startup_s=0.0, generation_s=wall if gen_s is None else gen_s, write_s=0.0,
        total_s=wall, imports_s=0.0, replay_s=0.0, engine_start_s=None,
    )  # fmt: skip
    held = contracts.Held(gpus, nodes if gpus is not None else None, total, "0.0-test", "test")
    return contracts.GenerateJobRecord(
        category=cat, shard=shard, generation_fingerprint="fp", mode="managed",
        engine="sglang", context=None, start_time=tries[-1].started, end_time=tries[-1].ended,
        host="node1", pid=1, slurm=slurm,
        counts=contracts.GenerateCounts(from_journal=from_journal), timing=timing, rates=None,
        held=held, attempts=tries, journal=contracts.JournalUse(dir="journal", compaction=None),
        engine_started=True, server_info={"version": "0.0-test"},
    ).to_json()  # fmt: skip


def write_record(r: Path, cat: str, shard: str, **kw) -> None:
    (r / "generated" / cat / f"{shard}.meta.json").write_text(
        json.dumps(job_record(cat, shard, **kw))
    )


def _rejected(path: Path, stage, cat, pids, reason="bad"):
    rows = [{"stage": stage, "category": cat, "reason": reason, "prompt_id": p} for p in pids]
    contracts.write_table(contracts.rejected_table(rows), path, contracts.REJECTED, stage)


def _prompts(path: Path, pids, rejected):
    t = pa.table(
        {
            "prompt_id": pids,
            "source": ["x"] * len(pids),
            "messages": ["[]"] * len(pids),
            "tools": [None] * len(pids),
        }
    )
    meta = {
        "tokenmill.records_in": len(pids) + rejected,
        "tokenmill.records_kept": len(pids),
        "tokenmill.records_rejected": rejected,
    }
    contracts.write_table(t, path, contracts.PROMPTS, "prepare", meta)


def build_results(root: Path) -> Path:
    """A complete small results tree: chat (2 shards) and code (1 shard)."""
    r = root / "results"
    _prompts(r / "prompts" / "chat.parquet", ["a", "b", "c", "d"], rejected=1)
    _rejected(
        r / "rejected" / "prepare" / "chat.parquet", "prepare", "chat", [None], "no_user_turn"
    )
    _prompts(r / "prompts" / "code.parquet", ["x"], rejected=0)
    _rejected(r / "rejected" / "prepare" / "code.parquet", "prepare", "code", [])
    for cat in ("chat", "code"):
        _rejected(r / "rejected" / "tokenize" / f"{cat}.parquet", "tokenize", cat, [])
    shards = {
        ("chat", "000"): (
            {"a": [5, 6, 3], "b": [7, 3]},
            [("a", [8, 4, 9, 2], "stop", 1), ("b", [4, 2], "stop", 0)],
            [],
        ),
        ("chat", "001"): ({"c": [5, 3], "d": [6, 6, 6, 3]}, [("c", [8, 9], "length", 0)], ["d"]),
        ("code", "000"): ({"x": [5]}, [("x", [4, 10, 2], "stop", 0)], []),
    }
    walls = {("chat", "000"): 10.0, ("chat", "001"): 5.0, ("code", "000"): 20.0}
    for (cat, shard), (prompts, gens, gen_rej) in shards.items():
        tok = r / "tokenized" / cat / f"{shard}.parquet"
        write_tokenized(tok, prompts, cat, shard)
        gen = r / "generated" / cat / f"{shard}.parquet"
        rows = [gen_row(p, prompts[p], out, fin, cached=c) for p, out, fin, c in gens]
        write_generated(gen, rows, rejected=len(gen_rej))
        write_record(r, cat, shard, wall=walls[(cat, shard)])
        grej = r / "rejected" / "generate" / cat / f"{shard}.parquet"
        _rejected(grej, "generate", cat, gen_rej, "engine_error")
        merge.merge_shard(
            tok,
            gen,
            r / "dataset" / cat / f"{shard}.parquet",
            r / "rejected" / "merge" / cat / f"{shard}.parquet",
            rules(),
            merge.keys.generation_fingerprint(GEN_CFG),
            cat,
            shard,
            generate_rejected=grej,
            counts_out=r / "token_counts" / cat / f"{shard}.parquet",
        )
        (r / "export" / cat).mkdir(parents=True, exist_ok=True)
        export.export_jsonl(
            r / "dataset" / cat / f"{shard}.parquet", r / "export" / cat / f"{shard}.jsonl"
        )
    # What the verdict, sum and draft_vocab rules add (the .pt left out: no torch needed).
    for cat in ("chat", "code"):
        out = r / "rejected" / "verdict" / f"{cat}.json"
        assert verdict.main(["--category", cat, "--config-json", json.dumps(CONFIG),
                             "--results-dir", str(r), "--out", str(out)]) == 0  # fmt: skip
    counts = r / "token_counts"
    for cat in ("chat", "code"):
        out = counts / f"{cat}.parquet"
        assert (
            draft_vocab.main(
                ["sum", "--category", cat, "--counts", str(counts / cat)] + ["--out", str(out)]
            )
            == 0
        )
    sums = [str(counts / "chat.parquet"), str(counts / "code.parquet")]
    assert (
        draft_vocab.main(["sum", "--all", "--counts", *sums, "--out", str(counts / "_all.parquet")])
        == 0
    )
    draft_vocab.write_mapping(
        r / "dataset" / "vocab_mapping",
        draft_vocab.sum_counts(sums),
        3,
        [2],
        24,
        ["speculators"],
        by_category={c: draft_vocab.read_counts(counts / f"{c}.parquet") for c in ("chat", "code")},
    )
    # The token facts, statistics and card, as the pipeline ends: every declared file exists.
    facts = validate.TokenFacts(
        vocab_size=rules().vocab_size, stop_ids=(2, 1), think_start_id=None, think_end_id=4,
        resolved_from=validate.facts_source(CONFIG["dataset"], GEN_CFG),
    )  # fmt: skip
    validate.write_token_facts(r / "tokenizer" / "token_facts.json", facts, "tokfp-123")
    config = json.dumps(CONFIG)
    assert stats.main(["--results-dir", str(r), "--config-json", config,
                       "--out-dir", str(r / "stats")]) == 0  # fmt: skip
    assert card.main(["--results-dir", str(r), "--config-json", config,
                      "--stats", str(r / "stats" / "summary.json"),
                      "--out", str(r / "dataset" / "README.md")]) == 0  # fmt: skip
    return r


def test_stats_known_numbers(tmp_path):
    r = build_results(tmp_path)
    out = tmp_path / "stats"
    assert (
        stats.main(
            ["--results-dir", str(r), "--config-json", json.dumps(CONFIG), "--out-dir", str(out)]
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    chat = s["categories"]["chat"]
    assert chat["stages"]["prepare"] | {"reasons": None} == {
        "in": 5,
        "kept": 4,
        "rejected": 1,
        "reasons": None,
        "in_source": "metadata",
    }
    assert chat["stages"]["prepare"]["reasons"] == {"no_user_turn": 1}
    assert chat["stages"]["tokenize"]["in"] == 4 and chat["stages"]["tokenize"]["kept"] == 4
    gen = chat["stages"]["generate"]
    assert (gen["in"], gen["kept"], gen["rejected"]) == (4, 3, 1)
    assert gen["reasons"] == {"engine_error": 1}
    m = chat["stages"]["merge"]
    assert (m["in"], m["kept"], m["rejected"], m["reasons"]) == (3, 2, 1, {"truncated": 1})
    assert chat["finish_types"] == {"length": 1, "stop": 2}
    assert chat["lengths"]["total_tokens"] == {
        "count": 2,
        "sum": 11,
        "mean": 5.5,
        "p50": 5.5,
        "p90": 6.7,
        "p99": 6.97,
        "max": 7,
    }
    assert chat["lengths"]["reasoning_tokens"]["sum"] == 3  # a: 2, b: 1
    assert chat["prefix_cache"] == {
        "samples": 3,
        "samples_reporting": 3,
        "cached_tokens": 1,
        "prompt_tokens": 7,
        "hit_rate": 0.142857,
        # 2-3 token prompts share no whole 16-token unit
        "ceiling": {"block": 16, "prompt_tokens": 7, "category_per_token": 0.0,
                    "category_per_block": 0.0, "shards_per_token": 0.0, "shards_per_block": 0.0},
    }  # fmt: skip
    g = chat["generation"]
    assert (g["wall_time_s"], g["output_tokens"]) == (15.0, 8)
    assert g["output_tokens_per_s"] == pytest.approx(0.533, abs=1e-3)
    # External servers on a CPU config (gpus 0): GPU-hours are unknown, not "1 GPU".
    assert (g["gpus"], g["gpu_hours"], g["output_tokens_per_gpu_hour"]) == (None, None, None)
    assert s["categories"]["code"]["generation"]["wall_time_s"] == 20.0
    o = s["overall"]
    assert o["lengths"]["prompt_tokens"] | {} == {
        "count": 3,
        "sum": 6,
        "mean": 2.0,
        "p50": 2.0,
        "p90": 2.8,
        "p99": 2.98,
        "max": 3,
    }
    assert o["lengths"]["total_tokens"]["p90"] == 6.4
    assert o["stages"]["merge"]["kept"] == 3
    assert s["conservation"] == {"ok": True, "problems": []}
    md = (out / "summary.md").read_text()
    assert "| chat | merge | 3 | 2 | 1 | truncated: 1 |" in md
    for name in stats.PLOT_FILES:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Token coverage: chat's loss tokens are a's output 8 4 9 2 and b's 4 2 (c was truncated).
    assert set(s["categories"]) == {"chat", "code"}  # dataset/vocab_mapping is no category
    cov = chat["token_coverage"]
    assert (cov["loss_tokens"], cov["distinct_ids"], cov["vocab_size"]) == (6, 4, 20)
    # the draft row: the written mapping's coverage (vocab_mapping.json), marked mapping
    assert cov["top_n"][0] == {
        "n": 3,
        "ids": 3,
        "capped": False,
        "share": 0.833333,
        "draft": True,
        "mapping": True,
    }
    assert cov["top_n"][1] == {"n": 8192, "ids": 20, "capped": True, "share": 1.0}
    assert cov["ids_for_share"] == {"0.9": 4, "0.95": 4, "0.99": 4, "0.999": 4}
    allcov = o["token_coverage"]
    assert (allcov["loss_tokens"], allcov["distinct_ids"]) == (9, 5)  # + code's 4 10 2
    assert allcov["top_n"][0]["share"] == round(7 / 9, 6)  # 4 and 2 (3 each), then 8 (1)
    assert "## Token coverage (loss-masked tokens)" in md
    assert "| draft vocabulary (3 ids) | top 8,192 (all 20) |" in md
    assert "| chat | 6 | 4 | 83.33% | 100.00% |" in md
    assert "| **all** | 9 | 5 | 77.78% |" in md
    assert (out / stats.COVERAGE_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_stats_conservation_mismatch_exits_nonzero(tmp_path, capsys):
    r = build_results(tmp_path)
    (r / "rejected" / "merge" / "chat" / "001.parquet").unlink()  # a rejected row disappears
    rc = stats.main(
        [
            "--results-dir",
            str(r),
            "--config-json",
            json.dumps(CONFIG),
            "--out-dir",
            str(tmp_path / "stats"),
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "category chat, stage merge: in=3 != kept=2 + rejected=0" in err
    s = json.loads((tmp_path / "stats" / "summary.json").read_text())
    assert s["conservation"]["ok"] is False


def test_stats_detects_lost_prompts_between_stages(tmp_path):
    r = build_results(tmp_path)
    # tokenize claims fewer prompts than prepare kept
    write_tokenized(r / "tokenized" / "code" / "000.parquet", {})
    summary, _ = stats.collect(r, CONFIG)
    assert any("category code, stage tokenize" in p for p in summary["conservation"]["problems"])


def test_card_loads_with_datasets(tmp_path):
    r = build_results(tmp_path)
    out = tmp_path / "stats"
    stats.main(
        ["--results-dir", str(r), "--config-json", json.dumps(CONFIG), "--out-dir", str(out)]
    )
    readme = r / "dataset" / "README.md"
    assert (
        card.main(
            [
                "--results-dir",
                str(r),
                "--config-json",
                json.dumps(CONFIG),
                "--stats",
                str(out / "summary.json"),
                "--out",
                str(readme),
            ]
        )
        == 0
    )
    text = readme.read_text()
    assert text.startswith("---\n") and "config_name: chat" in text and "tokfp-123" in text
    assert "EAGLE-3" in text and "| `loss_mask` |" in text
    assert "unknown GPU-hours" in text  # external servers: not the run's GPUs to count
    import datasets

    cache = str(tmp_path / "hf")
    chat = datasets.load_dataset(str(r / "dataset"), name="chat", split="train", cache_dir=cache)
    assert sorted(chat["prompt_id"]) == ["a", "b"]
    code = datasets.load_dataset(str(r / "dataset"), name="code", split="train", cache_dir=cache)
    assert code["input_ids"] == [[5, 4, 10, 2]]
    everything = datasets.load_dataset(str(r / "dataset"), split="train", cache_dir=cache)
    assert len(everything) == 3
    # The draft vocabulary beside the category folders is no config, and the card says what it is.
    assert (r / "dataset" / "vocab_mapping" / "d2t-3.npy").is_file()
    assert "config_name: vocab_mapping" not in text
    assert "## Draft vocabulary" in text and "`vocab_mapping/d2t-3.npy`" in text
    # A mapping left from an earlier config with a draft size is not described as this one's.
    assert "## Draft vocabulary" not in card.render(r, dict(CONFIG, dataset={}), None)
    assert pq.read_table(r / "dataset" / "code" / "000.parquet").num_rows == 1


def _stats(r: Path, config: dict, tmp_path: Path, basedir: Path | None = None) -> dict:
    out = tmp_path / "stats"
    argv = ["--results-dir", str(r), "--config-json", json.dumps(config), "--out-dir", str(out)]
    assert stats.main(argv + ["--basedir", str(basedir or tmp_path)]) == 0
    return json.loads((out / "summary.json").read_text())


def test_unknown_is_null_never_a_made_up_number(tmp_path):
    """vLLM reports no cached tokens: the hit rate is unknown, not 0.0. GPU-hours exist only
    for managed engines on GPUs, and throughput counts only shards generated by their own
    job, with the generation time (engine start-up excluded) when the meta has it."""
    r = build_results(tmp_path)
    code = r / "generated" / "code" / "000.parquet"
    t = pq.read_table(code)
    t = t.set_column(
        t.schema.get_field_index("cached_tokens"), "cached_tokens", pa.nulls(1, pa.int32())
    )
    contracts.write_table(t, code, contracts.GENERATED, "generate", contracts.read_metadata(code))
    write_record(r, "chat", "000", wall=10.0, gen_s=6.0)  # start-up 4 s
    write_record(r, "chat", "001", wall=5.0, from_journal=1)  # samples read back from the journal

    config = json.loads(json.dumps(CONFIG))
    s = _stats(r, config, tmp_path)
    code_cache = s["categories"]["code"]["prefix_cache"]
    assert code_cache | {"ceiling": None} == {
        "samples": 1,
        "samples_reporting": 0,
        "cached_tokens": None,
        "prompt_tokens": None,
        "hit_rate": None,
        "ceiling": None,
    }
    assert code_cache["ceiling"]["prompt_tokens"] == 1  # the ceiling is known without the engine
    # overall: only the chat samples reported
    assert s["overall"]["prefix_cache"]["hit_rate"] == pytest.approx(1 / 7, abs=1e-6)
    g = s["categories"]["chat"]["generation"]
    assert (g["wall_time_s"], g["generation_time_s"]) == (15.0, 11.0)
    assert (g["shards"], g["timed_shards"]) == (2, 1)
    assert g["output_tokens_per_s"] == pytest.approx(6 / 6.0)  # shard 000: 6 tokens in 6 s
    assert g["gpu_hours"] is None
    md = (tmp_path / "stats" / "summary.md").read_text()
    assert "| code | stop: 1 | unknown |" in md

    # A managed engine on GPUs: GPU-hours are wall time x the GPUs each job's record says it
    # held (start-up included); the config's resources are not read (they may have changed).
    write_record(r, "chat", "000", wall=10.0, gen_s=6.0, gpus=2)
    write_record(r, "chat", "001", wall=5.0, from_journal=1, gpus=2)
    config["generation"] = dict(GEN_CFG, mode="managed", resources={"gpus": 7})
    g = _stats(r, config, tmp_path)["categories"]["chat"]["generation"]
    assert g["gpus"] == 2 and g["gpu_hours"] == pytest.approx(15.0 * 2 / 3600, abs=1e-6)
    assert g["output_tokens_per_gpu_hour"] == pytest.approx(6 / (10.0 * 2 / 3600), rel=1e-4)

    # One engine on 2 nodes of 4 GPUs each, and a category whose jobs held 1 GPU per node:
    # a job's GPUs are per node x nodes, and the overall GPU-hours add the categories up.
    write_record(r, "chat", "000", wall=10.0, gen_s=6.0, gpus=4, nodes=2)
    write_record(r, "chat", "001", wall=5.0, from_journal=1, gpus=4, nodes=2)
    write_record(r, "code", "000", wall=20.0, gpus=1, nodes=2)
    cats = CONFIG["categories"]  # today's resources differ: not read
    config["categories"] = {
        "chat": cats["chat"],
        "code": {**cats["code"], "resources": {"gpus": 5}},
    }
    s = _stats(r, config, tmp_path)
    chat, code = (s["categories"][c]["generation"] for c in ("chat", "code"))
    assert (chat["gpus"], code["gpus"]) == (8, 2)
    assert chat["gpu_hours"] == pytest.approx(15.0 * 8 / 3600, abs=1e-6)
    assert code["gpu_hours"] == pytest.approx(20.0 * 2 / 3600, abs=1e-6)
    o = s["overall"]["generation"]
    assert o["gpus"] == "mixed"
    assert o["gpu_hours"] == pytest.approx((15.0 * 8 + 20.0 * 2) / 3600, abs=1e-6)


def test_gpu_hours_come_from_what_each_job_held_not_the_config(tmp_path):
    """Two jobs of one category that held different GPUs (the config's resources changed
    between them): each counts its own; the config's resources now change nothing. Every
    attempt counts: a job that failed twice before it succeeded paid for three."""
    r = build_results(tmp_path)
    write_record(r, "chat", "000", wall=10.0, gpus=2)  # 10 s x 2 GPUs
    write_record(r, "chat", "001", wall=5.0, gpus=8)  # 5 s x 8 GPUs
    write_record(r, "code", "000", wall=20.0, gpus=None)  # an external server: not the run's
    config = json.loads(json.dumps(CONFIG))
    sums = []
    for gpus in (1, 4):
        config["generation"] = dict(GEN_CFG, mode="managed", resources={"gpus": gpus})
        s = _stats(r, config, tmp_path)
        chat = s["categories"]["chat"]["generation"]
        assert chat["gpus"] == "mixed"
        assert chat["gpu_hours"] == pytest.approx((10.0 * 2 + 5.0 * 8) / 3600, abs=1e-6)
        assert s["categories"]["code"]["generation"]["gpu_hours"] is None
        sums.append(s["overall"]["generation"]["gpu_hours"])
    assert sums[0] == sums[1] == pytest.approx(60.0 / 3600, abs=1e-6)

    write_record(r, "chat", "001", wall=5.0, gpus=8, attempts=3)  # two failed attempts first
    s = _stats(r, config, tmp_path)
    chat = s["categories"]["chat"]["generation"]
    assert chat["gpu_hours"] == pytest.approx((10.0 * 2 + 3 * 5.0 * 8) / 3600, abs=1e-6)
    assert (chat["attempts"], chat["failed_attempts"], chat["wall_time_s"]) == (4, 2, 25.0)
    md = (tmp_path / "stats" / "summary.md").read_text()
    assert "| chat | length: 1, stop: 2 | 0.14 | 4 (2) | 25.00 |" in md, md


@pytest.mark.parametrize("merge_start_id", [3, None])
def test_unterminated_reasoning_is_counted_as_reasoning(tmp_path, merge_start_id):
    """<think> = 3, </think> = 4. p: the template opened the block (Kimi), the output never
    closed it; r: the output opened it (Qwen3) and never closed it; q: closed; s: the prompt
    holds a closed empty block (thinking off), the output is all answer. Merge counts p and r as
    reasoning itself (start id 3); a dataset merged without it (None: as earlier versions did,
    all answer) is corrected by stats to the same figures."""
    r = tmp_path / "results"
    prompts = {"p": [5, 3], "q": [5, 3], "r": [5], "s": [5, 3, 8, 4]}
    outputs = {"p": [6, 7, 2], "q": [6, 4, 7, 2], "r": [3, 6, 2], "s": [7, 2]}
    tok, gen = r / "tokenized" / "t" / "000.parquet", r / "generated" / "t" / "000.parquet"
    write_tokenized(tok, prompts, "t")
    write_generated(gen, [gen_row(p, prompts[p], outputs[p]) for p in prompts])
    write_record(r, "t", "000", wall=1.0)
    merge.merge_shard(
        tok,
        gen,
        r / "dataset" / "t" / "000.parquet",
        r / "rejected" / "merge" / "t" / "000.parquet",
        rules(think_start_id=merge_start_id),
        merge.keys.generation_fingerprint(GEN_CFG),
        "t",
        "000",
    )
    merged = pq.read_table(r / "dataset" / "t" / "000.parquet").to_pylist()
    p_row = next(x for x in merged if x["prompt_id"] == "p")
    assert p_row["num_answer_tokens"] == (0 if merge_start_id else 3)
    build_tokenizer(tmp_path / "tok")
    config = json.loads(json.dumps(CONFIG)) | {"categories": {"t": CONFIG["categories"]["chat"]}}
    s = _stats(r, config, tmp_path, basedir=tmp_path)
    t = s["categories"]["t"]
    assert t["reasoning"] == {
        "think_end_token": "</think>",
        "with_think_end": 1,
        "unterminated": 2,
        "without_reasoning": 1,
    }
    assert t["lengths"]["reasoning_tokens"]["sum"] == 3 + 2 + 3 + 0
    assert t["lengths"]["answer_tokens"]["sum"] == 0 + 2 + 0 + 2
    md = (tmp_path / "stats" / "summary.md").read_text()
    assert "| t | </think> | 1 | 2 | 1 |" in md


def test_think_rule_is_one_for_merge_and_stats(tmp_path):
    """A tokenizer with </think> but without <think> (the default think-open token): merge's
    rules and stats' think ids come from the same rule (validate.think_ids) and agree: no
    think-open id, nothing counts as unterminated. Stats used to raise on such a tokenizer.
    An explicitly configured think-open token that the tokenizer lacks fails both alike."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenmill.dataset import validate
    from tokenmill.tokenization.tokenizer import load_tokenizer

    vocab = [t for t in ("<unk>", "<eos>", "<|im_end|>", "</think>", "w0", "w1")]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    # "<think>" splits into "<", "think", ">": not one token of this tokenizer
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<eos>",
        additional_special_tokens=["<|im_end|>", "</think>"],
    )
    fast.save_pretrained(str(tmp_path / "tok"))
    tok_cfg = {"path": str(tmp_path / "tok")}
    tokenizer = load_tokenizer(tok_cfg)
    ds = {"think_end_token": "</think>"}
    merge_rules = validate.rules_from_config(ds, GEN_CFG, tokenizer)
    stats_ids = stats.ThinkTokens(ds, tok_cfg).get()
    assert stats_ids == (merge_rules.think_start_id, merge_rules.think_end_id) == (None, 3)
    ids = np.array([4, 5, 3, 4], np.int32)  # prompt w0 w1, output </think> w0: nothing open
    assert not validate.unterminated(ids, np.array([0, 4]), np.array([2]), *stats_ids).any()

    ds = {"think_end_token": "</think>", "think_start_token": "<think>"}
    with pytest.raises(ValueError, match="<think>"):
        validate.rules_from_config(ds, GEN_CFG, tokenizer)
    with pytest.raises(ValueError, match="<think>"):
        stats.ThinkTokens(ds, tok_cfg).get()


def test_stats_and_card_name_the_key_of_a_partial_config(tmp_path, capsys):
    """A stage command given a partial config by hand fails naming the missing key."""
    partial = json.dumps({"tokenizer": {"path": "tok"}, "categories": {"chat": {"shards": 1}}})
    argv = ["--results-dir", str(tmp_path), "--config-json", partial]
    assert stats.main([*argv, "--out-dir", str(tmp_path / "stats")]) == 1
    assert "categories.chat" in capsys.readouterr().err
    assert card.main([*argv, "--out", str(tmp_path / "README.md")]) == 1
    assert "categories.chat" in capsys.readouterr().err


def test_card_rounds_its_statistics_and_describes_prompt_id_as_the_readme(tmp_path):
    r = build_results(tmp_path)
    summary = _stats(r, CONFIG, tmp_path)
    summary["categories"]["chat"]["lengths"]["prompt_tokens"]["mean"] = 288.8148
    summary["categories"]["chat"]["lengths"]["output_tokens"]["p99"] = 224.66
    generation = summary["overall"]["generation"]
    generation.update(output_tokens_per_s=54.31234, gpu_hours=0.123456)
    text = card.render(r, CONFIG, contracts.StatsSummary.from_json(summary))
    chat = next(line for line in text.splitlines() if line.startswith("| chat |"))
    assert "| 288.8 |" in chat and "/ 224.7 |" in chat, chat
    assert "54.3 output tokens/s, 0.123 GPU-hours" in text
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    card_row = next(line for line in text.splitlines() if line.startswith("| `prompt_id` |"))
    readme_row = next(line for line in readme.splitlines() if line.startswith("| `prompt_id` |"))
    assert card_row.split("|")[3].strip() == readme_row.split("|")[3].strip()


def test_summary_html_has_every_markdown_table_row_as_escaped_cells(tmp_path):
    """summary.html (the report's landing page) and summary.md are one document: the same
    tables, row for row, with the text escaped (a think token is text, not a tag)."""
    from html.parser import HTMLParser

    r = build_results(tmp_path)
    out = tmp_path / "stats"
    argv = ["--results-dir", str(r), "--config-json", json.dumps(CONFIG), "--out-dir", str(out)]
    assert stats.main(argv) == 0

    class Cells(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows, self.cell, self.tags = [], None, []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)
            if tag == "tr":
                self.rows.append([])
            elif tag in ("td", "th"):
                self.cell = ""

        def handle_endtag(self, tag):
            if tag in ("td", "th"):
                self.rows[-1].append(self.cell)
                self.cell = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell += data

    page = Cells()
    page.feed((out / "summary.html").read_text())
    md_rows = [
        [c.strip().replace("**", "").replace("`", "") for c in line.strip("|").split("|")]
        for line in (out / "summary.md").read_text().splitlines()
        if line.startswith("|") and not line.startswith("|---")
    ]
    assert page.rows == md_rows
    assert any("</think>" in cell for row in page.rows for cell in row)  # shown, not parsed
    assert "think" not in page.tags and "strong" in page.tags  # **all** is bold


def test_prefix_cache_ceilings_count_each_prompt_sent(tmp_path):
    """Over the prompts the generated rows were sent (a prompt sampled twice counts twice; one
    never generated not at all), per shard as assigned and over the category."""
    from tokenmill import layout

    lay = layout.Layout(str(tmp_path / "results"), str(tmp_path / "journal"))
    head = list(range(100, 140))  # 40 shared tokens: 2 whole 16-token units
    prompts = {
        "000": {"p1": head + [1], "p2": head + [2]},
        "001": {"p3": head + [3], "p4": [9] * 60},
    }
    sent = {"000": ["p1", "p1", "p2"], "001": ["p3"]}
    generated = []
    for shard, ps in prompts.items():
        write_tokenized(Path(lay.tokenized("agent", shard)), ps, "agent", shard)
        rows = [gen_row(p, ps[p], [4, 2], key=f"{p}-{i}") for i, p in enumerate(sent[shard])]
        path = Path(lay.generated("agent", shard))
        write_generated(path, rows)
        generated.append(path)
    category, shards = stats._ceilings(lay, "agent", generated, 32)
    assert category.prompt_tokens == shards.prompt_tokens == 4 * 41
    # shard 000: p1 again (40 of 41 tokens), p2 after p1 (32); shard 001: p3 alone (0)
    assert (shards.per_token, shards.per_block) == (40 + 32, 32 + 32)
    # one engine for all: p3 after p2 as well
    assert (category.per_token, category.per_block) == (40 + 32 + 32, 32 + 32 + 32)
    summary = stats._cache(
        {"samples": 4, "samples_reporting": 0, "cached_tokens": 0, "prompt_tokens": 0},
        (category, shards),
    )
    assert summary["hit_rate"] is None  # the engine reported nothing: unknown, not 0
    assert summary["ceiling"]["category_per_block"] == round(96 / 164, 6)
