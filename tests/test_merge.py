"""merge + validate: exact sequences and masks, every reason code, conservation, exports.

The helpers at the top (tiny tokenizer, shard writers, a small synthetic results tree) are
also used by test_stats.py and test_provenance.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill import contracts, keys
from tokenmill.dataset import export, merge, validate

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# id: token. 0 <unk>, 1 <eos>, 2 <|im_end|>, 3 <think>, 4 </think>, then words.
VOCAB = ["<unk>", "<eos>", "<|im_end|>", "<think>", "</think>"] + [f"w{i}" for i in range(15)]
GEN_CFG = {
    "engine": "sglang",
    "mode": "external",
    "model": "tiny/model",
    "revision": None,
    "sampling": {"max_new_tokens": 16, "temperature": 0.0},
    "stop_tokens": ["<|im_end|>"],
    "seed_policy": "none",
    "resources": {"gpus": 0},
}
DS_CFG = {
    "max_sequence_tokens": 12,
    "reject_truncated": True,
    "think_end_token": "</think>",
    "require_think_end": False,
    "export_jsonl": True,
}
FP = keys.generation_fingerprint(GEN_CFG)
TOK_FP = "tokfp-123"


def build_tokenizer(directory: Path) -> Path:
    """A WordLevel tokenizer with the chat special tokens, saved like a hub tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        eos_token="<eos>",
        additional_special_tokens=["<|im_end|>", "<think>", "</think>"],
    )
    directory.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(directory))
    return directory


def rules(**over) -> validate.Rules:
    base = dict(
        vocab_size=len(VOCAB),
        stop_ids=(2, 1),
        think_end_id=4,
        max_sequence_tokens=12,
        reject_truncated=True,
        require_think_end=False,
    )
    base.update(over)
    return validate.Rules(**base)


def write_tokenized(
    path: Path, prompts: dict[str, list[int]], category="chat", shard="000", tokenizer_fp=TOK_FP
):
    pids = sorted(prompts)
    table = pa.table(
        {
            "prompt_id": pids,
            "prompt_ids": [prompts[p] for p in pids],
            "num_prompt_tokens": [len(prompts[p]) for p in pids],
        }
    )
    meta = {
        contracts.META_TOKENIZER_FINGERPRINT: tokenizer_fp,
        "tokenmill.records_in": len(pids),
        "tokenmill.records_kept": len(pids),
        "tokenmill.records_rejected": 0,
    }
    contracts.write_table(table, path, contracts.TOKENIZED, "tokenize", meta)


def gen_row(pid, prompt, output, finish="stop", key=None, cached=0):
    return {
        "prompt_id": pid,
        "sample_key": key or keys.sample_key(FP, prompt),
        "output_ids": output,
        "finish_type": finish,
        "finish_matched_id": output[-1] if (finish == "stop" and output) else None,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(output),
        "cached_tokens": cached,
        "latency_s": 0.5,
        "server": "http://127.0.0.1:1",
        "weight_version": "default",
    }


def write_generated(path: Path, rows: list[dict], records_in=None, rejected=0):
    cols = {name: [r.get(name) for r in rows] for name in contracts.GENERATED.names}
    meta = {
        contracts.META_GENERATION_FINGERPRINT: FP,
        "tokenmill.records_in": records_in if records_in is not None else len(rows) + rejected,
        "tokenmill.records_kept": len(rows),
        "tokenmill.records_rejected": rejected,
    }
    contracts.write_table(
        pa.table(cols, schema=contracts.GENERATED), path, contracts.GENERATED, "generate", meta
    )


def run_merge(tmp_path, prompts, gens, gen_rejected=None, jsonl=False, counts=False, **rule_over):
    tok, gen = tmp_path / "tok.parquet", tmp_path / "gen.parquet"
    write_tokenized(tok, prompts)
    write_generated(gen, gens)
    gr = None
    if gen_rejected is not None:
        gr = tmp_path / "genrej.parquet"
        rows = [
            {"stage": "generate", "category": "chat", "reason": "engine_error", "prompt_id": p}
            for p in gen_rejected
        ]
        contracts.write_table(contracts.rejected_table(rows), gr, contracts.REJECTED, "generate")
    out, rej = tmp_path / "out" / "000.parquet", tmp_path / "rej" / "000.parquet"
    res = merge.merge_shard(
        tok,
        gen,
        out,
        rej,
        rules(**rule_over),
        FP,
        "chat",
        "000",
        generate_rejected=gr,
        counts_out=tmp_path / "token_counts" / "000.parquet" if counts else None,
    )
    if jsonl:
        (tmp_path / "export").mkdir(exist_ok=True)
        export.export_jsonl(out, tmp_path / "export" / "000.jsonl")
    return res, out, rej


