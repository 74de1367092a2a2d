"""`tokenmill prepare`: one category's sources -> normalized prompts + rejected rows.

    tokenmill prepare --category NAME --category-config JSON_OR_FILE \\
        --out results/prompts/NAME.parquet --rejected results/rejected/prepare/NAME.parquet \\
        [--basedir DIR]

Records are read in source order (sources as listed, files sorted by path), mapped to
conversations (tokenmill.prepare.formats), cut into prompts by the category's `turns`, deduplicated
by prompt_id (the first occurrence in source order is kept) and, with `max_prompts`, sampled
by ranking sha256(f"{sample_seed}:{prompt_id}"): editing one prompt never reshuffles others.

Counting: the unit is a candidate prompt. A record that fails before turn selection is one
rejected row; a valid record yields one candidate per selected prompt (several with
turns=all), each either kept or rejected (duplicate_prompt, over_max_prompts). So
`tokenmill.records_in` = kept + rejected always holds; `tokenmill.source_records` is the
number of records read. Prompts are sorted by prompt_id, rejected rows by source order.

Memory does not follow the data: records are read once and spilled (Arrow IPC, uncompressed,
in a hidden folder next to the output, removed at the end; about twice the size of the
sources on disk, then once more for the kept prompts). Deduplication, sampling and ordering
work on 16-byte prompt ids and integer arrays (under 100 bytes per prompt); a second pass over
the spill writes the rejected rows in source order and sends each kept prompt to the bucket
of its output row group; the buckets are then written in order, row group by row group, which
gives the same bytes as writing whole tables. Measured: benchmarks/bench_prepare.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
from array import array
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import guards
from tokenmill.contracts import (
    META_CATEGORY,
    META_CONTEXT,
    META_SOURCE_RECORDS,
    PROMPTS,
    REJECTED,
    ROW_GROUP_SIZE,
    ParquetWriter,
    count_metadata,
    ordered_json,
    rejected_table,
)
from tokenmill.prepare import formats
from tokenmill.prepare.hooks import load_hook
from tokenmill.prepare.sources import SourceError, expand_paths, iter_source
from tokenmill.settings import CategorySettings, ConfigError, as_section, load_section, thaw

STAGE = "prepare"


class PrepareError(RuntimeError):
    """A problem that stops the whole category (bad config, unreadable source)."""


def category_settings(category: str, cat: CategorySettings | dict) -> CategorySettings:
    """The category's settings (a dict is validated against the schema, defaults filled in),
    checked for what the schema cannot say. PrepareError names the key."""
    try:
        cat = as_section(cat, f"categories.{category}")
    except ConfigError as exc:
        raise PrepareError(str(exc)) from None
    if any(spec["format"] == "instruction" for spec in cat.source_specs()):
        try:
            formats.instruction_columns(thaw(cat.format_options))
        except formats.ColumnClash as exc:
            raise PrepareError(
                f"config key 'categories.{category}.format_options.{exc.role}': {exc}"
            ) from None
    return cat


def prompt_row(pid: str, source: str, messages: list, tools: list | None) -> dict:
    """One PROMPTS row. Messages and tools keep their source key order: templates render
    tools with tojson, so sorting would change what the model sees."""
    return {
        "prompt_id": pid,
        "source": source,
        "messages": ordered_json(messages),
        "tools": None if tools is None else ordered_json(tools),
    }


def sample_rank(seed: int, pid: str) -> str:
    return hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest()


def _get_hook(cat: CategorySettings, basedir: Path, fmt: str):
    if fmt != "hook":
        return None
    if not cat.hook:
        raise PrepareError("category config: format 'hook' needs hook: 'module:function'")
    # Hooks live next to the workflow (e.g. sample/hooks.py -> sample.hooks:fn).
    try:
        return load_hook(cat.hook, basedir)
    except Exception as exc:  # noqa: BLE001 - any import problem stops the category
        raise PrepareError(f"category config: hook '{cat.hook}': {exc}") from exc


# Spill files: candidate prompts and rejections in source order, then the kept prompts split
# into buckets by their output position. Every bucket holds one output row group.
SPILL = pa.schema(
    [
        pa.field("prompt_id", pa.string()),  # null: rejected before turn selection
        pa.field("source", pa.string()),
        pa.field("messages", pa.large_string()),
        pa.field("tools", pa.large_string()),
        pa.field("raw", pa.large_string()),
        pa.field("reason", pa.string()),
        pa.field("detail", pa.string()),
    ]
)
BUCKET = pa.schema(
    [
        pa.field("position", pa.int64()),
        pa.field("prompt_id", pa.string()),
        pa.field("source", pa.string()),
        pa.field("messages", pa.large_string()),
        pa.field("tools", pa.large_string()),
    ]
)
SPILL_BATCH_ROWS = 1024
BUCKET_FLUSH_BYTES = 32 << 20  # kept prompts buffered before they go to their bucket files
# Uncompressed: lz4 made the stage about 1.7x slower at 40,000 records; the spill is transient.
IPC_OPTIONS = pa.ipc.IpcWriteOptions()

# Per candidate prompt, after the source pass: kept, a later duplicate, or not sampled.
KEPT, DUPLICATE, NOT_SAMPLED = 0, 1, 2


class _Spill:
    """Appends rows to an Arrow IPC stream in batches (bounded memory)."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.schema = schema
        self.rows: dict[str, list] = {name: [] for name in schema.names}
        self._sink = pa.OSFile(str(path), "wb")
        self._writer = pa.ipc.new_stream(self._sink, schema, options=IPC_OPTIONS)

    def append(self, **row) -> None:
        for name, values in self.rows.items():
            values.append(row.get(name))
        if len(self.rows["source"]) >= SPILL_BATCH_ROWS:
            self.flush()

    def flush(self) -> None:
        if self.rows["source"]:
            self._writer.write_batch(pa.record_batch(self.rows, schema=self.schema))
            self.rows = {name: [] for name in self.schema.names}

    def close(self) -> None:
        self.flush()
        self._writer.close()
        self._sink.close()


