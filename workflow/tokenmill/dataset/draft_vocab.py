"""`tokenmill draft-vocab`: the EAGLE-3 draft vocabulary of a dataset, in the layouts of the
two trainers that read it (docs/draft-vocab.md).

An EAGLE-3 drafter predicts over a reduced vocabulary: the `draft_size` target ids that occur
most often where `loss_mask == 1`. Two arrays describe it:

    d2t  int64 [draft_size]         target id of draft id i = i + d2t[i]
    t2d  bool  [target_vocab_size]  t2d[t] is True when target id t is in the draft vocabulary

The selected target ids are sorted ascending, so draft id order is target id order.

Two steps, so that the counting pass over the data happens once per shard. In the pipeline,
`tokenmill merge --counts-out` counts each shard while merging it (the `merge_shard` rule), the
`sum` command adds them per category and overall, and the `from-config` command (the
`draft_vocab` rule) builds the mapping into results/dataset/vocab_mapping/. By hand:

    tokenmill draft-vocab count --dataset results/dataset/CATEGORY/SHARD.parquet --vocab-size V
        # -> results/token_counts/CATEGORY/SHARD.parquet
    tokenmill draft-vocab sum --counts results/token_counts/CATEGORY --category CATEGORY \\
        --out results/token_counts/CATEGORY.parquet
    tokenmill draft-vocab --counts results/token_counts --draft-size N --target-vocab-size V \\
        --always-include 163586,163585 --out-dir results/draft_vocab

The second writes d2t-N.npy and t2d-N.npy (the names vLLM speculators' `train` looks for in its
data folder, or give them with `--d2t-path`/`--t2d-path`), vocab_mapping.pt (SpecForge's
`model.vocab_mapping_path`) and vocab_mapping.json (a summary, with the mapping's coverage: the
one place that number is computed; stats and the card read it).

Selection: ids given with --always-include (in the pipeline: the stop ids, when
dataset.draft_vocab_force_stop_ids is true) are always in; the remaining places go to the ids
with the highest counts, equal counts broken by the smaller token id (the order of
speculators' builder). When fewer ids were seen than there are places, the smallest unused ids
fill the rest (as both trainers do). Nothing here imports torch except `specforge_bytes`.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill import contracts, layout, model

# The folder and file names are the layout module's (tokenmill/layout.py, their one owner).
COUNTS_DIR = layout.COUNTS_DIR
COUNTS_STAGE = "token_counts"
# contracts.META_COUNTS_SCOPE: "shard" (one dataset shard), "category" (the sum of a category's
# shards) or "all" (the sum of every category): a folder given to --counts is read for its shard
# files only, so the sums that lie beside them (results/token_counts/{category}.parquet,
# _all.parquet) are not added twice. Files without it are shard files.
SCOPES = ("shard", "category", "all")
ALL_COUNTS = layout.ALL_COUNTS
MAPPING_DIR = layout.MAPPING_DIR

# results/token_counts/{category}/{shard}.parquet, one per dataset shard: the ids with a non-zero
# count, ascending. Not in results/dataset/: that folder is the published dataset, read as
# */*.parquet by stats, the card and dataset loaders.
TOKEN_COUNTS = pa.schema(
    [
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("count", pa.int64(), nullable=False),
    ]
)

SPECFORGE_PT = layout.SPECFORGE_MAPPING
SUMMARY_JSON = layout.MAPPING_SUMMARY
FORMATS = layout.MAPPING_FORMATS
speculators_names = layout.speculators_mapping_files
format_files = layout.mapping_format_files


def remove_stale_speculators_files(out_dir, keep: Iterable[str]) -> list[str]:
    """Delete d2t/t2d files of another draft size (or the old unsuffixed names) from the
    pipeline's mapping folder, so that speculators finds only this mapping there."""
    removed = []
    for pattern in ("d2t*.npy", "t2d*.npy"):
        for path in sorted(Path(out_dir).glob(pattern)):
            if path.name not in set(keep):
                path.unlink()
                removed.append(path.name)
    return removed


COVERAGE_NS = (8192, 16384, 32768, 65536)
TIE_BREAK = "count descending, then token id ascending"