def test_merge_exact_sequences_masks_and_counts(tmp_path):
    prompts = {"b": [5, 6, 3], "a": [7, 3]}
    gens = [
        gen_row("b", prompts["b"], [8, 9, 4, 10, 2]),
        gen_row("a", prompts["a"], [4, 11, 1]),  # eos is a stop token too
    ]
    res, out, rej = run_merge(tmp_path, prompts, gens)
    t = pq.read_table(out)
    assert t.column("prompt_id").to_pylist() == ["a", "b"]  # sorted by prompt_id
    assert t.column("input_ids").to_pylist() == [[7, 3, 4, 11, 1], [5, 6, 3, 8, 9, 4, 10, 2]]
    assert t.column("loss_mask").to_pylist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]]
    assert t.column("num_prompt_tokens").to_pylist() == [2, 3]
    assert t.column("num_output_tokens").to_pylist() == [3, 5]
    assert t.column("num_reasoning_tokens").to_pylist() == [1, 3]
    assert t.column("num_answer_tokens").to_pylist() == [2, 2]
    assert t.column("num_total_tokens").to_pylist() == [5, 8]
    assert t.column("category").to_pylist() == ["chat", "chat"]
    assert t.column("sample_key").to_pylist() == [gens[1]["sample_key"], gens[0]["sample_key"]]
    assert t.schema.field("input_ids").type == pa.list_(pa.int32())
    assert t.schema.field("loss_mask").type == pa.list_(pa.int8())
    meta = contracts.read_metadata(out)
    assert meta["tokenmill.records_in"] == "2" and meta["tokenmill.records_kept"] == "2"
    assert meta["tokenmill.records_rejected"] == "0"
    assert meta[contracts.META_TOKENIZER_FINGERPRINT] == TOK_FP
    assert meta[contracts.META_GENERATION_FINGERPRINT] == FP
    assert pq.read_table(rej).num_rows == 0
    assert (res.kept, res.rejected) == (2, 0)


def test_null_reasoning_counts_without_think_end(tmp_path):
    prompts = {"a": [7, 3]}
    _, out, _ = run_merge(tmp_path, prompts, [gen_row("a", [7, 3], [4, 2])], think_end_id=None)
    t = pq.read_table(out)
    assert t.column("num_reasoning_tokens").to_pylist() == [None]
    assert t.column("num_answer_tokens").to_pylist() == [None]


def test_reasoning_that_never_closed_is_all_reasoning(tmp_path):
    """think-open 13, think-close 4, stop 2. "k": the prompt ends inside a thinking block
    (Kimi-K2.5's generation prompt) and the output never closes it; "q": the output opens one
    itself (Qwen3) and never closes it; "c": closed; "n": no block at all (all answer); "x":
    the prompt's block was closed in the prompt (an earlier turn), so none is open."""
    prompts = {"k": [7, 13], "q": [7, 3], "c": [7, 13], "n": [7, 3], "x": [13, 9, 4, 7]}
    gens = [gen_row("k", prompts["k"], [8, 9, 2]), gen_row("q", prompts["q"], [13, 8, 9, 2]),
            gen_row("c", prompts["c"], [8, 4, 9, 2]), gen_row("n", prompts["n"], [8, 9, 2]),
            gen_row("x", prompts["x"], [8, 9, 2])]  # fmt: skip
    _, out, _ = run_merge(tmp_path, prompts, gens, think_start_id=13)
    t = {r["prompt_id"]: r for r in pq.read_table(out).to_pylist()}
    counts = {p: (r["num_reasoning_tokens"], r["num_answer_tokens"]) for p, r in t.items()}
    assert counts == {"k": (3, 0), "q": (4, 0), "c": (2, 2), "n": (0, 3), "x": (0, 3)}
    # without a think-open id nothing is known to be open: outputs without think-close are answer
    _, out, _ = run_merge(tmp_path / "no_start", prompts, gens)
    t = {r["prompt_id"]: r for r in pq.read_table(out).to_pylist()}
    assert (t["k"]["num_reasoning_tokens"], t["k"]["num_answer_tokens"]) == (0, 3)