def _read_stream(path: Path):
    """The record batches of an IPC file made of one or more appended streams."""
    with pa.OSFile(str(path), "rb") as f:
        size = f.size()
        while f.tell() < size:
            yield from pa.ipc.open_stream(f)


def _source_pass(category: str, cat: CategorySettings, basedir: Path, spill: _Spill):
    """Read every source once, in order: each record becomes one rejection or one candidate
    prompt per selected turn, spilled as it comes. Returns (records read, spilled rows, the
    candidates' prompt ids as 16-byte keys (two big-endian uint64 columns), the spill row of
    each candidate)."""
    options = thaw(cat.format_options)
    hooks: dict[str, object] = {}
    pids, rows = bytearray(), array("q")
    n_records = n_rows = 0
    for spec in cat.source_specs():
        fmt = spec["format"]
        if fmt not in hooks:
            hooks[fmt] = _get_hook(cat, basedir, fmt)
        try:
            for record in iter_source(spec, basedir):
                n_records += 1
                if record.data is None:
                    spill.append(source=record.location, raw=record.raw,
                                 reason=formats.UNPARSEABLE, detail=record.error)  # fmt: skip
                    n_rows += 1
                    continue
                try:
                    prompts = formats.to_prompts(
                        record.data, fmt, options, hooks[fmt], cat.turns, cat.context
                    )
                except formats.RecordError as exc:
                    spill.append(source=record.location, raw=record.raw,
                                 reason=exc.reason, detail=exc.detail)  # fmt: skip
                    n_rows += 1
                    continue
                for pid, messages, tools in prompts:
                    spill.append(
                        raw=record.raw, **prompt_row(pid, record.location, messages, tools)
                    )
                    pids += bytes.fromhex(pid)
                    rows.append(n_rows)
                    n_rows += 1
        except SourceError as exc:
            raise PrepareError(str(exc)) from exc
    return n_records, n_rows, np.frombuffer(bytes(pids), dtype=">u8").reshape(-1, 2), rows


def _decide(pids: np.ndarray, limit: int | None, seed: int):
    """Per candidate: KEPT / DUPLICATE / NOT_SAMPLED, the output position of kept prompts
    (prompt_id order), and the candidate index of each prompt's first occurrence. Works on
    16-byte ids and integer arrays only."""
    n = len(pids)
    status = np.full(n, DUPLICATE, dtype=np.int8)
    position = np.full(n, -1, dtype=np.int64)
    first_of = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return status, position, first_of
    # prompt_id order (hex order is byte order), first occurrence first among equal ids
    order = np.lexsort((np.arange(n), pids[:, 1], pids[:, 0]))
    sorted_ids = pids[order]
    new = np.ones(n, dtype=bool)
    new[1:] = np.any(sorted_ids[1:] != sorted_ids[:-1], axis=1)
    group = np.cumsum(new) - 1
    firsts = order[new]  # candidate index of each distinct prompt, in prompt_id order
    first_of[order] = firsts[group]
    status[firsts] = KEPT
    if limit is not None and len(firsts) > limit:
        # Sampling ranks sha256(f"{seed}:{prompt_id}"): editing one prompt moves no other.
        ranks = np.frombuffer(
            b"".join(bytes.fromhex(sample_rank(seed, pid.tobytes().hex())) for pid in pids[firsts]),
            dtype=">u8",
        ).reshape(-1, 4)
        by_rank = np.lexsort((ranks[:, 3], ranks[:, 2], ranks[:, 1], ranks[:, 0]))
        status[firsts[by_rank[limit:]]] = NOT_SAMPLED
    kept = firsts[status[firsts] == KEPT]  # still in prompt_id order
    position[kept] = np.arange(len(kept))
    return status, position, first_of


