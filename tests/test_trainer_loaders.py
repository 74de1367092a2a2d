"""Our export and draft-vocabulary files through the trainers' OWN code (docs/draft-vocab.md).

Each trainer runs in its own cached venv (tests/{speculators,specforge}/ensure_venv.sh, about
a minute each the first time) via tests/{speculators,specforge}/check_loaders.py:
  (a) it loads our export JSONL and our mapping files with its own loaders and checks;
  (b) it builds its own mapping from the same data, which must equal ours; the one documented
      difference is SpecForge's order among equal counts (first seen, not smallest id).
The last two tests do the same on the pipeline's own output: the demo run (config.yaml, the
reference engine on CPU) in a tmp copy, its results/export/ and results/dataset/vocab_mapping/.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.dataset import draft_vocab as dv
from tokenmill.dataset.export import export_jsonl
from tokenmill.dataset.export import main as export_main

pytestmark = [pytest.mark.trainers, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_LEN = 1000  # ids in the data are below it
TARGET_VOCAB = 1024  # the model config's vocab_size, padded past the tokenizer (as Qwen, Kimi)
LONG = 4096  # longer than every row: no truncation


def ensure(trainer: str) -> str:
    p = subprocess.run(
        ["bash", str(REPO / "tests" / trainer / "ensure_venv.sh")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout.strip().splitlines()[-1]


def run_checker(trainer: str, spec: dict, tmp: Path) -> None:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf-home"),  # the datasets cache of the JSON loader stays in tmp
        "PYTHONPATH": "",
        "CUDA_VISIBLE_DEVICES": "",
    }
    p = subprocess.run(
        [ensure(trainer), str(REPO / "tests" / trainer / "check_loaders.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=tmp,
    )
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-6000:])
    assert f"{trainer}: ok" in p.stdout


def make_rows(seed=11, n_rows=150):
    """Prompt (mask 0) then output (mask 1) rows with Zipf-skewed ids: many equal counts."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n_rows):
        n = int(rng.integers(2, 60))
        p = int(rng.integers(1, n))
        ids = np.minimum(rng.zipf(1.2, n) - 1, TOKENIZER_LEN - 1).astype(np.int32)
        rows.append((ids.tolist(), [0] * p + [1] * (n - p)))
    rows.append(([5, 6, 7], [0, 0, 0]))  # no loss token: the trainers drop it, we count nothing
    rows.append(([1, TOKENIZER_LEN - 1], [0, 1]))  # the last tokenizer id
    return rows