def test_every_reason_code(tmp_path):
    P = [5, 6]
    prompts = {p: P + [i] for i, p in enumerate("abcdefghijkl", start=5)}
    gens = [
        gen_row("a", prompts["a"], [8, 2]),  # ok
        gen_row("b", prompts["b"], [8, 2]),
        gen_row("b", prompts["b"], [9, 2]),  # duplicate_prompt_id (both rows)
        gen_row("c", prompts["c"], [8, 2], key="0" * 32),  # sample_key_mismatch
        gen_row("d", prompts["d"], [8, 2], finish=None),  # missing_finish
        gen_row("e", prompts["e"], [8], finish="abort"),  # aborted
        gen_row("f", prompts["f"], [], finish="stop"),  # empty_output
        gen_row("g", prompts["g"], [8, 9], finish="length"),  # truncated
        gen_row("h", prompts["h"], [8, 99, 2]),  # token_out_of_range
        gen_row("i", prompts["i"], [8, 9]),  # missing_stop_token
        gen_row("j", prompts["j"], [8] * 12 + [2]),  # too_long
        gen_row("zz", [5], [8, 2]),  # unknown_prompt_id
        # k: not generated and not rejected by generate -> not_generated
        # l: rejected by generate
    ]
    res, out, rej = run_merge(tmp_path, prompts, gens, gen_rejected=["l"])
    assert pq.read_table(out).column("prompt_id").to_pylist() == ["a"]
    r = pq.read_table(rej).to_pylist()
    got = sorted((x["prompt_id"], x["reason"]) for x in r)
    assert got == [
        ("b", "duplicate_prompt_id"),
        ("b", "duplicate_prompt_id"),
        ("c", "sample_key_mismatch"),
        ("d", "missing_finish"),
        ("e", "aborted"),
        ("f", "empty_output"),
        ("g", "truncated"),
        ("h", "token_out_of_range"),
        ("i", "missing_stop_token"),
        ("j", "too_long"),
        ("k", "not_generated"),
        ("zz", "unknown_prompt_id"),
    ]
    assert all(x["stage"] == "merge" and x["detail"] for x in r)
    assert res.generate_rejected == 1 and res.not_generated == 1
    meta = contracts.read_metadata(out)
    # in = generated rows (12) + not_generated (1) = kept (1) + rejected (12)
    assert meta["tokenmill.records_in"] == "13"
    assert meta["tokenmill.records_kept"] == "1"
    assert meta["tokenmill.records_rejected"] == "12"


def test_no_think_end_and_truncated_allowed(tmp_path):
    prompts = {"a": [5], "b": [6]}
    gens = [gen_row("a", [5], [8, 2]), gen_row("b", [6], [4, 8, 9], finish="length")]
    _, out, rej = run_merge(tmp_path, prompts, gens, require_think_end=True, reject_truncated=False)
    assert pq.read_table(out).column("prompt_id").to_pylist() == ["b"]
    assert [(x["prompt_id"], x["reason"]) for x in pq.read_table(rej).to_pylist()] == [
        ("a", "no_think_end")
    ]


def test_conservation_failure_names_counts(tmp_path):
    prompts = {"a": [5], "b": [6]}
    # "a" is both generated and listed as rejected by generate: counted twice.
    gens = [gen_row("a", [5], [2]), gen_row("b", [6], [2])]
    with pytest.raises(
        merge.ConservationError, match=r"generate_rejected=1.*in=2 != kept=2 \+ rejected=1"
    ):
        run_merge(tmp_path, prompts, gens, ["a"], counts=True)
    assert not (tmp_path / "out" / "000.parquet").exists()
    assert not (tmp_path / "token_counts" / "000.parquet").exists()


def python_loss_counts(dataset: Path) -> dict[int, int]:
    """The plain recount: every id at a loss_mask == 1 position of the merged rows."""
    t = pq.read_table(dataset, columns=["input_ids", "loss_mask"])
    counts: dict[int, int] = {}
    for ids, mask in zip(t["input_ids"].to_pylist(), t["loss_mask"].to_pylist(), strict=True):
        for tok, m in zip(ids, mask, strict=True):
            if m == 1:
                counts[tok] = counts.get(tok, 0) + 1
    return counts


