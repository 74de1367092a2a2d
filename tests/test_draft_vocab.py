"""tokenmill.dataset.draft_vocab: loss-token counts, the draft vocabulary mapping and its files.

The trainers' own code is exercised in tests/test_trainer_loaders.py (separate venvs)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill import contracts
from tokenmill.dataset import draft_vocab as dv

REPO = Path(__file__).resolve().parent.parent


def random_rows(rng, n_rows, vocab, max_len=40):
    """Rows of (input_ids, loss_mask): a prompt part (mask 0) then an output part (mask 1).
    Ids are skewed (a Zipf-ish draw) so that counts differ and ties also occur."""
    rows = []
    for _ in range(n_rows):
        n = int(rng.integers(0, max_len))
        p = int(rng.integers(0, n + 1))
        ids = np.minimum(rng.zipf(1.3, n) - 1, vocab - 1).astype(np.int32)
        rows.append((ids.tolist(), [0] * p + [1] * (n - p)))
    return rows


def python_count(rows, vocab, max_length=None):
    c = Counter()
    for ids, mask in rows:
        if max_length is not None:
            ids, mask = ids[:max_length], mask[:max_length]
        for t, m in zip(ids, mask, strict=True):
            if m == 1:
                c[t] += 1
    out = np.zeros(vocab, dtype=np.int64)
    for t, n in c.items():
        out[t] = n
    return out


def flat(rows):
    ids = np.array([t for r, _ in rows for t in r], dtype=np.int32)
    mask = np.array([m for _, r in rows for m in r], dtype=np.int8)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r, _ in rows])]).astype(np.int32)
    return ids, offsets, mask


def write_dataset_shard(path, rows):
    """A dataset shard with the DATASET contract's id/mask columns (list<int32>, list<int8>)."""
    table = pa.table(
        {
            "input_ids": pa.array([r for r, _ in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array([m for _, m in rows], pa.list_(pa.int8())),
        }
    )
    pq.write_table(table, path, row_group_size=7)  # several row groups and batches


# --- counting ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_counts_equal_python_recount_random(seed):
    rng = np.random.default_rng(seed)
    vocab = 300
    rows = random_rows(rng, 200, vocab)
    ids, offsets, mask = flat(rows)
    got = dv.count_loss_tokens(ids, offsets, mask, vocab)
    assert got.dtype == np.int64 and got.shape == (vocab,)
    np.testing.assert_array_equal(got, python_count(rows, vocab))
    got = dv.count_loss_tokens(ids, offsets, mask, vocab, max_length=7)
    np.testing.assert_array_equal(got, python_count(rows, vocab, max_length=7))


def test_counts_respect_offsets_window():
    rows = [([5, 6, 7], [1, 1, 1]), ([8, 9], [0, 1]), ([1, 1], [1, 1])]
    ids, offsets, mask = flat(rows)
    # Only the middle row: offsets [3, 5] into the full value arrays.
    got = dv.count_loss_tokens(ids, offsets[1:3], mask, 10)
    assert got.tolist() == [0] * 9 + [1]


def test_counts_reject_bad_input():
    ids, offsets, mask = flat([([1, 2, 3], [0, 1, 1])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        dv.count_loss_tokens(ids, offsets, mask, 3)
    with pytest.raises(ValueError, match="other than 0 and 1"):
        dv.count_loss_tokens(ids, offsets, np.array([0, 2, 1], np.int8), 10)
    with pytest.raises(ValueError, match="offsets span"):
        dv.count_loss_tokens(ids, offsets, mask[:2], 10)
    # A prompt-only id outside the vocabulary is not counted, so it is no error here.
    ids2, off2, mask2 = flat([([99, 2], [0, 1])])
    assert dv.count_loss_tokens(ids2, off2, mask2, 10)[2] == 1


def test_counts_of_real_parquet_shard_and_file_round_trip(tmp_path):
    rng = np.random.default_rng(7)
    vocab = 500
    rows = random_rows(rng, 90, vocab, max_len=60)
    shard = tmp_path / "dataset" / "chat" / "00000.parquet"
    shard.parent.mkdir(parents=True)
    write_dataset_shard(shard, rows)
    counts, n = dv.count_dataset(shard, vocab, batch_size=11)
    assert n == len(rows)
    np.testing.assert_array_equal(counts, python_count(rows, vocab))

    out = dv.counts_path_for(shard)
    assert out == tmp_path / "token_counts" / "chat" / "00000.parquet"
    dv.write_counts(out, counts, n)
    np.testing.assert_array_equal(dv.read_counts(out), counts)
    with pytest.raises(ValueError, match="not a tokenmill token-counts file"):
        dv.read_counts(shard)  # a dataset shard given as counts
    with pytest.raises(ValueError, match="give --out"):
        dv.counts_path_for(tmp_path / "elsewhere.parquet")
    t = pq.read_table(out)
    assert t.schema.field("token_id").type == pa.int32()
    assert t.schema.field("count").type == pa.int64()
    assert t.num_rows == np.count_nonzero(counts)  # sparse: non-zero ids only
    assert t.column("token_id").to_pylist() == sorted(t.column("token_id").to_pylist())
    meta = contracts.read_metadata(out)
    assert meta["tokenmill.vocab_size"] == str(vocab)
    assert meta["tokenmill.loss_tokens"] == str(int(counts.sum()))
    first = out.read_bytes()
    dv.write_counts(out, dv.read_counts(out), n)
    assert out.read_bytes() == first  # byte-identical


def test_counts_of_sliced_arrow_arrays():
    rows = [([1, 2], [1, 1]), ([3, 4, 5], [0, 1, 1]), ([6], [1])]
    ids = pa.array([r for r, _ in rows], pa.list_(pa.int32())).slice(1, 2)
    mask = pa.array([m for _, m in rows], pa.list_(pa.int8())).slice(1, 2)
    v, o = contracts.list_arrays(ids, dtype=None)
    m, mo = contracts.list_arrays(mask, dtype=None)
    assert o.tolist() == mo.tolist() == [0, 3, 4]
    assert np.flatnonzero(dv.count_loss_tokens(v, o, m, 8)).tolist() == [4, 5, 6]


def test_sum_counts_and_weights(tmp_path):
    a = np.array([0, 3, 1, 0], np.int64)
    b = np.array([2, 0, 1, 0], np.int64)
    c = np.array([0, 0, 0, 5], np.int64)
    paths = []
    for cat, name, arr in [("x", "0", a), ("x", "1", b), ("y", "0", c)]:
        p = tmp_path / cat / f"{name}.parquet"
        dv.write_counts(p, arr)
        paths.append(p)
    total = dv.sum_counts(paths)
    assert total.dtype == np.int64 and total.tolist() == [2, 3, 2, 5]
    w = dv.sum_counts(reversed(paths), {"x": 2.0, "y": 0.5})
    assert w.dtype == np.float64 and w.tolist() == [4.0, 6.0, 4.0, 2.5]
    with pytest.raises(ValueError, match="no weight"):
        dv.sum_counts(paths, {"x": 1.0})
    odd = tmp_path / "z" / "0.parquet"
    dv.write_counts(odd, np.zeros(9, np.int64))
    with pytest.raises(ValueError, match="vocabulary size"):
        dv.sum_counts([paths[0], odd])
    assert dv.find_counts([str(tmp_path)]) == sorted(paths + [odd])


# --- mapping ----------------------------------------------------------------------------------
def check_mapping(d2t, t2d, draft, vocab):
    assert d2t.dtype == np.int64 and d2t.shape == (draft,)
    assert t2d.dtype == np.bool_ and t2d.shape == (vocab,)
    assert int(t2d.sum()) == draft
    target = d2t + np.arange(draft)
    assert t2d[target].all()  # t2d[d2t[i] + i] for every draft id
    assert (np.diff(target) > 0).all()  # draft order is target order


@pytest.mark.parametrize("seed", [0, 1])
def test_mapping_round_trip_and_reference(seed):
    rng = np.random.default_rng(seed)
    vocab, draft = 1000, 64
    counts = python_count(random_rows(rng, 300, vocab), vocab)
    d2t, t2d = dv.build_mapping(counts, draft, target_vocab_size=vocab + 24)
    check_mapping(d2t, t2d, draft, vocab + 24)
    # Reference: speculators' rule written plainly (sorted by (-count, id), top `draft`).
    seen = {t: int(n) for t, n in enumerate(counts) if n}
    ranked = sorted(seen, key=lambda t: (-seen[t], t))[:draft]
    assert sorted(ranked) == (d2t + np.arange(draft)).tolist()


def test_ties_broken_by_token_id():
    counts = np.zeros(20, np.int64)
    counts[[3, 7, 11, 15, 19]] = 5  # five ids tie for the last two places
    counts[[2, 9]] = 9
    d2t, t2d = dv.build_mapping(counts, 4)
    assert np.flatnonzero(t2d).tolist() == [2, 3, 7, 9]
    counts[19] = 6  # now 19 beats the tie
    _, t2d = dv.build_mapping(counts, 4)
    assert np.flatnonzero(t2d).tolist() == [2, 3, 9, 19]


def test_stop_ids_always_included_even_if_rare():
    counts = np.zeros(50, np.int64)
    counts[:10] = 100
    counts[40] = 1  # a rare stop id
    _, t2d = dv.build_mapping(counts, 8)
    assert not t2d[40] and not t2d[45]
    _, t2d = dv.build_mapping(counts, 8, always_include_ids=[40, 45, 40])  # 45: never seen
    assert t2d[40] and t2d[45] and int(t2d.sum()) == 8
    assert np.flatnonzero(t2d).tolist() == [0, 1, 2, 3, 4, 5, 40, 45]
    with pytest.raises(ValueError, match="do not fit"):
        dv.build_mapping(counts, 2, always_include_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="outside the target"):
        dv.build_mapping(counts, 8, always_include_ids=[50])


def test_fewer_seen_ids_than_draft_size_fills_smallest_unused():
    counts = np.zeros(30, np.int64)
    counts[[4, 25]] = [3, 1]
    d2t, t2d = dv.build_mapping(counts, 6, always_include_ids=[28])
    check_mapping(d2t, t2d, 6, 30)
    assert np.flatnonzero(t2d).tolist() == [0, 1, 2, 4, 25, 28]
    with pytest.raises(ValueError, match="draft size"):
        dv.build_mapping(counts, 31)
    with pytest.raises(ValueError, match=">= the target vocabulary"):
        dv.build_mapping(counts, 3, target_vocab_size=20)


def test_coverage():
    counts = np.array([0, 5, 3, 2, 0], np.int64)
    cov = dv.coverage(counts, ns=(1, 2, 10))
    assert cov == {1: 0.5, 2: 0.8, 10: 1.0}
    assert dv.coverage(np.zeros(3, np.int64), ns=(1,)) == {1: 0.0}
    _, t2d = dv.build_mapping(counts, 2)
    assert dv.mapping_coverage(counts, t2d) == 0.8


# --- files ------------------------------------------------------------------------------------
def make_counts_tree(root, seed=3, vocab=400):
    rng = np.random.default_rng(seed)
    for cat in ("chat", "code"):
        for shard in ("00000", "00001"):
            p = root / cat / f"{shard}.parquet"
            dv.write_counts(p, python_count(random_rows(rng, 50, vocab), vocab))
    return vocab


def run_cli(argv):
    assert dv.main(argv) == 0


def test_cli_files_byte_identical_across_runs(tmp_path):
    pytest.importorskip("torch")
    vocab = make_counts_tree(tmp_path / "counts")
    outs = []
    for run in ("a", "b"):
        out = tmp_path / run
        run_cli(
            [
                "--counts",
                str(tmp_path / "counts"),
                "--draft-size",
                "32",
                "--target-vocab-size",
                str(vocab + 16),
                "--always-include",
                "399,398",
                "--out-dir",
                str(out),
            ]
        )
        outs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outs[0] == outs[1]
    # d2t-N.npy / t2d-N.npy: the names speculators' `train` looks for in its data folder
    assert sorted(outs[0]) == ["d2t-32.npy", "t2d-32.npy", "vocab_mapping.json", "vocab_mapping.pt"]
    d2t = np.load(io.BytesIO(outs[0]["d2t-32.npy"]))
    t2d = np.load(io.BytesIO(outs[0]["t2d-32.npy"]))
    check_mapping(d2t, t2d, 32, vocab + 16)
    assert t2d[398] and t2d[399]
    summary = json.loads(outs[0]["vocab_mapping.json"])
    import hashlib

    for name, sha in summary["files"].items():
        assert hashlib.sha256(outs[0][name]).hexdigest() == sha
    assert summary["draft_size"] == 32 and summary["target_vocab_size"] == vocab + 16
    assert [i["path"] for i in summary["inputs"]] == [
        "chat/00000.parquet",
        "chat/00001.parquet",
        "code/00000.parquet",
        "code/00001.parquet",
    ]
    assert set(summary["coverage_top_n"]) == {"8192", "16384", "32768", "65536"}
    assert summary["coverage_top_n"]["8192"] == 1.0  # 400 ids < 8192

    import torch

    pt = torch.load(io.BytesIO(outs[0]["vocab_mapping.pt"]), weights_only=True)
    assert sorted(pt) == ["d2t", "t2d"]
    assert pt["d2t"].dtype == torch.int64 and pt["t2d"].dtype == torch.bool
    np.testing.assert_array_equal(pt["d2t"].numpy(), d2t)
    np.testing.assert_array_equal(pt["t2d"].numpy(), t2d)


def test_count_command_and_no_torch_import(tmp_path):
    """`draft-vocab count` and the speculators layout never import torch."""
    rows = random_rows(np.random.default_rng(5), 40, 200)
    shard = tmp_path / "dataset" / "chat" / "00000.parquet"
    shard.parent.mkdir(parents=True)
    write_dataset_shard(shard, rows)
    code = f"""
import sys
from tokenmill.cli import main
assert main(["draft-vocab", "count", "--dataset", {str(shard)!r}, "--vocab-size", "200"]) == 0
assert main(["draft-vocab", "--counts", {str(tmp_path / "token_counts")!r}, "--draft-size", "16",
             "--target-vocab-size", "256", "--format", "speculators",
             "--out-dir", {str(tmp_path / "out")!r}]) == 0
assert "torch" not in sys.modules, "torch was imported"
"""
    env = {"PYTHONPATH": str(REPO / "workflow"), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    counts = dv.read_counts(dv.counts_path_for(shard))
    np.testing.assert_array_equal(counts, python_count(rows, 200))
    assert sorted(x.name for x in (tmp_path / "out").iterdir()) == [
        "d2t-16.npy",
        "t2d-16.npy",
        "vocab_mapping.json",
    ]
    t2d = np.load(tmp_path / "out" / "t2d-16.npy")
    assert t2d.shape == (256,) and t2d.dtype == np.bool_


# --- the pipeline's side: sums, the coverage view, from-config --------------------------------
def test_sum_command_per_category_and_overall(tmp_path):
    counts_dir = tmp_path / "token_counts"
    vocab = make_counts_tree(counts_dir)
    for cat in ("chat", "code"):
        run_cli(
            ["sum", "--category", cat, "--counts", str(counts_dir / cat)]
            + ["--out", str(counts_dir / f"{cat}.parquet")]
        )
    sums = [counts_dir / "chat.parquet", counts_dir / "code.parquet"]
    run_cli(
        ["sum", "--all", "--counts", *map(str, sums), "--out", str(counts_dir / "_all.parquet")]
    )
    shards = sorted(counts_dir.glob("*/*.parquet"))
    for cat in ("chat", "code"):
        expected = sum(dv.read_counts(p) for p in shards if p.parent.name == cat)
        np.testing.assert_array_equal(dv.read_counts(counts_dir / f"{cat}.parquet"), expected)
        meta = contracts.read_metadata(counts_dir / f"{cat}.parquet")
        assert meta["tokenmill.counts_scope"] == "category" and meta["tokenmill.category"] == cat
        assert meta["tokenmill.summed_files"] == "2"
    total = dv.read_counts(counts_dir / "_all.parquet")
    np.testing.assert_array_equal(total, sum(dv.read_counts(p) for p in shards))
    assert total.size == vocab
    assert contracts.read_metadata(counts_dir / "_all.parquet")["tokenmill.counts_scope"] == "all"
    # A folder given to --counts means its shard files: the sums beside them are not added again.
    assert dv.find_counts([str(counts_dir)]) == shards
    np.testing.assert_array_equal(dv.sum_counts(dv.find_counts([str(counts_dir)])), total)
    # Weights find a category sum's category in its metadata, not its folder.
    w = dv.sum_counts(sums, {"chat": 2.0, "code": 0.0})
    np.testing.assert_array_equal(w, 2.0 * dv.read_counts(sums[0]))
    # A sum refuses another category's shards and mixed scopes.
    with pytest.raises(ValueError, match="not shard counts of category 'chat'"):
        dv.sum_files(shards, category="chat")
    with pytest.raises(ValueError, match="different scopes"):
        dv.sum_files([shards[0], sums[0]])
    assert (
        dv.main(["sum", "--category", "chat", "--counts", *map(str, shards)] + ["--out", "x"]) == 1
    )


def test_coverage_view_small_and_large_vocabularies():
    # 720 ids as the demo model, 150 of them seen: every standard N is capped, the share
    # columns still tell how many ids matter.
    counts = np.zeros(720, np.int64)
    counts[:150] = np.arange(150, 0, -1)
    v = dv.coverage_view(counts, draft_size=128)
    assert (v["vocab_size"], v["distinct_ids"], v["loss_tokens"]) == (720, 150, 11325)
    assert [r["n"] for r in v["top_n"]] == [128, 8192, 16384, 32768, 65536]
    draft = v["top_n"][0]
    assert draft["draft"] and not draft["capped"] and draft["ids"] == 128
    assert draft["share"] == round(sum(range(150, 22, -1)) / 11325, 6)
    assert all(r["capped"] and r["ids"] == 720 and r["share"] == 1.0 for r in v["top_n"][1:])
    cum = np.cumsum(np.arange(150, 0, -1))
    for share, ids in v["ids_for_share"].items():
        assert cum[ids - 1] >= float(share) * 11325 > (cum[ids - 2] if ids > 1 else 0)
    # A large vocabulary: nothing capped.
    big = np.zeros(163840, np.int64)
    big[::2] = 1
    v = dv.coverage_view(big)
    assert [r["n"] for r in v["top_n"]] == list(dv.COVERAGE_NS)
    assert not any(r["capped"] for r in v["top_n"])
    assert v["top_n"][0]["share"] == round(8192 / 81920, 6)
    assert v["ids_for_share"]["0.9"] == 73728
    assert dv.coverage_view(np.zeros(10, np.int64))["ids_for_share"]["0.9"] is None


def test_model_vocab_size(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"vocab_size": 720}')
    assert dv.model_vocab_size("m", basedir=tmp_path) == 720
    (tmp_path / "m" / "config.json").write_text('{"text_config": {"vocab_size": 163840}}')
    assert dv.model_vocab_size(str(tmp_path / "m")) == 163840  # Kimi-K2.5's layout
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no vocab_size"):
        dv.model_vocab_size("m", basedir=tmp_path)


def test_from_config_builds_the_pipeline_mapping(tmp_path, capsys):
    """The draft_vocab rule's command: stop tokens resolved by the tokenizer plus eos always
    in, target size from the model's config.json, weights by category (unlisted: 1)."""
    pytest.importorskip("torch")
    from test_merge import GEN_CFG, VOCAB, build_tokenizer

    build_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"vocab_size": 32}))
    counts_dir = tmp_path / "token_counts"
    chat = np.zeros(len(VOCAB), np.int64)
    chat[[5, 6, 7, 8]] = [50, 40, 30, 20]
    code = np.zeros(len(VOCAB), np.int64)
    code[[9, 10]] = [25, 24]
    for cat, c in (("chat", chat), ("code", code)):
        dv.write_counts(counts_dir / f"{cat}.parquet", c, category=cat, scope="category")
    gen = dict(GEN_CFG, model="tok")  # stop tokens ["<|im_end|>"] = id 2; eos "<eos>" = id 1
    ds = {"draft_vocab_size": 4, "draft_vocab_weights": {}, "draft_vocab_force_stop_ids": True}

    def build(ds, out, gen=gen):
        return dv.main(
            ["from-config", "--counts", str(counts_dir / "chat.parquet")]
            + [str(counts_dir / "code.parquet"), "--dataset-config", json.dumps(ds)]
            + ["--generation-config", json.dumps(gen), "--tokenizer-config"]
            + [json.dumps({"path": "tok"}), "--basedir", str(tmp_path), "--out-dir", str(out)]
        )

    assert build(ds, tmp_path / "a") == 0
    d2t, t2d = np.load(tmp_path / "a" / "d2t-4.npy"), np.load(tmp_path / "a" / "t2d-4.npy")
    check_mapping(d2t, t2d, 4, 32)
    assert np.flatnonzero(t2d).tolist() == [1, 2, 5, 6]  # eos, <|im_end|>, the top two
    summary = json.loads((tmp_path / "a" / "vocab_mapping.json").read_text())
    assert summary["always_include_ids"] == [1, 2] and summary["target_vocab_size"] == 32
    assert sorted(summary["files"]) == ["d2t-4.npy", "t2d-4.npy", "vocab_mapping.pt"]
    assert [i["path"] for i in summary["inputs"]] == [
        "token_counts/chat.parquet",
        "token_counts/code.parquet",
    ]
    # code weighted 2x: its ids (50, 48) now beat chat's second (40); chat counts once.
    ds_w = dict(ds, draft_vocab_weights={"code": 2.0}, draft_vocab_formats=["speculators"])
    assert build(ds_w, tmp_path / "b") == 0
    assert np.flatnonzero(np.load(tmp_path / "b" / "t2d-4.npy")).tolist() == [1, 2, 5, 9]
    assert not (tmp_path / "b" / "vocab_mapping.pt").exists()
    summary = json.loads((tmp_path / "b" / "vocab_mapping.json").read_text())
    assert summary["weights"] == {"chat": 1.0, "code": 2.0}
    # Errors name the config key.
    capsys.readouterr()
    assert build(dict(ds, draft_vocab_size=None), tmp_path / "c") == 1
    assert "'dataset.draft_vocab_size': null" in capsys.readouterr().err
    assert build(dict(ds, draft_vocab_size=40), tmp_path / "c") == 1
    assert "'dataset.draft_vocab_size': 40 with target vocabulary 32" in capsys.readouterr().err
    assert build(ds, tmp_path / "c", gen=dict(gen, model="no/such-model")) == 1
    assert "'dataset.draft_vocab_target_size': null, and" in capsys.readouterr().err
    assert build(dict(ds, draft_vocab_target_size=20), tmp_path / "c") == 0
    assert np.load(tmp_path / "c" / "t2d-4.npy").shape == (20,)


# --- issue 21: the handoff to the trainers ------------------------------------------------------
@pytest.mark.parametrize("max_length", [1, 3, 7, 40])
def test_merge_counts_honour_the_training_length(tmp_path, max_length):
    """merge's pass with dataset.max_train_length counts what count_dataset counts over the
    written rows cut to that length (the trainers' cut: prompt + output, first L positions),
    and says so in the counts' metadata; the sum keeps it."""
    from test_merge import FP, gen_row, rules, write_generated, write_tokenized

    from tokenmill.dataset import merge

    rng = np.random.default_rng(max_length)
    prompts = {f"p{i:03d}": rng.integers(5, 19, rng.integers(1, 6)).tolist() for i in range(40)}
    gens = [
        gen_row(p, ids, rng.integers(5, 19, rng.integers(0, 8)).tolist() + [2])
        for p, ids in prompts.items()
    ]
    tok, gen = tmp_path / "tok.parquet", tmp_path / "gen.parquet"
    write_tokenized(tok, prompts)
    write_generated(gen, gens)
    out = tmp_path / "dataset" / "chat" / "000.parquet"
    counts_path = tmp_path / "token_counts" / "chat" / "000.parquet"
    merge.merge_shard(
        tok, gen, out, tmp_path / "rej.parquet", rules(), FP, "chat", "000",
        counts_out=counts_path, count_max_length=max_length,
    )  # fmt: skip
    got = dv.read_counts(counts_path)
    t = pq.read_table(out, columns=["input_ids", "loss_mask"])
    rows = list(zip(t["input_ids"].to_pylist(), t["loss_mask"].to_pylist(), strict=True))
    np.testing.assert_array_equal(got, python_count(rows, got.size, max_length=max_length))
    whole = python_count(rows, got.size)
    assert max_length == 40 or got.sum() < whole.sum()  # the cut did cut
    assert dv.counts_max_length(counts_path) == max_length
    run_cli(["sum", "--category", "chat", "--counts", str(counts_path.parent)]
            + ["--out", str(tmp_path / "token_counts" / "chat.parquet")])  # fmt: skip
    assert dv.counts_max_length(tmp_path / "token_counts" / "chat.parquet") == max_length


def test_counts_of_different_lengths_are_not_summed(tmp_path):
    c = np.array([0, 3, 1], np.int64)
    dv.write_counts(tmp_path / "a" / "00000.parquet", c, category="a")
    dv.write_counts(tmp_path / "a" / "00001.parquet", c, category="a", max_length=8)
    with pytest.raises(ValueError, match="different row lengths"):
        dv.sum_files(dv.find_counts([str(tmp_path / "a")]), category="a")
    assert dv.counts_max_length(tmp_path / "a" / "00000.parquet") is None
    # whole rows (the default) write no new metadata key: the files stay byte-identical
    assert contracts.META_COUNTS_MAX_LENGTH not in contracts.read_metadata(
        tmp_path / "a" / "00000.parquet"
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_output_window_is_the_row_cut(seed):
    rng = np.random.default_rng(seed)
    plen = rng.integers(0, 6, 30)
    olen = rng.integers(0, 9, 30)
    off = np.concatenate([[0], np.cumsum(olen)])
    for length in (1, 4, 9, 100):
        window = dv.output_window(off, plen, length)
        want = np.concatenate([np.arange(o) + p < length for p, o in zip(plen, olen, strict=True)])
        np.testing.assert_array_equal(window, want.astype(bool))


def _from_config(tmp_path, ds, counts_dir, out):
    from test_merge import GEN_CFG

    return dv.main(
        ["from-config", "--counts", str(counts_dir / "chat.parquet")]
        + [str(counts_dir / "code.parquet"), "--dataset-config", json.dumps(ds)]
        + ["--generation-config", json.dumps(dict(GEN_CFG, model="tok")), "--tokenizer-config"]
        + [json.dumps({"path": "tok"}), "--basedir", str(tmp_path), "--out-dir", str(out)]
    )


def test_from_config_default_forces_nothing_and_owns_the_coverage(tmp_path, capsys):
    """Default (dataset.draft_vocab_force_stop_ids false): the counts alone choose, as both
    trainers do; the summary's coverage is the written mapping's share of the real (unweighted)
    loss tokens, per category too: the number stats shows."""
    from test_merge import VOCAB, build_tokenizer

    build_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "config.json").write_text(json.dumps({"vocab_size": 32}))
    counts_dir = tmp_path / "token_counts"
    chat = np.zeros(len(VOCAB), np.int64)
    chat[[5, 6, 7, 8, 2]] = [50, 40, 30, 20, 1]  # 2 = <|im_end|>: rare here
    code = np.zeros(len(VOCAB), np.int64)
    code[[9, 10]] = [25, 24]
    for cat, c in (("chat", chat), ("code", code)):
        dv.write_counts(counts_dir / f"{cat}.parquet", c, category=cat, scope="category")
    ds = {"draft_vocab_size": 4, "draft_vocab_formats": ["speculators"]}
    assert _from_config(tmp_path, ds, counts_dir, tmp_path / "a") == 0
    t2d = np.load(tmp_path / "a" / "t2d-4.npy")
    assert np.flatnonzero(t2d).tolist() == [5, 6, 7, 9]  # the top four by count, no stop id
    s = json.loads((tmp_path / "a" / "vocab_mapping.json").read_text())
    assert s["always_include_ids"] == [] and "max_train_length" not in s
    total = chat + code
    assert s["loss_tokens"] == int(total.sum())
    assert s["draft_coverage"] == pytest.approx(dv.mapping_coverage(total, t2d))
    assert s["draft_coverage_by_category"] == {
        "chat": pytest.approx(120 / 141),
        "code": pytest.approx(25 / 49),
    }
    # Forced: the stop ids displace the lowest counts, and the coverage says so.
    assert _from_config(tmp_path, dict(ds, draft_vocab_force_stop_ids=True), counts_dir,
                        tmp_path / "b") == 0  # fmt: skip
    t2d_b = np.load(tmp_path / "b" / "t2d-4.npy")
    assert np.flatnonzero(t2d_b).tolist() == [1, 2, 5, 6]
    s_b = json.loads((tmp_path / "b" / "vocab_mapping.json").read_text())
    assert s_b["draft_coverage"] == pytest.approx(91 / 190)
    assert s_b["draft_coverage"] < s["draft_coverage"]
    # Weighted: code 3x picks code's ids, but the coverage is still of the real loss tokens.
    ds_w = dict(ds, draft_vocab_weights={"code": 3.0})
    assert _from_config(tmp_path, ds_w, counts_dir, tmp_path / "c") == 0
    t2d_c = np.load(tmp_path / "c" / "t2d-4.npy")
    assert np.flatnonzero(t2d_c).tolist() == [5, 6, 9, 10]
    s_c = json.loads((tmp_path / "c" / "vocab_mapping.json").read_text())
    assert s_c["draft_coverage"] == pytest.approx(139 / 190)
    assert s_c["loss_tokens"] == 190
    # Another draft size: the files of the earlier one leave the folder (speculators would
    # find them by name); the format it does not write stays as it was.
    (tmp_path / "a" / "d2t.npy").write_bytes(b"old name")
    assert _from_config(tmp_path, dict(ds, draft_vocab_size=3), counts_dir, tmp_path / "a") == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "d2t-3.npy",
        "t2d-3.npy",
        "vocab_mapping.json",
    ]
    # Counts of another training length than the config's: an error naming the key.
    capsys.readouterr()
    assert _from_config(tmp_path, dict(ds, max_train_length=64), counts_dir, tmp_path / "d") == 1
    assert "'dataset.max_train_length': 64 but the token counts" in capsys.readouterr().err


def test_stats_draft_row_is_the_written_mappings_coverage(tmp_path):
    """summary.json / summary.md: the draft row is vocab_mapping.json's number (a forced id
    makes it lower than the top-N share), not a second computation."""
    from tokenmill.dataset import stats
    from tokenmill.dataset import summary_doc as doc

    results = tmp_path / "results"
    counts = np.array([0, 1, 50, 40, 30, 20], np.int64)
    dv.write_counts(results / dv.COUNTS_DIR / "chat.parquet", counts, category="chat",
                    scope="category")  # fmt: skip
    dv.write_counts(results / dv.COUNTS_DIR / f"{dv.ALL_COUNTS}.parquet", counts, scope="all")
    mapping = results / "dataset" / dv.MAPPING_DIR
    s = dv.write_mapping(mapping, counts, 3, [1], 8, ["speculators"],
                         by_category={"chat": counts})  # fmt: skip
    assert s["draft_coverage"] == pytest.approx(91 / 141)
    from tokenmill.layout import Layout

    lay = Layout(str(results), "journal")
    cats, overall = {"chat": {}}, {}
    stats._token_coverage(lay, cats, overall, 3)
    for scope in (cats["chat"], overall):
        (row,) = [r for r in scope["token_coverage"]["top_n"] if r.get("draft")]
        assert row["share"] == round(s["draft_coverage"], 6) and row["mapping"]
    md = doc.markdown(stats.coverage_blocks({"categories": cats, "overall": overall}))
    assert "draft vocabulary (3 ids)" in md and f"{s['draft_coverage']:.2%}" in md
    assert f"{120 / 141:.2%}" not in md  # the top-3 share is not shown as the draft's
    # A mapping of another size (a stale file) is not taken for this one.
    cats, overall = {"chat": {}}, {}
    stats._token_coverage(lay, cats, overall, 4)
    (row,) = [r for r in overall["token_coverage"]["top_n"] if r.get("draft")]
    assert "mapping" not in row


def test_config_check_names_a_draft_size_above_the_model_vocabulary(tmp_path):
    """Caught when the config is checked (before any job), from the model's config.json."""
    import yaml

    from tokenmill.config import ConfigError, check_semantics
    from tokenmill.settings import Settings

    config = yaml.safe_load((REPO / "config.yaml").read_text())
    vocab = json.loads((REPO / "sample" / "model" / "config.json").read_text())["vocab_size"]
    config["dataset"]["draft_vocab_size"] = vocab + 1
    with pytest.raises(ConfigError, match=r"'dataset.draft_vocab_size': \d+ is larger than the "
                       r"model's vocabulary \(" + str(vocab)):  # fmt: skip
        check_semantics(Settings.from_config(config), REPO)
    config["dataset"]["draft_vocab_size"] = vocab
    check_semantics(Settings.from_config(config), REPO)
    config["dataset"]["draft_vocab_target_size"] = vocab + 10
    config["dataset"]["draft_vocab_size"] = vocab + 1  # fits the configured t2d length
    check_semantics(Settings.from_config(config), REPO)


def test_export_concatenates_in_one_fixed_order(tmp_path):
    """SpecForge reads one file: `export-jsonl --dataset FOLDER` is the per-shard files in
    category then shard name order, whatever order the folders list in."""
    from tokenmill.dataset import export

    rng = np.random.default_rng(9)
    parts = []
    for cat in ("code", "chat"):
        for shard in ("001", "000"):
            path = tmp_path / "dataset" / cat / f"{shard}.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_dataset_shard(path, random_rows(rng, 5, 50))
            one = tmp_path / "export" / cat / f"{shard}.jsonl"
            one.parent.mkdir(parents=True, exist_ok=True)
            export.export_jsonl(path, one)
            parts.append(one)
    (tmp_path / "dataset" / dv.MAPPING_DIR).mkdir()  # beside the categories, no Parquet
    want = b"".join(p.read_bytes() for p in sorted(parts))
    assert export.main(["--dataset", str(tmp_path / "dataset"), "--out",
                        str(tmp_path / "all.jsonl")]) == 0  # fmt: skip
    assert (tmp_path / "all.jsonl").read_bytes() == want
    assert export.main(["--dataset", str(tmp_path / "dataset" / "code"), "--out",
                        str(tmp_path / "code.jsonl")]) == 0  # fmt: skip
    code = sorted(p for p in parts if p.parent.name == "code")
    assert (tmp_path / "code.jsonl").read_bytes() == b"".join(p.read_bytes() for p in code)
