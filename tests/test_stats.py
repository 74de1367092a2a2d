"""stats + card: known numbers on a small hand-built results tree, conservation, loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_merge import GEN_CFG, gen_row, rules, write_generated, write_tokenized

from tokenmill import contracts
from tokenmill.dataset import card, draft_vocab, export, merge, stats

CONFIG = {
    "results_dir": "results",
    "tokenizer": {"path": "tok", "revision": None, "chat_template_kwargs": {"thinking": True}},
    "categories": {
        "chat": {"sources": ["data/chat.jsonl"], "format": "sharegpt", "shards": 2},
        "code": {"sources": ["data/code.jsonl"], "format": "instruction", "shards": 1},
    },
    "generation": GEN_CFG,
    "dataset": {"max_sequence_tokens": 12, "think_end_token": "</think>", "draft_vocab_size": 3},
}


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
    shards = {
        ("chat", "000"): (
            {"a": [5, 6, 3], "b": [7, 3]},
            [("a", [8, 4, 9, 2], "stop", 1), ("b", [4, 2], "stop", 0)],
            [],
        ),
        ("chat", "001"): ({"c": [5, 3], "d": [6, 6, 6, 3]}, [("c", [8, 9], "length", 0)], ["d"]),
        ("code", "000"): ({"x": [5]}, [("x", [4, 10, 2], "stop", 0)], []),
    }
    walls = {
        ("chat", "000"): {"wall_time_s": 10.0},
        ("chat", "001"): {"wall_time_s": 5.0},
        ("code", "000"): {
            "start_time": "2024-01-01T00:00:00+00:00",
            "end_time": "2024-01-01T00:00:20+00:00",
        },
    }
    for (cat, shard), (prompts, gens, gen_rej) in shards.items():
        tok = r / "tokenized" / cat / f"{shard}.parquet"
        write_tokenized(tok, prompts, cat, shard)
        gen = r / "generated" / cat / f"{shard}.parquet"
        rows = [gen_row(p, prompts[p], out, fin, cached=c) for p, out, fin, c in gens]
        write_generated(gen, rows, rejected=len(gen_rej))
        meta = {
            "server_info": {"version": "0.0-test"},
            "host": "node1",
            "slurm_job_id": "42",
            **walls[(cat, shard)],
        }
        (r / "generated" / cat / f"{shard}.meta.json").write_text(json.dumps(meta))
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
    # What the sum rules and the draft_vocab rule add (the .pt left out: no torch needed).
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
    )
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
    assert chat["prefix_cache"] == {"cached_tokens": 1, "prompt_tokens": 7, "hit_rate": 0.142857}
    g = chat["generation"]
    assert (g["wall_time_s"], g["output_tokens"], g["gpus"]) == (15.0, 8, 1)
    assert g["output_tokens_per_s"] == pytest.approx(0.533, abs=1e-3)
    assert g["output_tokens_per_gpu_hour"] == pytest.approx(1920.0)
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
    assert cov["top_n"][0] == {"n": 3, "ids": 3, "capped": False, "share": 0.833333, "draft": True}
    assert cov["top_n"][1] == {"n": 8192, "ids": 20, "capped": True, "share": 1.0}
    assert cov["ids_for_share"] == {"0.9": 4, "0.95": 4, "0.99": 4, "0.999": 4}
    allcov = o["token_coverage"]
    assert (allcov["loss_tokens"], allcov["distinct_ids"]) == (9, 5)  # + code's 4 10 2
    assert allcov["top_n"][0]["share"] == round(7 / 9, 6)  # 4 and 2 (3 each), then 8 (1)
    assert "## Token coverage (loss-masked tokens)" in md
    assert "| top 3 (draft) | top 8,192 (all 20) |" in md
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
    import datasets

    cache = str(tmp_path / "hf")
    chat = datasets.load_dataset(str(r / "dataset"), name="chat", split="train", cache_dir=cache)
    assert sorted(chat["prompt_id"]) == ["a", "b"]
    code = datasets.load_dataset(str(r / "dataset"), name="code", split="train", cache_dir=cache)
    assert code["input_ids"] == [[5, 4, 10, 2]]
    everything = datasets.load_dataset(str(r / "dataset"), split="train", cache_dir=cache)
    assert len(everything) == 3
    # The draft vocabulary beside the category folders is no config, and the card says what it is.
    assert (r / "dataset" / "vocab_mapping" / "d2t.npy").is_file()
    assert "config_name: vocab_mapping" not in text
    assert "## Draft vocabulary" in text and "`vocab_mapping/d2t.npy`" in text
    # A mapping left from an earlier config with a draft size is not described as this one's.
    assert "## Draft vocabulary" not in card.render(r, dict(CONFIG, dataset={}), None)
    assert pq.read_table(r / "dataset" / "code" / "000.parquet").num_rows == 1