@pytest.mark.parametrize("batch_rows", [merge.BATCH_ROWS, 7])
def test_counts_in_the_merge_pass_equal_a_python_recount(tmp_path, monkeypatch, batch_rows):
    from tokenmill.dataset import draft_vocab

    monkeypatch.setattr(merge, "BATCH_ROWS", batch_rows)
    monkeypatch.setattr(contracts, "ROW_GROUP_SIZE", 5)
    rng = np.random.default_rng(3)
    prompts = {f"p{i:03d}": rng.integers(5, 19, rng.integers(1, 6)).tolist() for i in range(60)}
    gens = [
        gen_row(p, ids, rng.integers(5, 19, rng.integers(0, 6)).tolist() + [2])
        for p, ids in prompts.items()
    ]
    # Rejected rows count nothing: id 19 appears only in a truncated output and in prompts.
    gens[4]["output_ids"], gens[4]["finish_type"] = [19, 19], "length"
    gens[4]["finish_matched_id"] = None
    gens[9]["output_ids"] = [7, 99, 2]  # token_out_of_range
    prompts["p010"] = [19, 19, 5]
    gens[10] = gen_row("p010", prompts["p010"], [6, 2])
    rng.shuffle(gens)
    res, out, _ = run_merge(tmp_path, prompts, gens, counts=True)
    assert res.kept == 58
    path = tmp_path / "token_counts" / "000.parquet"
    counts = draft_vocab.read_counts(path)
    assert counts.size == len(VOCAB)  # the tokenizer's vocabulary, from the rules
    recount = python_loss_counts(out)
    assert {int(i): int(counts[i]) for i in np.flatnonzero(counts)} == recount
    assert counts[19] == 0 and counts[2] == 58  # every kept row ends with its stop token
    total_out = pq.read_table(out, columns=["num_output_tokens"]).column(0).to_numpy().sum()
    assert counts.sum() == total_out  # loss tokens are exactly the output tokens
    np.testing.assert_array_equal(counts, draft_vocab.count_dataset(out, len(VOCAB))[0])
    meta = contracts.read_metadata(path)
    assert meta["tokenmill.stage"] == "token_counts"
    assert (meta["tokenmill.counts_scope"], meta["tokenmill.category"]) == ("shard", "chat")
    assert (meta["tokenmill.shard"], meta["tokenmill.rows"]) == ("000", "58")
    assert draft_vocab.find_counts([str(tmp_path / "token_counts")]) == [path]


def test_jsonl_export_and_loaders(tmp_path):
    prompts = {"a": [7, 3], "b": [5, 6, 3]}
    gens = [gen_row("a", prompts["a"], [4, 11, 1]), gen_row("b", prompts["b"], [8, 4, 2])]
    _, out, _ = run_merge(tmp_path, prompts, gens, jsonl=True)
    lines = (tmp_path / "export" / "000.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [
        {"input_ids": [7, 3, 4, 11, 1], "loss_mask": [0, 0, 1, 1, 1]},
        {"input_ids": [5, 6, 3, 8, 4, 2], "loss_mask": [0, 0, 0, 1, 1, 1]},
    ]
    import datasets

    ds = datasets.load_dataset(
        "parquet", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf")
    )
    assert ds[1]["input_ids"] == [5, 6, 3, 8, 4, 2] and ds[1]["loss_mask"] == [0, 0, 0, 1, 1, 1]
    import polars as pl

    df = pl.read_parquet(out)
    assert df["prompt_id"].to_list() == ["a", "b"]
    assert df["input_ids"].dtype == pl.List(pl.Int32) and df["loss_mask"].dtype == pl.List(pl.Int8)
    assert df["input_ids"].to_list()[1] == [5, 6, 3, 8, 4, 2]
    assert df["loss_mask"].to_list()[1] == [0, 0, 0, 1, 1, 1]