# ---------------------------------------------------------------------------------------------
# Counting
# ---------------------------------------------------------------------------------------------
def count_loss_tokens(
    input_ids_values: np.ndarray,
    input_ids_offsets,
    loss_mask_values,
    vocab_size: int,
    *,
    max_length: int | None = None,
) -> np.ndarray:
    """Occurrences of each token id at positions where loss_mask == 1, as int64 [vocab_size].

    `input_ids_values`/`input_ids_offsets` are the flat values and row offsets of a list column
    (Arrow layout: row r is values[offsets[r]:offsets[r + 1]]); `loss_mask_values` is indexed
    by the same offsets (the two columns of a dataset shard have equal row lengths). With
    `max_length`, only the first `max_length` positions of each row count (the trainers cut
    rows to their sequence length before counting). One np.bincount, no per-token Python.
    """
    offsets = np.asarray(input_ids_offsets, dtype=np.int64)
    if offsets.ndim != 1 or offsets.size == 0:
        raise ValueError("input_ids_offsets must be a 1-D array of at least one offset")
    start, end = int(offsets[0]), int(offsets[-1])
    ids = np.asarray(input_ids_values)[start:end]
    mask = np.asarray(loss_mask_values)[start:end]
    if ids.shape != (end - start,) or mask.shape != ids.shape:
        raise ValueError(
            f"offsets span {end - start} values but input_ids has {ids.size} and loss_mask "
            f"{mask.size} there"
        )
    keep = mask == 1
    if np.count_nonzero(keep) + np.count_nonzero(mask == 0) != mask.size:
        raise ValueError("loss_mask holds a value other than 0 and 1")
    if max_length is not None:
        lengths = np.diff(offsets)
        if (lengths < 0).any():
            raise ValueError("input_ids_offsets must not decrease")
        position = np.arange(end - start, dtype=np.int64) - np.repeat(offsets[:-1] - start, lengths)
        keep &= position < max_length
    selected = ids[keep]
    if selected.size and (int(selected.min()) < 0 or int(selected.max()) >= vocab_size):
        bad = selected[(selected < 0) | (selected >= vocab_size)][0]
        raise ValueError(f"token id {int(bad)} is outside the vocabulary [0, {vocab_size})")
    return np.bincount(selected.astype(np.int64, copy=False), minlength=vocab_size).astype(
        np.int64, copy=False
    )