def write_shard(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.table(
        {
            "input_ids": pa.array([r for r, _ in rows], pa.list_(pa.int32())),
            "loss_mask": pa.array([m for _, m in rows], pa.list_(pa.int8())),
        }
    )
    pq.write_table(table, path)


def build(out: Path, counts_dir: Path, draft: int, always=(), target=TARGET_VOCAB) -> Path:
    argv = ["--counts", str(counts_dir), "--draft-size", str(draft)]
    argv += ["--target-vocab-size", str(target), "--out-dir", str(out)]
    if always:
        argv += ["--always-include", ",".join(map(str, always))]
    assert dv.main(argv) == 0
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainers")
    rows = make_rows()
    shard = root / "dataset" / "chat" / "00000.parquet"
    write_shard(shard, rows)
    export = root / "export" / "chat" / "00000.jsonl"
    export.parent.mkdir(parents=True)
    export_jsonl(shard, export)
    counts, _ = dv.count_dataset(shard, TOKENIZER_LEN)
    dv.write_counts(dv.counts_path_for(shard), counts)
    counts_dir = dv.counts_path_for(shard).parent
    seen = int(np.count_nonzero(counts))
    sizes = {"top": 64, "padded": seen + 40}  # padded: more places than ids seen
    maps = {k: build(root / f"map-{k}", counts_dir, n) for k, n in sizes.items()}
    maps["stops"] = build(root / "map-stops", counts_dir, 64, always=[TARGET_VOCAB - 1, 1001])
    return {
        "root": root,
        "rows": rows,
        "shard": shard,
        "export": export,
        "counts": counts,
        "sizes": sizes,
        "maps": maps,
    }


def ours(folder: Path):
    """Our d2t-N.npy / t2d-N.npy (the names speculators' train finds in its data folder)."""
    (d2t,) = folder.glob("d2t-*.npy")
    (t2d,) = folder.glob("t2d-*.npy")
    return np.load(d2t), np.load(t2d)


def kept(rows, max_length):
    """The rows a trainer keeps: cut to max_length, at least one loss token left."""
    out = []
    for ids, mask in rows:
        ids, mask = ids[:max_length], mask[:max_length]
        if sum(mask):
            out.append({"input_ids": ids, "loss_mask": mask})
    return out


def test_speculators_reads_ours_and_builds_the_same(data, tmp_path):
    spec = {
        "export": str(data["export"]),
        "out": str(tmp_path),
        "max_lengths": [LONG, 16],
        "draft_sizes": sorted(data["sizes"].values()),
        "target_vocab_size": TARGET_VOCAB,
        "mappings": [str(p) for p in data["maps"].values()],
    }
    run_checker("speculators", spec, tmp_path)
    for length in (LONG, 16):
        # (a) its pre-tokenized path passes our rows through unchanged (after its own cut)
        theirs = json.loads((tmp_path / f"rows-{length}.json").read_text())
        assert theirs == kept(data["rows"], length)
        # its token_freq.pt holds exactly our counts (with the same cut)
        ours_counts, _ = dv.count_dataset(data["shard"], TOKENIZER_LEN, max_length=length)
        freq = json.loads((tmp_path / f"counts-{length}.json").read_text())
        assert freq == {str(i): int(ours_counts[i]) for i in np.flatnonzero(ours_counts)}
    # (b) its builder gives our mapping, byte for byte in the arrays, ties included
    for name, n in data["sizes"].items():
        d2t, t2d = ours(data["maps"][name])
        their_d2t = np.load(tmp_path / f"d2t-{LONG}-{n}.npy")
        their_t2d = np.load(tmp_path / f"t2d-{LONG}-{n}.npy")
        assert their_d2t.dtype == d2t.dtype == np.int64
        assert their_t2d.dtype == t2d.dtype == np.bool_
        np.testing.assert_array_equal(their_d2t, d2t, err_msg=name)
        np.testing.assert_array_equal(their_t2d, t2d, err_msg=name)
    # the data do have ties at the cut-off count, so a different tie-break would show
    c = data["counts"]
    top = ours(data["maps"]["top"])[1][:TOKENIZER_LEN]
    cut = c[top].min()
    assert np.count_nonzero(c == cut) > np.count_nonzero(top & (c == cut))


def test_specforge_reads_ours_and_builds_the_same_up_to_ties(data, tmp_path):
    spec = {
        "export": str(data["export"]),
        "out": str(tmp_path),
        "max_length": LONG,
        "draft_sizes": sorted(data["sizes"].values()),
        "target_vocab_size": TARGET_VOCAB,
        "mappings": [str(p) for p in data["maps"].values()],
    }
    run_checker("specforge", spec, tmp_path)
    # (a) its prompts_path loader passes our rows through unchanged
    assert json.loads((tmp_path / "rows.json").read_text()) == kept(data["rows"], LONG)
    # (b) its builder: the same ids, except which of the ids with the cut-off count get in
    counts = np.pad(data["counts"], (0, TARGET_VOCAB - TOKENIZER_LEN))
    for name, n in data["sizes"].items():
        d2t, t2d = ours(data["maps"][name])
        their_d2t = np.load(tmp_path / f"d2t-{n}.npy")
        their_t2d = np.load(tmp_path / f"t2d-{n}.npy")
        assert their_d2t.dtype == np.int64 and their_t2d.dtype == np.bool_
        assert their_d2t.shape == d2t.shape and their_t2d.shape == t2d.shape
        np.testing.assert_array_equal(np.flatnonzero(their_t2d), their_d2t + np.arange(n))
        if name == "padded":  # every seen id, then the smallest unseen ids: no choice to make
            np.testing.assert_array_equal(their_t2d, t2d)
            continue
        cut = counts[t2d].min()
        assert (counts[their_t2d] >= cut).all() and their_t2d[counts > cut].all()
        differ = np.flatnonzero(their_t2d != t2d)
        assert (counts[differ] == cut).all(), "ids differ beyond the tie at the cut-off count"


def test_specforge_tie_break_is_first_seen(tmp_path):
    """The documented difference, pinned: id 500 is seen (row 1) before id 3 (row 2), both
    once; one place left. SpecForge's Counter.most_common keeps the first seen (500); ours and
    speculators' keep the smaller id (3)."""
    rows = [([9, 500], [0, 1]), ([9, 3], [0, 1]), ([7, 7, 7], [0, 1, 1])]
    shard = tmp_path / "dataset" / "tie" / "00000.parquet"
    write_shard(shard, rows)
    export = tmp_path / "tie.jsonl"
    export_jsonl(shard, export)
    counts, _ = dv.count_dataset(shard, TOKENIZER_LEN)
    dv.write_counts(dv.counts_path_for(shard), counts)
    mine = build(tmp_path / "map", dv.counts_path_for(shard).parent, 2)
    assert np.flatnonzero(ours(mine)[1]).tolist() == [3, 7]
    sf = tmp_path / "sf"
    sf.mkdir()
    run_checker(
        "specforge",
        {
            "export": str(export),
            "out": str(sf),
            "max_length": LONG,
            "draft_sizes": [2],
            "target_vocab_size": TARGET_VOCAB,
            "mappings": [str(mine)],
        },
        sf,
    )
    assert np.flatnonzero(np.load(sf / "t2d-2.npy")).tolist() == [7, 500]
    sp = tmp_path / "sp"
    sp.mkdir()
    run_checker(
        "speculators",
        {
            "export": str(export),
            "out": str(sp),
            "max_lengths": [LONG],
            "draft_sizes": [2],
            "target_vocab_size": TARGET_VOCAB,
            "mappings": [str(mine)],
        },
        sp,
    )
    assert np.flatnonzero(np.load(sp / f"t2d-{LONG}-2.npy")).tolist() == [3, 7]


def test_speculators_prepare_data_with_a_training_length_equals_ours(tmp_path):
    """issue 21: with a training length shorter than the rows, our mapping (counts cut to that
    length as dataset.max_train_length does, nothing forced: the default) equals speculators'
    own build_vocab_mappings_from_distribution on the token frequencies of its own
    prepare-data function (load_and_preprocess_dataset, --seq-length L), at every N tried.
    Ids stay below the sample model's 720 (prepare-data decodes a row with its tokenizer)."""
    rng = np.random.default_rng(21)
    rows = []
    for _ in range(120):
        n = int(rng.integers(10, 70))
        p = int(rng.integers(1, 12))
        ids = np.minimum(rng.zipf(1.2, n) - 1, 699).astype(np.int32)
        rows.append((ids.tolist(), [0] * p + [1] * (n - p)))
    shard = tmp_path / "dataset" / "chat" / "00000.parquet"
    write_shard(shard, rows)
    export = tmp_path / "export.jsonl"
    export_jsonl(shard, export)
    lengths = [12, 20]
    assert sum(len(r) > max(lengths) for r, _ in rows) > 60  # the cut does cut
    sizes = [1, 5, 16, 32, 48, 64, 300]  # 300: more places than ids seen
    mine = {}
    for length in lengths:
        counts, rows_n = dv.count_dataset(shard, TOKENIZER_LEN, max_length=length)
        counts_dir = tmp_path / f"counts-{length}"
        dv.write_counts(counts_dir / "chat" / "00000.parquet", counts, rows_n, max_length=length)
        for n in sizes:
            mine[length, n] = build(tmp_path / f"map-{length}-{n}", counts_dir, n)
        whole, _ = dv.count_dataset(shard, TOKENIZER_LEN)
        assert counts.sum() < whole.sum()
    out = tmp_path / "out"
    out.mkdir()
    run_checker(
        "speculators",
        {
            "export": str(export),
            "out": str(out),
            "max_lengths": lengths,
            "draft_sizes": sizes,
            "target_vocab_size": TARGET_VOCAB,
            "mappings": [str(mine[lengths[0], 16])],
            "model": str(REPO / "sample" / "model"),
        },
        out,
    )
    for length in lengths:
        counts = dv.read_counts(tmp_path / f"counts-{length}" / "chat" / "00000.parquet")
        freq = json.loads((out / f"prepared-counts-{length}.json").read_text())
        assert freq == {str(i): int(counts[i]) for i in np.flatnonzero(counts)}
        for n in sizes:
            d2t, t2d = ours(mine[length, n])
            their_d2t = np.load(out / f"prepared-d2t-{length}-{n}.npy")
            their_t2d = np.load(out / f"prepared-t2d-{length}-{n}.npy")
            np.testing.assert_array_equal(their_d2t, d2t, err_msg=f"L={length} N={n}")
            np.testing.assert_array_equal(their_t2d, t2d, err_msg=f"L={length} N={n}")
    # ... and whole-row counts would have given another mapping at some N (what the key fixes)
    whole, _ = dv.count_dataset(shard, TOKENIZER_LEN)
    differs = [
        n
        for n in sizes
        if not np.array_equal(dv.build_mapping(whole, n, (), TARGET_VOCAB)[1], ours(mine[12, n])[1])
    ]
    assert differs


# --- the pipeline's own output -----------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_run(demo_workdir):
    """The session's demo run (conftest.py: the bundled demo config, run end to end by
    Snakemake in a tmp copy), read only."""
    results = demo_workdir / "results"
    mapping = results / "dataset" / "vocab_mapping"
    summary = json.loads((mapping / "vocab_mapping.json").read_text())
    rows = []
    for shard in sorted((results / "dataset").glob("*/*.parquet")):
        t = pq.read_table(shard, columns=["input_ids", "loss_mask"])
        rows += [
            {"input_ids": i, "loss_mask": m}
            for i, m in zip(t["input_ids"].to_pylist(), t["loss_mask"].to_pylist(), strict=True)
        ]
    return {
        "results": results,
        "mapping": mapping,
        "summary": summary,
        "rows": rows,
        "counts": dv.read_counts(results / dv.COUNTS_DIR / f"{dv.ALL_COUNTS}.parquet"),
    }


def as_set(rows) -> list[str]:
    return sorted(json.dumps(r, sort_keys=True) for r in rows)


@pytest.mark.e2e  # a real Snakemake run of the demo
def test_speculators_on_the_pipeline_output(demo_run, tmp_path):
    n, target = demo_run["summary"]["draft_size"], demo_run["summary"]["target_vocab_size"]
    spec = {
        "export": str(demo_run["results"] / "export"),  # every *.jsonl under the folder
        "out": str(tmp_path),
        "max_lengths": [LONG],
        "draft_sizes": [n],
        "target_vocab_size": target,
        "mappings": [str(demo_run["mapping"])],
    }
    run_checker("speculators", spec, tmp_path)
    # Its pre-tokenized loader reads every row of our export as the dataset holds it.
    theirs = json.loads((tmp_path / f"rows-{LONG}.json").read_text())
    assert as_set(theirs) == as_set(demo_run["rows"]) and len(theirs) > 100
    # Its token frequencies are our counts (merge's pass, summed by the pipeline's rules).
    counts = demo_run["counts"]
    freq = json.loads((tmp_path / f"counts-{LONG}.json").read_text())
    assert freq == {str(i): int(counts[i]) for i in np.flatnonzero(counts)}
    # Its builder gives our d2t/t2d (nothing forced by default, as in speculators).
    d2t, t2d = ours(demo_run["mapping"])
    assert demo_run["summary"]["always_include_ids"] == []
    np.testing.assert_array_equal(np.load(tmp_path / f"d2t-{LONG}-{n}.npy"), d2t)
    np.testing.assert_array_equal(np.load(tmp_path / f"t2d-{LONG}-{n}.npy"), t2d)


@pytest.mark.e2e  # a real Snakemake run of the demo
def test_specforge_on_the_pipeline_output(demo_run, tmp_path):
    n, target = demo_run["summary"]["draft_size"], demo_run["summary"]["target_vocab_size"]
    # data.prompts_path is one JSONL file: `tokenmill export-jsonl --dataset results/dataset`,
    # the per-shard export files in one fixed order (categories, then shards, by name).
    export = tmp_path / "export.jsonl"
    assert (
        export_main(["--dataset", str(demo_run["results"] / "dataset"), "--out", str(export)]) == 0
    )
    parts = sorted((demo_run["results"] / "export").glob("*/*.jsonl"))
    assert export.read_bytes() == b"".join(p.read_bytes() for p in parts)
    spec = {
        "export": str(export),
        "out": str(tmp_path),
        "max_length": LONG,
        "draft_sizes": [n],
        "target_vocab_size": target,
        "mappings": [str(demo_run["mapping"])],
    }
    run_checker("specforge", spec, tmp_path)
    assert as_set(json.loads((tmp_path / "rows.json").read_text())) == as_set(demo_run["rows"])
    # Its builder: our ids, except which of the ids with the cut-off count get in.
    counts = np.pad(demo_run["counts"], (0, target - demo_run["counts"].size))
    d2t, t2d = ours(demo_run["mapping"])
    their_t2d = np.load(tmp_path / f"t2d-{n}.npy")
    np.testing.assert_array_equal(
        np.flatnonzero(their_t2d), np.load(tmp_path / f"d2t-{n}.npy") + np.arange(n)
    )
    cut = counts[t2d].min()
    assert their_t2d[counts > cut].all() and (counts[their_t2d] >= cut).all()
    assert (counts[np.flatnonzero(their_t2d != t2d)] == cut).all()


@pytest.mark.e2e  # a real Snakemake run: the demo, edited
@pytest.mark.timeout(1800)  # the session's demo run (its setup) counts into it
def test_speculators_on_the_pipeline_output_with_a_training_length(demo_workdir, tmp_path):
    """issue 21: the demo rerun with dataset.max_train_length shorter than most rows (merge
    recounts; nothing is generated again) and draft_vocab_size 64. The pipeline's mapping (merge's
    cut counts, the sum rules, the draft_vocab rule; stop ids not forced, the default) equals
    speculators' own build_vocab_mappings_from_distribution on the token frequencies of its own
    prepare-data at --seq-length L, at N = 64 (the pipeline's files) and at every other N tried
    (our builder on the pipeline's counts); summary.json's draft row is that mapping's coverage."""
    import yaml
    from helpers import copy_run, failed, snakemake

    run = copy_run(demo_workdir, tmp_path / "demo")
    lengths = [
        len(r)
        for p in sorted((run / "results" / "dataset").glob("*/*.parquet"))
        for r in pq.read_table(p, columns=["input_ids"]).column(0).to_pylist()
    ]
    length = int(np.median(lengths))  # half the rows are cut
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["dataset"]["max_train_length"] = length
    config["dataset"]["draft_vocab_size"] = 64
    configfile = tmp_path / "train-length.yaml"
    configfile.write_text(yaml.safe_dump(config))
    proc = snakemake(run, "--configfile", str(configfile))
    assert proc.returncode == 0, failed(proc)
    assert "generate_shard" not in proc.stdout + proc.stderr  # only merge and what follows
    results = run / "results"
    mapping = results / "dataset" / "vocab_mapping"
    summary = json.loads((mapping / "vocab_mapping.json").read_text())
    assert summary["max_train_length"] == length and summary["always_include_ids"] == []
    counts = dv.read_counts(results / dv.COUNTS_DIR / f"{dv.ALL_COUNTS}.parquet")
    target = summary["target_vocab_size"]
    sizes = [8, 32, 64, 100, 128, 200]
    maps = {64: mapping}
    for n in sizes:
        if n != 64:
            maps[n] = build(tmp_path / f"map-{n}", results / dv.COUNTS_DIR, n, target=target)
    out = tmp_path / "out"
    out.mkdir()
    run_checker(
        "speculators",
        {
            "export": str(results / "export"),
            "out": str(out),
            "max_lengths": [length],
            "draft_sizes": sizes,
            "target_vocab_size": target,
            "mappings": [str(mapping)],
            "model": str(run / "sample" / "model"),
        },
        out,
    )
    freq = json.loads((out / f"prepared-counts-{length}.json").read_text())
    assert freq == {str(i): int(counts[i]) for i in np.flatnonzero(counts)}
    for n in sizes:
        d2t, t2d = ours(maps[n])
        np.testing.assert_array_equal(np.load(out / f"prepared-d2t-{length}-{n}.npy"), d2t, str(n))
        np.testing.assert_array_equal(np.load(out / f"prepared-t2d-{length}-{n}.npy"), t2d, str(n))
    # Whole-row counts (the demo run before the edit) give another mapping at some N.
    whole = dv.read_counts(demo_workdir / "results" / dv.COUNTS_DIR / f"{dv.ALL_COUNTS}.parquet")
    assert whole.sum() > counts.sum()
    assert any(
        not np.array_equal(dv.build_mapping(whole, n, (), target)[1], ours(maps[n])[1])
        for n in sizes
    )
    # One owner of the coverage: the stats' draft row is vocab_mapping.json's figure.
    stats = json.loads((results / "stats" / "summary.json").read_text())
    (row,) = [r for r in stats["overall"]["token_coverage"]["top_n"] if r.get("draft")]
    assert row["mapping"] and row["share"] == round(summary["draft_coverage"], 6)
    for cat, share in summary["draft_coverage_by_category"].items():
        (row,) = [r for r in stats["categories"][cat]["token_coverage"]["top_n"] if r.get("draft")]
        assert row["share"] == round(share, 6), cat