def test_deterministic_bytes_and_streaming_across_row_groups(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    prompts = {f"p{i:03d}": rng.integers(5, 20, rng.integers(1, 5)).tolist() for i in range(50)}
    gens = [gen_row(p, ids, rng.integers(5, 20, 3).tolist() + [2]) for p, ids in prompts.items()]
    truncated = sorted(prompts)[3::9]  # rejected rows inside batches: kept rows are filtered
    for g in gens:
        if g["prompt_id"] in truncated:
            g["finish_type"], g["finish_matched_id"] = "length", None
    rng.shuffle(gens)  # generated rows arrive in completion order
    res1, out1, rej1 = run_merge(tmp_path / "one", prompts, gens, jsonl=True)
    assert res1.reasons == {"truncated": len(truncated)} and res1.kept == 50 - len(truncated)
    # Same data, inputs split in many small row groups, small batches: same bytes.
    d = tmp_path / "two"
    d.mkdir()
    monkeypatch.setattr(merge, "BATCH_ROWS", 7)
    monkeypatch.setattr(contracts, "ROW_GROUP_SIZE", 4)
    _, out2, rej2 = run_merge(d, prompts, gens, jsonl=True)
    monkeypatch.undo()
    t1, t2 = pq.read_table(out1), pq.read_table(out2)
    assert t1.equals(t2) and t1.num_rows == 50 - len(truncated)
    assert pq.read_table(rej1).equals(pq.read_table(rej2))
    assert (tmp_path / "one/export/000.jsonl").read_bytes() == (d / "export/000.jsonl").read_bytes()
    assert pq.ParquetFile(d / "gen.parquet").num_row_groups > 5
    kept = [p for p in sorted(prompts) if p not in truncated]
    assert t1.column("prompt_id").to_pylist() == kept
    expected = [
        prompts[p] + next(g["output_ids"] for g in gens if g["prompt_id"] == p) for p in kept
    ]
    assert t1.column("input_ids").to_pylist() == expected
    masks = [
        [0] * len(prompts[p]) + [1] * (len(ids) - len(prompts[p]))
        for p, ids in zip(kept, expected, strict=True)
    ]
    assert t1.column("loss_mask").to_pylist() == masks
    meta = contracts.read_metadata(out1)
    assert meta["tokenmill.records_kept"] == str(50 - len(truncated))
    assert meta["tokenmill.records_rejected"] == str(len(truncated))
    # Rerun with identical inputs: byte-identical outputs.
    _, out3, rej3 = run_merge(tmp_path / "one", prompts, gens, jsonl=True)
    assert out3.read_bytes() == out1.read_bytes() and rej3.read_bytes() == rej1.read_bytes()


def test_cli_with_real_tokenizer(tmp_path):
    tok_dir = build_tokenizer(tmp_path / "tok")
    prompts = {"a": [7, 3], "b": [5, 6, 3]}
    gens = [gen_row("a", prompts["a"], [4, 11, 2]), gen_row("b", prompts["b"], [8, 4, 9])]
    write_tokenized(tmp_path / "t.parquet", prompts)
    write_generated(tmp_path / "g.parquet", gens)
    rc = merge.main(
        [
            "--category",
            "chat",
            "--shard",
            "000",
            "--tokenized",
            str(tmp_path / "t.parquet"),
            "--generated",
            str(tmp_path / "g.parquet"),
            "--out",
            str(tmp_path / "d.parquet"),
            "--rejected",
            str(tmp_path / "r.parquet"),
            "--dataset-config",
            json.dumps(DS_CFG),
            "--generation-config",
            json.dumps(GEN_CFG),
            "--tokenizer-config",
            json.dumps({"path": str(tok_dir)}),
        ]
    )
    assert rc == 0
    assert pq.read_table(tmp_path / "d.parquet").column("prompt_id").to_pylist() == ["a"]
    rej = pq.read_table(tmp_path / "r.parquet").to_pylist()
    assert [(r["prompt_id"], r["reason"]) for r in rej] == [("b", "missing_stop_token")]


def test_batch_sample_keys_match_keys_module():
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 2**31 - 1, n).astype(np.int32) for n in (0, 1, 5, 300)]
    off = np.cumsum([0] + [len(r) for r in rows])
    want = [keys.sample_key(FP, r) for r in rows]
    assert keys.sample_keys(FP, (np.concatenate(rows), off)) == want
    column = pa.array([r.tolist() for r in rows], pa.list_(pa.int32()))
    assert keys.sample_keys(FP, column) == want
    assert keys.sample_keys(FP, pa.chunked_array([column.slice(0, 2), column.slice(2)])) == want
    assert keys.sample_keys(FP, column.slice(1, 2)) == want[1:3]  # a slice: offsets rebased


def test_stage_commands_name_the_key_of_a_bad_config(tmp_path, capsys):
    """merge and draft-vocab from-config validate the sections they are given (settings):
    a wrong value fails before any file is read, naming the key."""
    from tokenmill.dataset import draft_vocab

    bad = json.dumps(dict(DS_CFG, max_sequence_tokens="long"))
    common = ["--generation-config", json.dumps(GEN_CFG), "--tokenizer-config", "{}"]
    argv = ["--category", "c", "--shard", "000", "--tokenized", "t", "--generated", "g"]
    argv += ["--out", "o", "--rejected", "r", "--dataset-config", bad, *common]
    assert merge.main(argv) == 1
    assert "dataset.max_sequence_tokens" in capsys.readouterr().err
    argv = ["--counts", str(tmp_path), "--out-dir", str(tmp_path), "--dataset-config", bad]
    assert draft_vocab.main(["from-config", *argv, *common]) == 1
    assert "dataset.max_sequence_tokens" in capsys.readouterr().err