class _Buckets:
    """Kept prompts go to the bucket of their output row group (position // ROW_GROUP_SIZE);
    buffers are flushed to the bucket files whenever they hold BUCKET_FLUSH_BYTES."""

    def __init__(self, directory: Path, n_buckets: int):
        self.dir = directory
        self.buffers: list[list[tuple]] = [[] for _ in range(n_buckets)]
        self.bytes = 0

    def path(self, k: int) -> Path:
        return self.dir / f"bucket-{k:06d}.arrows"

    def add(self, position: int, pid: str, source: str, messages: str, tools: str | None):
        self.buffers[position // ROW_GROUP_SIZE].append((position, pid, source, messages, tools))
        self.bytes += len(messages) + len(tools or "") + len(source) + 64
        if self.bytes >= BUCKET_FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        for k, rows in enumerate(self.buffers):
            if not rows:
                continue
            columns = [list(c) for c in zip(*rows, strict=True)]
            batch = pa.record_batch(columns, schema=BUCKET)
            with (
                open(self.path(k), "ab") as f,
                pa.ipc.new_stream(f, BUCKET, options=IPC_OPTIONS) as w,
            ):
                w.write_batch(batch)
            rows.clear()
        self.bytes = 0

    def table(self, k: int) -> pa.Table:
        """Bucket k as an output row group: sorted by position, one chunk per column."""
        batches = list(_read_stream(self.path(k))) if self.path(k).exists() else []
        t = pa.Table.from_batches(batches, schema=BUCKET)
        t = t.take(pc.sort_indices(t, [("position", "ascending")])).combine_chunks()
        return t.drop_columns(["position"])


def prepare_files(
    category: str, cat: CategorySettings | dict, out, rejected_out, basedir: str | Path = "."
) -> dict:
    """Run the stage with bounded memory (see the module docstring): write both files and
    return the counts."""
    cat = category_settings(category, cat)
    basedir, out, rejected_out = Path(basedir), Path(out), Path(rejected_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    spill_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".spill", dir=out.parent))
    try:
        spill = _Spill(spill_dir / "records.arrows", SPILL)
        try:
            n_records, n_rows, pids, cand_rows = _source_pass(category, cat, basedir, spill)
        finally:
            spill.close()
        limit, seed = cat.max_prompts, cat.sample_seed
        status, position, first_of = _decide(pids, limit, seed)
        n_kept = int((status == KEPT).sum())
        counts = {
            "records_in": n_rows,
            "kept": n_kept,
            "rejected": n_rows - n_kept,
            "source_records": n_records,
        }
        # Candidate index per spill row (-1: a rejection from the source pass).
        candidate = np.full(n_rows, -1, dtype=np.int64)
        candidate[np.frombuffer(cand_rows, dtype=np.int64)] = np.arange(len(pids))
        needed_sources = set(first_of[status == DUPLICATE].tolist())
        first_source: dict[int, str] = {}
        buckets = _Buckets(spill_dir, -(-n_kept // ROW_GROUP_SIZE))
        meta = _metadata(category, counts)
        if cat.context != "dataset":
            # Read by tokenize: conversation rows instead of prompt rows (only then, so that
            # the files of every other category stay byte-identical).
            meta[META_CONTEXT] = cat.context
        with ParquetWriter(rejected_out, REJECTED, STAGE, meta) as rejected_writer:
            pending: list[dict] = []
            row = 0
            for batch in _read_stream(spill_dir / "records.arrows"):
                cols = batch.to_pydict()
                for i in range(batch.num_rows):
                    c = int(candidate[row])
                    row += 1
                    reject = None
                    if c < 0:
                        reject = (cols["reason"][i], cols["detail"][i])
                    elif status[c] == KEPT:
                        buckets.add(int(position[c]), cols["prompt_id"][i], cols["source"][i],
                                    cols["messages"][i], cols["tools"][i])  # fmt: skip
                        if c in needed_sources:
                            first_source[c] = cols["source"][i]
                    elif status[c] == DUPLICATE:
                        first = first_source[int(first_of[c])]  # always read before
                        reject = (formats.DUPLICATE_PROMPT, f"same prompt as {first}")
                    else:
                        if c in needed_sources:
                            first_source[c] = cols["source"][i]
                        detail = f"not among the {limit} prompts chosen with sample_seed {seed}"
                        reject = (formats.OVER_MAX_PROMPTS, detail)
                    if reject is not None:
                        pending.append(
                            dict(stage=STAGE, category=category, reason=reject[0],
                                 detail=reject[1], source=cols["source"][i],
                                 prompt_id=cols["prompt_id"][i], record=cols["raw"][i])
                        )  # fmt: skip
                        if len(pending) == ROW_GROUP_SIZE:
                            rejected_writer.write(rejected_table(pending))
                            pending = []
            if pending or not rejected_writer.rows:
                rejected_writer.write(rejected_table(pending))
        buckets.flush()
        with ParquetWriter(out, PROMPTS, STAGE, meta) as writer:
            for k in range(len(buckets.buffers)):
                writer.write(buckets.table(k))
            writer.write_schema_if_empty()
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)
    return counts


def prepare(category: str, cat: CategorySettings | dict, basedir: str | Path = "."):
    """The stage in memory, for tests and small inputs: (prompt rows sorted by prompt_id,
    rejected rows in source order, counts)."""
    with tempfile.TemporaryDirectory() as tmp:
        out, rej = Path(tmp) / "prompts.parquet", Path(tmp) / "rejected.parquet"
        counts = prepare_files(category, cat, out, rej, basedir)
        prompts = pq.read_table(out).to_pylist()
        rejected_rows = pq.read_table(rej).to_pylist()
    return prompts, rejected_rows, counts


def _metadata(category: str, counts: dict) -> dict:
    return {
        META_CATEGORY: category,
        **count_metadata(counts["records_in"], counts["kept"], counts["rejected"]),
        META_SOURCE_RECORDS: str(counts["source_records"]),
    }


def _empty_sources(cat: CategorySettings, basedir) -> str:
    """'PATH is empty (0 bytes), ...' for the category's local source files that are empty."""
    empty = []
    for spec in cat.source_specs():
        if "path" in spec:
            try:
                files = expand_paths(spec["path"], Path(basedir))
            except SourceError:
                continue
            empty += [shown for shown, real in files if real.stat().st_size == 0]
    return ", ".join(f"{f} is empty (0 bytes)" for f in empty)


def _load_category_config(category: str, value: str) -> CategorySettings:
    """--category-config: the category's section (or the whole config), validated."""
    try:
        return load_section(value, f"categories.{category}")
    except ConfigError as exc:
        raise PrepareError(str(exc)) from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill prepare", description="sources of one category -> normalized prompts"
    )
    parser.add_argument("--category", required=True)
    parser.add_argument(
        "--category-config", required=True, help="the category's config as JSON (or a JSON file)"
    )
    parser.add_argument("--out", required=True, help="prompts Parquet file")
    parser.add_argument("--rejected", required=True, help="rejected rows Parquet file")
    parser.add_argument("--basedir", default=".", help="source paths are relative to this")
    guards.add_limits_argument(parser)
    args = parser.parse_args(argv)
    try:
        cat = _load_category_config(args.category, args.category_config)
        limit = guards.limit_for(STAGE, args.reject_limits)
        counts = prepare_files(args.category, cat, args.out, args.rejected, args.basedir)
    except (PrepareError, ConfigError, OSError, json.JSONDecodeError) as exc:
        print(f"tokenmill prepare [{args.category}]: error: {exc}", file=sys.stderr)
        return 1
    status = guards.enforce(
        [args.out, args.rejected],
        STAGE,
        args.category,
        counts["records_in"],
        counts["kept"],
        args.rejected,
        limit,
        key=f"reject_limits.{STAGE}",
        # the pipeline's own choices, not faults of the data: a prompt seen before, one not
        # among the sampled max_prompts
        exempt=(formats.DUPLICATE_PROMPT, formats.OVER_MAX_PROMPTS),
        empty_detail=_empty_sources(cat, args.basedir),
    )
    if status:
        return status
    reasons = Counter(pq.read_table(args.rejected, columns=["reason"]).column(0).to_pylist())
    summary = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())) or "none"
    print(
        f"tokenmill prepare [{args.category}]: {counts['source_records']} records, "
        f"{counts['records_in']} candidate prompts: {counts['kept']} kept, "
        f"{counts['rejected']} rejected ({summary})",
        file=sys.stderr,
    )
    return 0