def output_window(output_offsets, prompt_lengths, max_length: int) -> np.ndarray:
    """Which output ids lie in the first `max_length` positions of their row (prompt + output):
    a bool mask over the flat output values (offsets from 0). The trainers cut each row to
    their sequence length before counting; this is the same cut, for merge's output arrays."""
    offsets = np.asarray(output_offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    prompt = np.asarray(prompt_lengths, dtype=np.int64)
    if prompt.shape != lengths.shape:
        raise ValueError(f"{prompt.size} prompt lengths for {lengths.size} rows")
    position = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    return position + np.repeat(prompt, lengths) < max_length


def count_dataset(
    path, vocab_size: int, *, max_length: int | None = None, batch_size: int = 1024
) -> tuple[np.ndarray, int]:
    """(counts int64 [vocab_size], rows) of one dataset shard, read a row group at a time
    (token-bounded by the writer, contracts.row_group_ends) in batches of at most `batch_size`
    rows, without a memory map: the working set is a batch of a bounded row group whatever the
    shard's size or row length (8,192-row batches of 16-turn conversation rows took 1 GiB)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    rows = 0
    parquet = pq.ParquetFile(path, memory_map=False)
    batches = (
        batch
        for group in range(parquet.num_row_groups)
        for batch in parquet.iter_batches(
            batch_size, row_groups=[group], columns=["input_ids", "loss_mask"], use_threads=False
        )
    )
    for batch in batches:
        ids, offsets = contracts.list_arrays(batch.column("input_ids"), dtype=None)
        mask, mask_offsets = contracts.list_arrays(batch.column("loss_mask"), dtype=None)
        if not np.array_equal(offsets, mask_offsets):
            raise ValueError(f"{path}: input_ids and loss_mask differ in length in some row")
        counts += count_loss_tokens(ids, offsets, mask, vocab_size, max_length=max_length)
        rows += batch.num_rows
    return counts, rows


def counts_path_for(dataset_path) -> Path:
    """results/dataset/{category}/{shard}.parquet ->
    results/token_counts/{category}/{shard}.parquet."""
    p = Path(dataset_path)
    if p.parent.parent.name != layout.DATASET_DIR:
        raise ValueError(f"{p} is not results/dataset/{{category}}/{{shard}}.parquet: give --out")
    lay = layout.Layout(str(p.parent.parent.parent), "")
    return Path(lay.shard_counts(p.parent.name, p.stem))


def write_counts(
    path,
    counts: np.ndarray,
    rows: int | None = None,
    *,
    category: str | None = None,
    shard: str | None = None,
    scope: str = "shard",
    files: int | None = None,
    max_length: int | None = None,
) -> None:
    """The non-zero counts as Parquet (token_id int32, count int64, ascending ids), with the
    vocabulary size, scope (and category, shard, rows, the counted row length when given) in
    the metadata.
    Deterministic and atomic (tokenmill.contracts)."""
    if scope not in SCOPES:
        raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
    counts = np.asarray(counts)
    if counts.ndim != 1 or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise ValueError("counts must be a 1-D array of non-negative integers")
    ids = np.flatnonzero(counts)
    if ids.size and ids[-1] > np.iinfo(np.int32).max:
        raise ValueError("token ids do not fit int32")
    table = pa.table(
        {"token_id": ids.astype(np.int32), "count": counts[ids].astype(np.int64)},
        schema=TOKEN_COUNTS,
    )
    meta = {
        contracts.META_VOCAB_SIZE: counts.size,
        contracts.META_LOSS_TOKENS: int(counts.sum()),
        contracts.META_COUNTS_SCOPE: scope,
    }
    optional = {
        contracts.META_ROWS: rows,
        contracts.META_CATEGORY: category,
        contracts.META_SHARD: shard,
        contracts.META_SUMMED_FILES: files,
        contracts.META_COUNTS_MAX_LENGTH: max_length,
    }
    meta.update({k: v for k, v in optional.items() if v is not None})
    contracts.write_table(table, path, TOKEN_COUNTS, COUNTS_STAGE, meta)


def read_counts(path) -> np.ndarray:
    """Dense int64 [vocab_size] counts from a token-counts file."""
    meta = contracts.read_metadata(path)
    if meta.get(contracts.META_STAGE) != COUNTS_STAGE or contracts.META_VOCAB_SIZE not in meta:
        raise ValueError(f"{path} is not a tokenmill token-counts file")
    vocab_size = int(meta[contracts.META_VOCAB_SIZE])
    table = pq.read_table(path, columns=["token_id", "count"])
    ids = table.column("token_id").to_numpy().astype(np.int64)
    values = table.column("count").to_numpy().astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{path}: a token id is outside its vocabulary size {vocab_size}")
    counts = np.zeros(vocab_size, dtype=np.int64)
    np.add.at(counts, ids, values)
    return counts


def counts_category(path) -> str:
    """The category of a counts file: its `tokenmill.category` metadata, else the folder it
    lies in (results/token_counts/{category}/{shard}.parquet)."""
    return contracts.read_metadata(path).get(contracts.META_CATEGORY) or Path(path).parent.name


def counts_scope(path) -> str:
    return contracts.read_metadata(path).get(contracts.META_COUNTS_SCOPE) or "shard"


def counts_max_length(path) -> int | None:
    """The row length a counts file was counted with (dataset.max_train_length); None: whole
    rows."""
    value = contracts.read_metadata(path).get(contracts.META_COUNTS_MAX_LENGTH)
    return None if value is None else int(value)


def same_max_length(paths: Sequence) -> int | None:
    """The one row length every file was counted with; a mix is an error (summing counts of
    different cuts would describe no trainer's data)."""
    lengths = {counts_max_length(p) for p in paths}
    if len(lengths) > 1:
        shown = sorted("whole rows" if n is None else str(n) for n in lengths)
        raise ValueError(f"counts files counted with different row lengths: {shown}")
    return lengths.pop() if lengths else None


def sum_counts(paths: Iterable, weights: Mapping[str, float] | None = None) -> np.ndarray:
    """Sum of counts files. Without weights: exact int64. With weights ({category: w}, the
    category of a file being counts_category()): float64, each category's exact integer sum
    times its weight, added in category order, so the result does not depend on the order of
    `paths`."""
    per_category: dict[str, np.ndarray] = {}
    size = None
    for path in paths:
        c = read_counts(path)
        if size is not None and c.size != size:
            raise ValueError(f"{path}: vocabulary size {c.size} differs from {size}")
        size = c.size
        cat = counts_category(path) if weights is not None else ""
        if cat in per_category:
            per_category[cat] += c
        else:
            per_category[cat] = c
    if size is None:
        raise ValueError("no counts files given")
    if weights is None:
        return per_category[""]
    missing = sorted(set(per_category) - set(weights))
    if missing:
        raise ValueError(f"no weight given for categories {missing}")
    total = np.zeros(size, dtype=np.float64)
    for cat in sorted(per_category):
        w = float(weights[cat])
        if not w >= 0:
            raise ValueError(f"weight of {cat!r} must be >= 0, got {weights[cat]!r}")
        total += per_category[cat].astype(np.float64) * w
    return total


# ---------------------------------------------------------------------------------------------
# Mapping
# ---------------------------------------------------------------------------------------------
def select_ids(
    counts: np.ndarray,
    draft_size: int,
    always_include_ids: Sequence[int] = (),
    target_vocab_size: int | None = None,
) -> np.ndarray:
    """The draft vocabulary as ascending target ids (int64 [draft_size])."""
    counts = np.asarray(counts)
    vocab = counts.size if target_vocab_size is None else int(target_vocab_size)
    if counts.ndim != 1 or counts.dtype.kind not in "iuf":
        raise ValueError("counts must be a 1-D numeric array")
    if (counts < 0).any():
        raise ValueError("counts must be non-negative")
    if counts.size > vocab and counts[vocab:].any():
        raise ValueError(f"a counted token id is >= the target vocabulary size {vocab}")
    if not 0 < draft_size <= vocab:
        raise ValueError(f"draft size must be in [1, {vocab}], got {draft_size}")
    forced = np.unique(np.asarray(list(always_include_ids), dtype=np.int64))
    if forced.size and (forced[0] < 0 or forced[-1] >= vocab):
        raise ValueError(f"an always-include id is outside the target vocabulary [0, {vocab})")
    if forced.size > draft_size:
        raise ValueError(f"{forced.size} always-include ids do not fit a draft size {draft_size}")
    counts = counts[:vocab]
    ids = np.arange(counts.size, dtype=np.int64)
    # Highest count first, equal counts by ascending id (lexsort: last key is the primary one).
    order = np.lexsort((ids, -counts))
    order = order[counts[order] > 0]
    order = order[~np.isin(order, forced)]
    chosen = np.concatenate([forced, order[: draft_size - forced.size]])
    if chosen.size < draft_size:
        # Fewer ids seen than places: the smallest unused ids fill the rest (speculators fills
        # from range(draft_size) upwards; SpecForge adds range(draft_size) minus the seen ids).
        used = np.zeros(vocab, dtype=bool)
        used[chosen] = True
        fill = np.flatnonzero(~used)[: draft_size - chosen.size]
        chosen = np.concatenate([chosen, fill])
    return np.sort(chosen)


def build_mapping(
    counts: np.ndarray,
    draft_size: int,
    always_include_ids: Sequence[int] = (),
    target_vocab_size: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(d2t int64 [draft_size], t2d bool [target_vocab_size]), as both trainers define them:
    target = draft + d2t[draft]; t2d[target] True when target is in the draft vocabulary.
    `target_vocab_size` defaults to len(counts); pass the model config's vocab_size (the
    trainers check t2d against it; it can exceed the tokenizer's length)."""
    selected = select_ids(counts, draft_size, always_include_ids, target_vocab_size)
    vocab = len(counts) if target_vocab_size is None else int(target_vocab_size)
    d2t = selected - np.arange(draft_size, dtype=np.int64)
    t2d = np.zeros(vocab, dtype=bool)
    t2d[selected] = True
    return d2t, t2d


def coverage(counts: np.ndarray, ns: Iterable[int] = COVERAGE_NS) -> dict[int, float]:
    """{n: share of the loss-masked tokens that fall on the n most frequent ids}."""
    counts = np.asarray(counts, dtype=np.float64)
    total = float(counts.sum())
    ranked = np.sort(counts)[::-1]
    cum = np.cumsum(ranked)
    out = {}
    for n in ns:
        n = int(n)
        covered = float(cum[min(n, cum.size) - 1]) if n > 0 and cum.size else 0.0
        out[n] = covered / total if total else 0.0
    return out


COVERAGE_SHARES = (0.9, 0.95, 0.99, 0.999)


def coverage_view(
    counts: np.ndarray, draft_size: int | None = None, draft_share: float | None = None
) -> dict:
    """What people look at before choosing a draft vocabulary size (stats/summary.json):

    loss_tokens, distinct_ids, vocab_size (the counts' length),
    top_n: [{n, ids, capped, share}] for n in COVERAGE_NS (and the configured draft size,
        marked draft: true): the share of loss tokens on the `ids` = min(n, vocab_size) most
        frequent ids (capped: n exceeds the vocabulary, so every id is in); the draft row's
        share is `draft_share` when given (the written mapping's coverage, vocab_mapping.json:
        forced ids and category weights make it differ from the top n), marked mapping: true;
    ids_for_share: {share: the fewest ids that cover it} (null when nothing was counted).
    The second half is what still says something when the vocabulary is smaller than 8192."""
    counts = np.asarray(counts)
    vocab = int(counts.size)
    total = int(counts.sum())
    cum = np.cumsum(np.sort(counts)[::-1])
    ns = [(int(n), False) for n in COVERAGE_NS]
    if draft_size:
        ns.append((int(draft_size), True))
    rows = []
    for n, is_draft in sorted(ns):
        ids = min(n, vocab)
        share = int(cum[ids - 1]) / total if total and ids else 0.0
        row = {"n": n, "ids": ids, "capped": n > vocab, "share": round(share, 6)}
        if is_draft:
            row["draft"] = True
            if draft_share is not None:
                row["share"] = round(float(draft_share), 6)
                row["mapping"] = True
        rows.append(row)
    return {
        "loss_tokens": total,
        "distinct_ids": int(np.count_nonzero(counts)),
        "vocab_size": vocab,
        "top_n": rows,
        "ids_for_share": {
            str(share): int(np.searchsorted(cum, share * total, side="left")) + 1 if total else None
            for share in COVERAGE_SHARES
        },
    }


def mapping_coverage(counts: np.ndarray, t2d: np.ndarray) -> float:
    """Share of the loss-masked tokens whose id is in the draft vocabulary."""
    counts = np.asarray(counts, dtype=np.float64)
    total = float(counts.sum())
    n = min(counts.size, t2d.size)
    return float(counts[:n][t2d[:n]].sum()) / total if total else 0.0


# ---------------------------------------------------------------------------------------------
# Writers: bytes first (for the summary's sha256), then atomically to disk
# ---------------------------------------------------------------------------------------------
def _write_bytes(path, data: bytes) -> None:
    tmp = contracts.atomic_path(path)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def _check(d2t: np.ndarray, t2d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d2t = np.ascontiguousarray(d2t, dtype=np.int64)
    t2d = np.ascontiguousarray(t2d, dtype=bool)
    target = d2t + np.arange(d2t.size, dtype=np.int64)
    if int(t2d.sum()) != d2t.size or not np.array_equal(np.flatnonzero(t2d), target):
        raise ValueError("d2t and t2d disagree: nonzero(t2d) must equal d2t + arange(draft)")
    return d2t, t2d


def speculators_bytes(d2t: np.ndarray, t2d: np.ndarray) -> dict[str, bytes]:
    """{d2t-N.npy: int64 [N], t2d-N.npy: bool [target]} as speculators np.load()s them."""
    d2t, t2d = _check(d2t, t2d)
    d2t_name, t2d_name = speculators_names(d2t.size)
    return {d2t_name: _npy_bytes(d2t), t2d_name: _npy_bytes(t2d)}


def specforge_bytes(d2t: np.ndarray, t2d: np.ndarray) -> bytes:
    """SpecForge's vocab mapping file: torch.save({"d2t": int64 tensor, "t2d": bool tensor}).
    The only place torch is imported. Saved to memory, so the archive's inner folder name is
    torch's fixed "archive" rather than the name of a temporary file (byte-identical files)."""
    try:
        import torch
    except ImportError as exc:  # torch is the `reference` extra, not a base dependency
        raise RuntimeError(
            "writing SpecForge's vocab_mapping.pt needs torch (pip install 'tokenmill[reference]'"
            "), or leave it out with --format speculators"
        ) from exc
    d2t, t2d = _check(d2t, t2d)
    buf = io.BytesIO()
    torch.save(
        {"d2t": torch.from_numpy(d2t.copy()), "t2d": torch.from_numpy(t2d.copy())},
        buf,
    )
    return buf.getvalue()


def write_speculators(out_dir, d2t: np.ndarray, t2d: np.ndarray) -> dict[str, str]:
    """Write d2t-N.npy and t2d-N.npy; {file name: sha256}."""
    out = {}
    for name, data in speculators_bytes(d2t, t2d).items():
        _write_bytes(Path(out_dir) / name, data)
        out[name] = hashlib.sha256(data).hexdigest()
    return out


def write_specforge(out_dir, d2t: np.ndarray, t2d: np.ndarray) -> dict[str, str]:
    """Write vocab_mapping.pt; {file name: sha256}."""
    data = specforge_bytes(d2t, t2d)
    _write_bytes(Path(out_dir) / SPECFORGE_PT, data)
    return {SPECFORGE_PT: hashlib.sha256(data).hexdigest()}


def write_mapping(
    out_dir,
    counts: np.ndarray,
    draft_size: int,
    always_include_ids: Sequence[int] = (),
    target_vocab_size: int | None = None,
    formats: Sequence[str] = FORMATS,
    inputs: Sequence[dict] = (),
    weights: Mapping[str, float] | None = None,
    loss_counts: np.ndarray | None = None,
    by_category: Mapping[str, np.ndarray] | None = None,
    max_length: int | None = None,
) -> dict:
    """Build the mapping, write it in `formats` and vocab_mapping.json; returns the summary.

    `counts` choose the ids (weighted when `weights` were applied); the coverage figures are
    shares of the real loss tokens: `loss_counts` (the unweighted sum; default `counts`) and,
    per category, `by_category`. vocab_mapping.json's draft_coverage and
    draft_coverage_by_category are the numbers stats and the card show."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown or not formats:
        raise ValueError(f"formats must be among {list(FORMATS)}, got {list(formats)}")
    d2t, t2d = build_mapping(counts, draft_size, always_include_ids, target_vocab_size)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    files: dict[str, str] = {}
    if "speculators" in formats:
        files.update(write_speculators(out_dir, d2t, t2d))
    if "specforge" in formats:
        files.update(write_specforge(out_dir, d2t, t2d))
    counts = np.asarray(counts if loss_counts is None else loss_counts)
    total = counts.sum()
    summary = {
        "draft_size": int(draft_size),
        "target_vocab_size": int(t2d.size),
        "counts_vocab_size": int(counts.size),
        "loss_tokens": int(total) if counts.dtype.kind in "iu" else float(total),
        "distinct_ids_seen": int(np.count_nonzero(counts)),
        "always_include_ids": sorted({int(i) for i in always_include_ids}),
        "tie_break": TIE_BREAK,
        "draft_coverage": mapping_coverage(counts, t2d),
        "coverage_top_n": {str(n): share for n, share in coverage(counts).items()},
        "files": dict(sorted(files.items())),
        "inputs": list(inputs),
    }
    if by_category is not None:
        summary["draft_coverage_by_category"] = {
            cat: mapping_coverage(c, t2d) for cat, c in sorted(by_category.items())
        }
    if max_length is not None:
        summary["max_train_length"] = int(max_length)
    if weights is not None:
        summary["weights"] = {k: float(v) for k, v in sorted(weights.items())}
    text = json.dumps(summary, indent=2, sort_keys=True) + "\n"
    _write_bytes(Path(out_dir) / SUMMARY_JSON, text.encode())
    return summary


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------
def find_counts(items: Iterable[str]) -> list[Path]:
    """Counts files named directly, or every shard counts file under a folder (not the sums
    that lie beside them); sorted."""
    found: set[Path] = set()
    for item in items:
        p = Path(item)
        if p.is_dir():
            found.update(f for f in p.rglob("*.parquet") if counts_scope(f) == "shard")
        elif p.is_file():
            found.add(p)
        else:
            raise FileNotFoundError(f"no such counts file or folder: {item}")
    return sorted(found)


def _ids(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _weights(items: Sequence[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        cat, sep, w = item.partition("=")
        if not sep:
            raise ValueError(f"--weight takes CATEGORY=WEIGHT, got {item!r}")
        out[cat] = float(w)
    return out


def _count_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill draft-vocab count",
        description="count the loss-masked token ids of one dataset shard",
    )
    parser.add_argument("--dataset", required=True, help="a results/dataset/... shard")
    parser.add_argument("--vocab-size", type=int, required=True, help="ids must be below it")
    parser.add_argument("--out", help="default: results/token_counts/{category}/{shard}.parquet")
    parser.add_argument("--max-length", type=int, help="count only the first N tokens of a row")
    args = parser.parse_args(argv)
    counts, rows = count_dataset(args.dataset, args.vocab_size, max_length=args.max_length)
    out = args.out or counts_path_for(args.dataset)
    write_counts(out, counts, rows, max_length=args.max_length)
    print(f"{out}: {int(counts.sum())} loss tokens, {np.count_nonzero(counts)} distinct ids")
    return 0


def _sum_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill draft-vocab sum",
        description="add counts files: one category's shards, or every category's sum",
    )
    parser.add_argument("--counts", nargs="+", required=True, help="counts files or folders")
    parser.add_argument("--out", required=True)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--category", help="the shards of this category (a category sum)")
    which.add_argument("--all", action="store_true", help="every category (the overall sum)")
    args = parser.parse_args(argv)
    paths = find_counts(args.counts)
    if not paths:
        print("tokenmill draft-vocab sum: no counts files found", file=sys.stderr)
        return 2
    try:
        counts, rows = sum_files(paths, category=args.category)
    except ValueError as exc:
        print(f"tokenmill draft-vocab sum: {exc}", file=sys.stderr)
        return 1
    scope = "all" if args.all else "category"
    write_counts(
        args.out, counts, rows, category=args.category, scope=scope, files=len(paths),
        max_length=same_max_length(paths),
    )  # fmt: skip
    print(f"{args.out}: {int(counts.sum())} loss tokens from {len(paths)} files")
    return 0


def sum_files(paths: Sequence, category: str | None = None) -> tuple[np.ndarray, int | None]:
    """(exact sum, summed rows or None) of counts files of one scope. With `category`, every
    file must be a shard of it: a sum must never take in a file twice or another category."""
    scopes = {counts_scope(p) for p in paths}
    if len(scopes) != 1:
        raise ValueError(f"counts files of different scopes {sorted(scopes)}: sum one kind")
    if category is not None:
        others = sorted(str(p) for p in paths if counts_category(p) != category)
        if others or scopes != {"shard"}:
            raise ValueError(f"not shard counts of category {category!r}: {others or paths}")
    same_max_length(paths)
    rows = [contracts.read_metadata(p).get(contracts.META_ROWS) for p in paths]
    total_rows = sum(int(r) for r in rows) if None not in rows else None
    return sum_counts(paths), total_rows


def model_vocab_size(model_name: str, revision: str | None = None, basedir=".") -> int:
    """The target model config's vocab_size (the length of t2d), read where the generate and
    tokenize stages read it (tokenmill.model.model_vocab_size); an error says why."""
    vocab, where = model.model_vocab_size(model_name, basedir, revision)
    if vocab is None:
        raise ValueError(f"generation.model: no vocab_size for the draft vocabulary: {where}")
    return vocab


def _from_config_main(argv: list[str]) -> int:
    """The `draft_vocab` rule: every setting from the pipeline's config sections."""
    from tokenmill.dataset import validate
    from tokenmill.settings import thaw

    parser = argparse.ArgumentParser(
        prog="tokenmill draft-vocab from-config",
        description="build the draft vocabulary as the config's dataset.draft_vocab_* keys say",
    )
    parser.add_argument("--counts", nargs="+", required=True, help="counts files or folders")
    validate.add_config_arguments(parser)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    sections = validate.load_config_arguments(args, "tokenmill draft-vocab")
    if sections is None:
        return 1
    ds, gen, tok = sections

    def fail(key, message) -> int:
        print(f"tokenmill draft-vocab: config key 'dataset.{key}': {message}", file=sys.stderr)
        return 1

    size = ds.draft_vocab_size
    if size is None:
        return fail("draft_vocab_size", "null: there is no draft vocabulary to build")
    paths = find_counts(args.counts)
    if not paths:
        print("tokenmill draft-vocab: no counts files found", file=sys.stderr)
        return 2
    forced: list[int] = []
    if ds.draft_vocab_force_stop_ids:
        # The configured stop tokens as the tokenizer resolves them, plus its eos: merge's.
        try:
            forced = sorted(set(validate.facts_of_arguments(args, ds, gen, tok).stop_ids))
        except ValueError as exc:
            print(f"tokenmill draft-vocab: {exc}", file=sys.stderr)
            return 1
    target = ds.draft_vocab_target_size
    if target is None:
        try:
            target = model_vocab_size(gen.model, gen.revision, args.basedir)
        except Exception as exc:  # noqa: BLE001 - reported with the key that avoids it
            return fail(
                "draft_vocab_target_size",
                f"null, and the vocab_size of generation.model {gen.model!r} could not "
                f"be read ({exc}); set it to the model config's vocab_size",
            )
    weights = thaw(ds.draft_vocab_weights) or None
    if weights is not None:
        # Categories without a weight count once.
        weights = {counts_category(p): 1.0 for p in paths} | dict(weights)
    inputs = [
        {
            "path": f"{p.parent.name}/{p.name}",
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in paths
    ]
    try:
        length = same_max_length(paths)
        if length != ds.max_train_length:
            return fail(
                "max_train_length",
                f"{ds.max_train_length} but the token counts were counted with "
                f"{length} (rerun merge)",
            )
        by_category: dict[str, np.ndarray] = {}
        for p in paths:
            c = read_counts(p)
            cat = counts_category(p)
            by_category[cat] = by_category[cat] + c if cat in by_category else c
        loss_counts = sum_counts(paths)
        counts = sum_counts(paths, weights) if weights is not None else loss_counts
        summary = write_mapping(
            args.out_dir,
            counts,
            int(size),
            forced,
            int(target),
            list(ds.draft_vocab_formats),
            inputs,
            weights,
            loss_counts=loss_counts,
            by_category=by_category,
            max_length=length,
        )
    except ValueError as exc:
        return fail("draft_vocab_size", f"{size} with target vocabulary {target}: {exc}")
    for name in remove_stale_speculators_files(args.out_dir, summary["files"]):
        print(f"removed {name} (a mapping of another draft size)")
    print(
        f"draft vocabulary of {summary['draft_size']} ids over {summary['target_vocab_size']} "
        f"(always in: {summary['always_include_ids']}): {summary['draft_coverage']:.2%} of "
        f"{summary['loss_tokens']} loss tokens; wrote {', '.join(summary['files'])} and "
        f"{SUMMARY_JSON} to {args.out_dir}"
    )
    return 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "count":
        return _count_main(argv[1:])
    if argv and argv[0] == "sum":
        return _sum_main(argv[1:])
    if argv and argv[0] == "from-config":
        return _from_config_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="tokenmill draft-vocab",
        description="build the draft vocabulary (d2t/t2d) from per-shard token counts; "
        "`tokenmill draft-vocab count --help` makes those counts, `sum --help` adds them, "
        "`from-config --help` is the pipeline's draft_vocab rule",
    )
    parser.add_argument("--counts", nargs="+", required=True, help="counts files or folders")
    parser.add_argument("--draft-size", type=int, required=True)
    parser.add_argument(
        "--target-vocab-size",
        type=int,
        required=True,
        help="the target model config's vocab_size: the length of t2d",
    )
    parser.add_argument(
        "--always-include",
        type=_ids,
        default=[],
        help="ids always in the draft vocabulary (stop/end-of-turn ids), comma-separated",
    )
    parser.add_argument(
        "--weight", action="append", help="CATEGORY=WEIGHT: scale a category's counts"
    )
    parser.add_argument(
        "--format",
        action="append",
        choices=FORMATS,
        help="speculators (d2t-N.npy, t2d-N.npy) and/or specforge (vocab_mapping.pt); default both",
    )
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    paths = find_counts(args.counts)
    if not paths:
        print("tokenmill draft-vocab: no counts files found", file=sys.stderr)
        return 2
    weights = _weights(args.weight)
    counts = sum_counts(paths, weights)
    loss_counts = sum_counts(paths) if weights is not None else counts
    inputs = []
    for p in paths:
        data = p.read_bytes()
        inputs.append(
            {"path": f"{p.parent.name}/{p.name}", "sha256": hashlib.sha256(data).hexdigest()}
        )
    summary = write_mapping(
        args.out_dir,
        counts,
        args.draft_size,
        args.always_include,
        args.target_vocab_size,
        args.format or FORMATS,
        inputs,
        weights,
        loss_counts=loss_counts,
        max_length=same_max_length(paths),
    )
    print(
        f"draft vocabulary of {summary['draft_size']} ids over {summary['target_vocab_size']}: "
        f"{summary['draft_coverage']:.2%} of {summary['loss_tokens']} loss tokens; "
        f"wrote {', '.join(summary['files'])} and {SUMMARY_JSON} to {args.out_dir}"
    )
    return 0