def _big_shard(tmp_path: Path, order: str):
    """20,000 prompts (three row groups), outputs of 0-80 tokens: mostly kept, some truncated,
    some with an out-of-vocabulary id or no stop token, thinking blocks, a few not generated, a
    duplicate and an unknown prompt; generated rows in prompt_id order (as generate writes
    them) or shuffled."""
    rng = np.random.default_rng(19)
    n = 20_000
    pids = [f"q{i:06d}" for i in range(n)]
    p_len, o_len = rng.integers(1, 40, n), rng.integers(0, 80, n)
    prompts = {p: rng.integers(5, 20, k).tolist() for p, k in zip(pids, p_len, strict=True)}
    gens = []
    for i, p in enumerate(pids):
        if i % 997 == 0:
            continue  # not generated
        out = rng.integers(3, 20, o_len[i]).tolist() + [2]
        finish = "length" if i % 101 == 0 else "stop"
        if i % 211 == 0:
            out[-1] = 7  # no stop token
        if i % 307 == 0:
            out[0] = len(VOCAB) + 5  # out of the vocabulary
        gens.append(gen_row(p, prompts[p], out, finish))
    gens.append(gen_row(pids[5], prompts[pids[5]], [6, 2]))  # a duplicate
    gens.append(gen_row("zz-unknown", [5, 6], [6, 2]))
    if order == "shuffled":
        rng.shuffle(gens)
    res, out, rej = run_merge(
        tmp_path, prompts, gens, jsonl=True, counts=True, max_sequence_tokens=100
    )
    files = [out, rej, tmp_path / "token_counts/000.parquet", tmp_path / "export/000.jsonl"]
    return res, {f.parent.name: contracts.sha256_file(f) for f in files}


# sha256 of the files the merge of e3f0490 (input row groups read whole, one write in
# flight) wrote for _big_shard, in either order: the output must not change by a byte. They
# depend on the pyarrow version that writes them: recompute them with e3f0490's merge.py.
_BIG_SHARD_SHA = {
    "out": "5cfb86dc10981ccd8073a4beecbdf3d2f1984a118c666a124d16366576dc47fd",
    "rej": "037f4e478f96ce03f3cac2dadd64912a5a02593bb5919c32a39e4ffca775b318",
    "token_counts": "a12220d7cd592ef47b998e419ac38e263cfcc0eca71727cbce3d017eb5864e68",
    "export": "77ba05fcb40d8cd84ccc7561d8c2cfa21dd4cd7d1f9cf50f1a6775272e181bb0",
}
_BIG_SHARD_PYARROW = "26.0.1"


@pytest.mark.parametrize("order", ["sorted", "shuffled"])
@pytest.mark.parametrize("small_reads", [False, True])
def test_streamed_merge_writes_the_bytes_of_the_whole_batch_merge(
    tmp_path, monkeypatch, order, small_reads
):
    if pa.__version__ != _BIG_SHARD_PYARROW:
        pytest.skip(f"recorded with pyarrow {_BIG_SHARD_PYARROW}, not {pa.__version__}")
    if small_reads:  # decode 100 rows at a time; never overlap a write with the next batch
        monkeypatch.setattr(merge, "READ_ROWS", 100)
        monkeypatch.setattr(merge, "OVERLAP_BYTES", 0)
        monkeypatch.setattr(merge, "COUNT_VALUES", 1000)
    res, sha = _big_shard(tmp_path, order)
    assert res.tokenized == 20_000 and res.not_generated == 21 and res.kept == 18_409
    assert pq.ParquetFile(tmp_path / "out/000.parquet").num_row_groups == 3
    assert sha == _BIG_SHARD_SHA


def test_long_outputs_are_merged_into_token_bounded_row_groups(tmp_path, monkeypatch):
    """Row groups close at ROW_GROUP_SIZE rows or with the row that brings them to
    ROW_GROUP_TOKENS tokens: long outputs make more, smaller row groups (in the generated shard
    and in the dataset shard merge writes), never a different dataset."""
    rng = np.random.default_rng(5)
    prompts = {f"p{i:03d}": rng.integers(5, 20, rng.integers(2, 6)).tolist() for i in range(80)}
    gens = [
        gen_row(p, ids, rng.integers(5, 20, rng.integers(20, 60)).tolist() + [2])
        for p, ids in prompts.items()
    ]
    gens[7]["finish_type"], gens[7]["finish_matched_id"] = "length", None  # a rejected row
    whole, out_whole, rej_whole = run_merge(
        tmp_path / "whole", prompts, gens, max_sequence_tokens=100
    )
    assert pq.ParquetFile(out_whole).num_row_groups == 1
    bound = 300
    monkeypatch.setattr(contracts, "ROW_GROUP_TOKENS", bound)
    (tmp_path / "cut").mkdir()
    res, out, rej = run_merge(tmp_path / "cut", prompts, gens, max_sequence_tokens=100)
    assert (res.kept, res.rejected) == (whole.kept, whole.rejected) == (79, 1)
    for path, column in ((tmp_path / "cut" / "gen.parquet", "output_ids"), (out, "input_ids")):
        pf = pq.ParquetFile(path)
        assert pf.num_row_groups > 5, path
        short = 0
        for g in range(pf.num_row_groups - 1):
            lengths = [len(x) for x in pf.read_row_group(g, columns=[column])[column].to_pylist()]
            # under the bound until its last row, which brings it to the bound
            assert sum(lengths[:-1]) < bound
            short += sum(lengths) < bound
        # a dataset row group is a batch of candidates less the rows validation rejected: the
        # batch of the truncated row is the one short of the bound
        assert short == (1 if column == "input_ids" else 0), path
    # The same rows, the same validation, only cut differently.
    assert pq.read_table(out).equals(pq.read_table(out_whole))
    assert pq.read_table(rej).equals(pq.read_table(rej_whole))
    assert contracts.read_metadata(out) == contracts.read_metadata(out_whole)


def turn_row(pid, turn, prompt, output, exact, finish="stop"):
    """A GENERATED_TURNS row: a turn of conversation `pid`, sent `prompt`."""
    row = gen_row(pid, prompt, output, finish=finish)
    row.update(turn=turn, turn_prompt_ids=prompt, prefix_exact=exact, conversation_end="complete")
    return row


def test_conversation_turns_go_through_the_prompt_path(tmp_path):
    """A conversation shard is merged by the same pass as a prompt shard: every turn validated
    alone, a conversation kept up to its first invalid turn (later ones rejected as built on
    it), a prefix-exact conversation folded into one row; counted in conversations (with each
    rejected one's reason) and in turns, and the loss-token counts are those of the rows."""
    from tokenmill.dataset import draft_vocab, stats

    p_a0, o_a0 = [5, 6], [7, 2]
    p_a1, o_a1 = p_a0 + o_a0 + [8], [9, 2]
    p_a2, o_a2 = p_a1 + o_a1 + [10], [3, 11, 4, 12, 2]
    rows = [
        # a: prefix-exact, three valid turns -> one row
        turn_row("a", 0, p_a0, o_a0, True),
        turn_row("a", 1, p_a1, o_a1, True),
        turn_row("a", 2, p_a2, o_a2, True),
        # b: turn 1 has no stop token -> turn 0 kept, turn 2 built on turn 1
        turn_row("b", 0, [6], [7, 2], False),
        turn_row("b", 1, [6, 7, 2, 8], [9, 9], False),
        turn_row("b", 2, [6, 7, 2, 8, 9, 2, 10], [11, 2], False),
        # c: turn 0 truncated -> nothing kept
        turn_row("c", 0, [7], [8, 9], False, finish="length"),
        turn_row("c", 1, [7, 8, 9, 10], [11, 2], False),
        # d: turn 0 given twice -> both duplicates, turn 1 built on them
        turn_row("d", 0, [8], [9, 2], True),
        turn_row("d", 0, [8], [10, 2], True),
        turn_row("d", 1, [8, 9, 2, 11], [12, 2], True),
        # zz: a conversation the tokenized shard does not have
        turn_row("zz", 0, [9], [9, 2], False),
        turn_row("zz", 1, [9, 9, 2, 5], [6, 2], False),
    ]
    tok, gen = tmp_path / "tok.parquet", tmp_path / "gen.parquet"
    write_tokenized(tok, {"a": p_a0, "b": [6], "c": [7], "d": [8], "e": [9], "f": [10]})
    cols = {name: [r.get(name) for r in rows] for name in contracts.GENERATED_TURNS.names}
    meta = {
        contracts.META_GENERATION_FINGERPRINT: FP,
        contracts.META_CONTEXT: contracts.CONTEXT_REGENERATED,
    }
    contracts.write_table(
        pa.table(cols, schema=contracts.GENERATED_TURNS), gen, contracts.GENERATED_TURNS,
        "generate", meta,
    )  # fmt: skip
    gen_rej = tmp_path / "genrej.parquet"
    contracts.write_table(
        contracts.rejected_table(
            [{"stage": "generate", "category": "chat", "reason": "engine_error", "prompt_id": "f"}]
        ),
        gen_rej, contracts.REJECTED, "generate",
    )  # fmt: skip
    out, rej, counts = tmp_path / "out.parquet", tmp_path / "rej.parquet", tmp_path / "c.parquet"
    res = merge.merge_shard(
        tok, gen, out, rej, rules(max_sequence_tokens=64), FP, "chat", "000",
        generate_rejected=gen_rej, counts_out=counts,
    )  # fmt: skip

    data = {r["prompt_id"]: r for r in pq.read_table(out).to_pylist()}
    assert list(data) == ["a", "b"]
    a = data["a"]
    assert a["input_ids"] == p_a2 + o_a2
    expected_mask = [0] * len(p_a2) + [1] * len(o_a2)
    for p, o in ((p_a0, o_a0), (p_a1, o_a1)):
        expected_mask[len(p) : len(p) + len(o)] = [1] * len(o)
    assert a["loss_mask"] == expected_mask
    assert a["num_output_tokens"] == 9 and a["num_prompt_tokens"] == len(p_a2) + 5 - 9
    assert (a["num_reasoning_tokens"], a["num_answer_tokens"]) == (3, 6)
    assert data["b"]["input_ids"] == [6, 7, 2]

    rejected = {(r["prompt_id"], json.loads(r["record"]).get("turn"), r["reason"], r["detail"])
                for r in pq.read_table(rej).to_pylist()}  # fmt: skip
    assert ("b", 2, "missing_stop_token", "built on turn 1, which was rejected "
            "(missing_stop_token)") in rejected  # fmt: skip
    assert ("c", 1, "truncated", "built on turn 0, which was rejected (truncated)") in rejected
    assert {(p, t, r) for p, t, r, _ in rejected} == {
        ("b", 1, "missing_stop_token"), ("b", 2, "missing_stop_token"),
        ("c", 0, "truncated"), ("c", 1, "truncated"),
        ("d", 0, "duplicate_prompt_id"), ("d", 1, "duplicate_prompt_id"),
        ("zz", 0, "unknown_prompt_id"), ("zz", 1, "unknown_prompt_id"),
        ("e", None, "not_generated"),
    }  # fmt: skip
    assert len(pq.read_table(rej)) == 10  # d's turn 0 twice
    assert (res.kept, res.rejected, res.not_generated, res.generate_rejected) == (2, 10, 1, 1)

    m = contracts.read_metadata(out)
    # conversations: a, b, c, d, zz generated + e not generated = a, b kept + 4 rejected
    assert [m[k] for k in contracts.MERGE_COUNT_KEYS] == ["6", "2", "4"]
    assert json.loads(m[contracts.META_RECORD_REASONS]) == {
        "duplicate_prompt_id": 1, "not_generated": 1, "truncated": 1, "unknown_prompt_id": 1,
    }  # fmt: skip
    # turns: 13 generated = 4 kept (a's three, b's first) + 9 rejected
    assert [m[k] for k in contracts.TURN_COUNT_KEYS] == ["13", "4", "9"]
    assert (m[contracts.META_CONVERSATION_SAMPLES], m[contracts.META_TURN_SAMPLES]) == ("1", "1")
    assert m[contracts.META_CONTEXT] == contracts.CONTEXT_REGENERATED

    loss_counts = draft_vocab.read_counts(counts)
    assert contracts.read_metadata(counts)[contracts.META_ROWS] == "2"
    assert {i: int(c) for i, c in enumerate(loss_counts) if c} == python_loss_counts(out)

    # stats counts the stage in conversations, with each rejected one's reason
    stage = stats._stage([out], [rej])
    assert (stage["in"], stage["kept"], stage["rejected"]) == (6, 2, 4)
    assert stage["reasons"] == json.loads(m[contracts.META_RECORD_REASONS])
    # a rejected row lost is a conservation problem, not taken on trust from the metadata
    pq.write_table(pq.read_table(rej).slice(1), tmp_path / "short.parquet")
    short = stats._stage([out], [tmp_path / "short.parquet"])
    assert short["kept"] + short["rejected"] != short["in"]
