"""Data contracts between stages: one Arrow schema per stage output, one writer for all, and the
run records (typed, versioned JSON) that jobs write about themselves.

Every stage reads and writes through this module so that columns, types and writer
options stay the same everywhere. Files are written deterministically (fixed writer
options, no timestamps) and atomically (temporary file, then rename), so identical
inputs give byte-identical files and a killed job never leaves a half-written file.

The run records (the end of this module): a generate job's record, a hidden_states job's
record, every attempt of a GPU job, a deterministic failure, the statistics summary, a
hidden-state shard's manifest and the provenance, each a frozen dataclass with a schema
version. Readers get the dataclass or a one-line RecordError; none reads a key with a guess.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# Bump when a column is added, removed or changes meaning; it travels in every file's metadata.
SCHEMA_VERSION = "1"

# Parquet key/value metadata keys (bytes on disk, str here).
META_SCHEMA_VERSION = "tokenmill.schema_version"
META_STAGE = "tokenmill.stage"
META_TOKENIZER_FINGERPRINT = "tokenmill.tokenizer_fingerprint"
META_GENERATION_FINGERPRINT = "tokenmill.generation_fingerprint"
META_CATEGORY = "tokenmill.category"
META_SHARD = "tokenmill.shard"

# Counts: every stage's output files carry in = kept + rejected (count_metadata writes them).
META_RECORDS_IN = "tokenmill.records_in"
META_KEPT = "tokenmill.kept"
META_REJECTED = "tokenmill.rejected"
# merge names its kept and rejected counts so (its in is the same key).
META_RECORDS_KEPT = "tokenmill.records_kept"
META_RECORDS_REJECTED = "tokenmill.records_rejected"
COUNT_KEYS = (META_RECORDS_IN, META_KEPT, META_REJECTED)
MERGE_COUNT_KEYS = (META_RECORDS_IN, META_RECORDS_KEPT, META_RECORDS_REJECTED)

# prepare: source records read (before the per-category split)
META_SOURCE_RECORDS = "tokenmill.source_records"

# tokenize: sharding, the prompt-length limit and the tokens kept in the shard;
# generation.stop_tokens as configured (JSON) and resolved to ids with this tokenizer (JSON), so
# that the generate job needs no tokenizer (and imports neither transformers nor torch).
META_NUM_SHARDS = "tokenmill.num_shards"
# how rows were placed in shards: prefix | prompt_id (tokenization/shards.py)
META_SHARD_BY = "tokenmill.shard_by"
# shard_by: prefix: the digest of where every prompt of the category was placed
META_ASSIGNMENT = "tokenmill.assignment"
META_MAX_PROMPT_TOKENS = "tokenmill.max_prompt_tokens"
META_PROMPT_TOKENS = "tokenmill.prompt_tokens"
META_STOP_TOKENS = "tokenmill.stop_tokens"
META_STOP_TOKEN_IDS = "tokenmill.stop_token_ids"

# generate: the journal's compacted segments (generate/journal.py)
META_JOURNAL_RECORDS_IN = "tokenmill.journal_records_in"
META_JOURNAL_DUPLICATES = "tokenmill.journal_duplicates"

# merge: what the join accounted for beside the generated rows
META_NOT_GENERATED = "tokenmill.not_generated"
META_GENERATE_REJECTED = "tokenmill.generate_rejected"
META_TOKENIZED_ROWS = "tokenmill.tokenized_rows"
# merge: the reasons of the rejected records, JSON {reason: records} (its rejected file has a row
# per rejected turn; a record's reason is that of its first rejected turn)
META_RECORD_REASONS = "tokenmill.record_reasons"
# merge: turn rows (in = kept + rejected; a prompt shard's rows are one-turn records) and
# samples by kind (conversation: a prefix-exact conversation folded into one row)
META_TURNS_IN = "tokenmill.turns_in"
META_TURNS_KEPT = "tokenmill.turns_kept"
META_TURNS_REJECTED = "tokenmill.turns_rejected"
META_CONVERSATION_SAMPLES = "tokenmill.conversation_samples"
META_TURN_SAMPLES = "tokenmill.turn_samples"
TURN_COUNT_KEYS = (META_TURNS_IN, META_TURNS_KEPT, META_TURNS_REJECTED)

# token counts and the draft vocabulary (dataset/draft_vocab.py)
META_VOCAB_SIZE = "tokenmill.vocab_size"
META_LOSS_TOKENS = "tokenmill.loss_tokens"
META_ROWS = "tokenmill.rows"
META_COUNTS_SCOPE = "tokenmill.counts_scope"
META_SUMMED_FILES = "tokenmill.summed_files"
# only the first N positions of each row were counted (dataset.max_train_length); absent: all
META_COUNTS_MAX_LENGTH = "tokenmill.counts_max_length"

# prepare: results/prompts/{category}.parquet
# messages and tools are compact JSON in their source key order (see ordered_json):
# conversations are free-form (tool calls, arbitrary tool schemas), which Arrow structs
# represent badly.
PROMPTS = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),  # file:line or hub:name/split#row
        pa.field("messages", pa.large_string(), nullable=False),
        pa.field("tools", pa.large_string(), nullable=True),
    ]
)

# tokenize: results/tokenized/{category}/{shard}.parquet
TOKENIZED = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("num_prompt_tokens", pa.int32(), nullable=False),
    ]
)

# tokenize, for a category with `context: regenerated`: one row per conversation (the unit of
# sharding: its prompt_id hashes the whole conversation). prompt_ids is turn 1's prompt; the
# later prompts are built by the generate job (tokenization/conversations.py). The prompt rows'
# columns come first, so readers of TOKENIZED read these files too. Shard metadata
# tokenmill.context = "regenerated" marks them.
TOKENIZED_CONVERSATIONS = pa.schema(
    [
        *TOKENIZED,
        pa.field("num_turns", pa.int32(), nullable=False),
        # the template renders this conversation's earlier answers exactly as generated
        pa.field("prefix_exact", pa.bool_(), nullable=False),
        # prefix-exact: the ids between turn k's stop id and turn k+1's output (n-1 of them)
        pa.field("turn_segments", pa.list_(pa.list_(pa.int32())), nullable=True),
        # per turn: the dataset answer's ids when it has tool calls, else null
        pa.field("tool_call_ids", pa.list_(pa.list_(pa.int32())), nullable=False),
        pa.field("messages", pa.large_string(), nullable=False),  # as in PROMPTS
        pa.field("tools", pa.large_string(), nullable=True),
    ]
)
META_CONTEXT = "tokenmill.context"
CONTEXT_REGENERATED = "regenerated"  # the value of META_CONTEXT for conversation categories
META_PREFIX_EXACT = "tokenmill.prefix_exact_template"
META_THINK_END_ID = "tokenmill.think_end_id"

# generate: results/generated/{category}/{shard}.parquet
GENERATED = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("sample_key", pa.string(), nullable=False),
        pa.field("output_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("finish_type", pa.string(), nullable=True),  # stop | length | abort | null
        pa.field("finish_matched_id", pa.int64(), nullable=True),  # matched stop token id
        pa.field("finish_matched_str", pa.string(), nullable=True),  # matched stop string
        pa.field("prompt_tokens", pa.int32(), nullable=True),
        pa.field("completion_tokens", pa.int32(), nullable=True),
        pa.field("cached_tokens", pa.int32(), nullable=True),
        pa.field("latency_s", pa.float64(), nullable=True),
        pa.field("server", pa.string(), nullable=True),  # which server answered
        pa.field("weight_version", pa.string(), nullable=True),
    ]
)

# generate, context: regenerated: one row per generated turn, (prompt_id, turn) order.
# prompt_id is the conversation's; turn_prompt_ids the prompt the engine was sent for the turn
# (the model's own earlier answers in it); conversation_end the reason its turns stopped.
GENERATED_TURNS = pa.schema(
    [
        *GENERATED,
        pa.field("turn", pa.int32(), nullable=False),  # 0-based
        pa.field("turn_prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("prefix_exact", pa.bool_(), nullable=False),
        pa.field("conversation_end", pa.string(), nullable=False),
    ]
)

# merge: results/dataset/{category}/{shard}.parquet
DATASET = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("category", pa.string(), nullable=False),
        pa.field("sample_key", pa.string(), nullable=False),
        pa.field("input_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.list_(pa.int8()), nullable=False),
        pa.field("num_prompt_tokens", pa.int32(), nullable=False),
        pa.field("num_output_tokens", pa.int32(), nullable=False),
        pa.field("num_reasoning_tokens", pa.int32(), nullable=True),
        pa.field("num_answer_tokens", pa.int32(), nullable=True),
        pa.field("num_total_tokens", pa.int32(), nullable=False),
        pa.field("finish_type", pa.string(), nullable=True),
    ]
)

# Every stage: results/rejected/{stage}/... Nothing disappears silently.
REJECTED = pa.schema(
    [
        pa.field("stage", pa.string(), nullable=False),
        pa.field("category", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),  # a stable code, e.g. "no_user_turn"
        pa.field("detail", pa.string(), nullable=True),  # a human-readable explanation
        pa.field("source", pa.string(), nullable=True),  # file:line / row, where known
        pa.field("prompt_id", pa.string(), nullable=True),
        pa.field("record", pa.large_string(), nullable=True),  # the raw record, kept as is
    ]
)

# Fixed writer options: part of the byte-identity promise. Changing them changes every file.
WRITER_OPTIONS = dict(
    compression="zstd",
    compression_level=3,
    use_dictionary=True,
    write_statistics=True,
    version="2.6",
    data_page_version="1.0",
    store_schema=True,
)
# A row group of every file ends at ROW_GROUP_SIZE rows or with the row that brings it to
# ROW_GROUP_TOKENS tokens, whichever comes first (`row_group_ends`): a reader's and a writer's
# working set is one row group, so memory follows the bound, not the output length (1 << 20
# tokens is 4 MiB of int32 ids). A row's tokens are the lengths of its TOKEN_COLUMNS. Rows of
# under 128 tokens on average never reach the token bound: their files are cut at ROW_GROUP_SIZE
# rows, as before the bound existed.
ROW_GROUP_SIZE = 8192
ROW_GROUP_TOKENS = 1 << 20
# The token-list columns of the contracts (DATASET's loss_mask has input_ids' length; nested
# lists of TOKENIZED_CONVERSATIONS are not counted).
TOKEN_COLUMNS = ("prompt_ids", "output_ids", "turn_prompt_ids", "input_ids")


def row_tokens(table: pa.Table, columns: Iterable[str] | None = None) -> np.ndarray:
    """Tokens of each row (int64): the summed lengths of its `columns` (default: the
    TOKEN_COLUMNS it has; null lists count 0)."""
    names = [c for c in (TOKEN_COLUMNS if columns is None else columns) if c in table.schema.names]
    tokens = np.zeros(table.num_rows, dtype=np.int64)
    for name in names:
        lengths = pc.fill_null(pc.list_value_length(table.column(name)), 0)
        tokens += lengths.to_numpy().astype(np.int64)
    return tokens


def row_group_ends(
    tokens: np.ndarray, max_rows: int | None = None, max_tokens: int | None = None
) -> list[int]:
    """Where row groups of rows with these token counts end (exclusive row indices, the last
    one len(tokens)): a group ends at `max_rows` rows (ROW_GROUP_SIZE) or with the row that
    brings it to `max_tokens` tokens (ROW_GROUP_TOKENS), whichever comes first. A function of
    the rows alone, so every writer and reader that cuts the same rows cuts them the same way."""
    max_rows = ROW_GROUP_SIZE if max_rows is None else max_rows
    max_tokens = ROW_GROUP_TOKENS if max_tokens is None else max_tokens
    cum = np.cumsum(np.asarray(tokens, dtype=np.int64))
    ends, start, base = [], 0, 0
    n = len(cum)
    while start < n:
        over = int(np.searchsorted(cum, base + max_tokens, side="left"))
        end = min(start + max_rows, over + 1, n)
        ends.append(end)
        base, start = int(cum[end - 1]), end
    return ends


class RowGroupBuffer:
    """Cuts a stream of tables into row groups by `row_group_ends` (a rule that depends only on
    the rows, not on how they arrive). `token_column` names the column whose list lengths are a
    row's tokens (None: rows only). `sink` gets one table per row group (the generated shard, a
    compacted journal file)."""

    def __init__(
        self,
        sink: Callable[[pa.Table], None],
        token_column: str | None,
        max_rows: int | None = None,
        max_tokens: int | None = None,
    ):
        self.sink, self.column = sink, token_column
        self.max_rows = ROW_GROUP_SIZE if max_rows is None else max_rows
        self.max_tokens = ROW_GROUP_TOKENS if max_tokens is None else max_tokens
        self._parts: list[pa.Table] = []
        self._lengths: list[np.ndarray] = []
        self._rows = 0
        self._tokens = 0

    def add(self, table: pa.Table) -> None:
        if table.num_rows == 0:
            return
        columns = [] if self.column is None else [self.column]
        lengths = row_tokens(table, columns)
        self._parts.append(table)
        self._lengths.append(lengths)
        self._rows += table.num_rows
        self._tokens += int(lengths.sum())
        while self._rows >= self.max_rows or self._tokens >= self.max_tokens:
            self._flush_one()

    def _flush_one(self) -> None:
        table = pa.concat_tables(self._parts)
        lengths = np.concatenate(self._lengths)
        cut = row_group_ends(lengths, self.max_rows, self.max_tokens)[0]
        self.sink(table.slice(0, cut))
        rest = table.slice(cut)
        self._parts = [rest] if rest.num_rows else []
        self._lengths = [lengths[cut:]] if rest.num_rows else []
        self._rows = rest.num_rows
        self._tokens = int(lengths[cut:].sum())

    def finish(self) -> None:
        if self._rows:
            self.sink(pa.concat_tables(self._parts))
        self._parts, self._lengths, self._rows, self._tokens = [], [], 0, 0


def canonical_json(value) -> str:
    """JSON with sorted keys and no whitespace: the same value always gives the same text."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 hex of a file, read in 1 MiB blocks (tokenizer files, inputs, outputs)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def ordered_json(value) -> str:
    """Compact JSON that keeps key order. Messages and tools are stored this way: chat
    templates render tools with `tojson`, which keeps key order, so sorting the keys would
    change the prompt the model sees (prompt_id still hashes the canonical form)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def with_metadata(schema: pa.Schema, stage: str, extra: Mapping[str, str] | None = None):
    meta = {META_SCHEMA_VERSION: SCHEMA_VERSION, META_STAGE: stage}
    meta.update(extra or {})
    return schema.with_metadata({k.encode(): str(v).encode() for k, v in sorted(meta.items())})


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The tokenmill.* entries of a file's key-value metadata: those the schema carried when
    the writer opened plus those it added at close (ParquetWriter.add_metadata)."""
    meta = pq.read_metadata(path).metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items() if k.startswith(b"tokenmill.")}


def is_regenerated(path: str | os.PathLike) -> bool:
    """Whether a file belongs to a `context: regenerated` (multi-turn) category."""
    return read_metadata(path).get(META_CONTEXT) == CONTEXT_REGENERATED


def atomic_path(path: str | os.PathLike):
    """A temporary path next to `path` (same filesystem, so the final rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    # mkstemp creates 0600; outputs on a shared cluster filesystem get the usual umask mode.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    return Path(tmp)


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    """`obj` as indented JSON with sorted keys (the same object, the same bytes) under `path`,
    complete or not at all (atomic_path, then a rename)."""
    tmp = atomic_path(path)
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


def write_table(
    table: pa.Table,
    path: str | os.PathLike,
    schema: pa.Schema,
    stage: str,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write `table` (cast to `schema`) deterministically and atomically."""
    writer = ParquetWriter(path, schema, stage, metadata)
    with writer:
        writer.write(table)


class ParquetWriter:
    """Streaming, deterministic, atomic Parquet writer for one contract.

    Batches are written as they come (bounded memory); the file appears under its final
    name only when the writer is closed without an error.
    """

    def __init__(self, path, schema: pa.Schema, stage: str, metadata=None):
        self.path = Path(path)
        self.schema = with_metadata(schema, stage, metadata)
        self._tmp = atomic_path(self.path)
        self._writer = pq.ParquetWriter(self._tmp, self.schema, **WRITER_OPTIONS)
        self.rows = 0

    def write(self, data: pa.Table | pa.RecordBatch, one_row_group: bool = False) -> None:
        """Write `data` cut into row groups by row_group_ends, or as one row group
        (`one_row_group`: a caller that bounds its batches itself, such as merge, whose batches
        end with a whole conversation)."""
        if isinstance(data, pa.RecordBatch):
            data = pa.Table.from_batches([data])
        data = data.select(self.schema.names).cast(self.schema.remove_metadata())
        data = data.replace_schema_metadata(self.schema.metadata)
        if data.num_rows == 0:  # an empty row group, as pyarrow writes one
            self._writer.write_table(data, row_group_size=ROW_GROUP_SIZE)
        start = 0
        ends = (
            [data.num_rows] if one_row_group and data.num_rows else row_group_ends(row_tokens(data))
        )
        for end in ends:  # one row group each
            self._writer.write_table(data.slice(start, end - start), row_group_size=end - start)
            start = end
        self.rows += data.num_rows

    def write_schema_if_empty(self) -> None:
        """Nothing written yet: write one empty row group, so an empty output is still a file
        with its schema (what write_table of no rows gives)."""
        if self.rows == 0:
            self.write(self.schema.empty_table())

    def add_metadata(self, metadata: Mapping[str, object]) -> None:
        """Key-value metadata known only after the last batch (counts); written at close."""
        self._writer.add_key_value_metadata({k: str(v) for k, v in metadata.items()})

    def close(self) -> None:
        self._writer.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._writer.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


def empty_table(schema: pa.Schema) -> pa.Table:
    return schema.empty_table()


def rejected_row(
    stage: str,
    category: str,
    reason: str,
    detail: str | None = None,
    source: str | None = None,
    prompt_id: str | None = None,
    record=None,
) -> dict:
    """The one constructor of a REJECTED row. `record`: the raw record as text (kept as is), or
    any JSON value (a dict of the sample's fields), stored as canonical_json."""
    if not reason or not isinstance(reason, str):
        raise ValueError(f"a rejected row needs a reason code, got {reason!r}")
    if record is not None and not isinstance(record, str):
        record = canonical_json(record)
    return {
        "stage": stage,
        "category": category,
        "reason": reason,
        "detail": detail,
        "source": source,
        "prompt_id": prompt_id,
        "record": record,
    }


def rejected_table(rows: list[dict]) -> pa.Table:
    """Build a REJECTED table from rejected_row dicts (missing optional keys become null)."""
    cols = {name: [r.get(name) for r in rows] for name in REJECTED.names}
    return pa.table(cols, schema=REJECTED)


class ConservationError(RuntimeError):
    """The counts of a stage do not add up (in != kept + rejected)."""


def check_conservation(what: str, n_in: int, kept: int, rejected: int) -> None:
    """Raise ConservationError naming the counts unless n_in = kept + rejected."""
    if n_in != kept + rejected:
        raise ConservationError(
            f"{what}: counts do not add up: in={n_in} != kept={kept} + rejected={rejected} "
            f"(= {kept + rejected})"
        )


def count_metadata(
    n_in: int, kept: int, rejected: int, *, what: str = "records", keys=COUNT_KEYS
) -> dict[str, str]:
    """The in/kept/rejected file metadata (`keys`: COUNT_KEYS, or MERGE_COUNT_KEYS for merge),
    checked by check_conservation first: a file never carries counts that do not add up."""
    check_conservation(what, n_in, kept, rejected)
    return {k: str(int(v)) for k, v in zip(keys, (n_in, kept, rejected), strict=True)}


def list_arrays(col, dtype="<i4") -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets from 0 as int64) of a list column (Array or ChunkedArray, sliced or
    not; a null row is an empty one): row i owns values[offsets[i]:offsets[i + 1]]. Values
    are cast to `dtype` (little-endian int32 by default: the bytes sample keys hash), or kept
    in their own type with dtype=None."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count:
        import pyarrow.compute as pc

        arr = pc.fill_null(arr, pa.scalar([], type=arr.type))
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    start, end = (int(offsets[0]), int(offsets[-1])) if len(offsets) else (0, 0)
    values = arr.values.slice(start, end - start).to_numpy(zero_copy_only=False)
    if dtype is not None:
        values = values.astype(dtype, copy=False)
    return values, offsets - start if start else offsets


# =============================================================================================
# Run records: what jobs say about themselves, as typed, versioned JSON.
#
# One frozen dataclass per record (and per nested part), read and written by one generic
# mapping below: a field is the key of the same name (or `field(metadata={"key": ...})`),
# typed by its annotation. A reader refuses, in one line naming the file and the key, a record
# of an unknown schema version, a missing or unknown key, or a value of the wrong type: no
# reader guesses at a spelling or fills a default the writer did not write. `dict` and `Any`
# fields are opaque JSON that tokenmill passes on but never reads (what an engine reports).


class RecordError(ValueError):
    """A run record that cannot be read as its type; str() is one line."""


JSON = Any  # opaque JSON: passed on (provenance, the job's own log), never read by tokenmill


def _key(f) -> str:
    return f.metadata.get("key", f.name)


@dataclass(frozen=True)
class Record:
    """Base of the run records. A top-level record has a SCHEMA ("tokenmill.<kind>/<version>")
    written as its "schema" key; nested parts have none."""

    SCHEMA: ClassVar[str | None] = None

    def to_json(self) -> dict:
        """The record as JSON values; an optional field (default None) left None is left
        out, as a reader takes its absence for None."""
        out = {"schema": self.SCHEMA} if self.SCHEMA else {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            out[_key(f)] = _dump(value)
        return out

    @classmethod
    def from_json(cls, obj, where: str | None = None):
        return _load(cls, obj, where or cls.__name__)

    @classmethod
    def read(cls, path):
        """The record in the file at `path`; RecordError (one line) when it cannot be."""
        try:
            obj = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RecordError(f"{path}: cannot read it as {cls.__name__}: {exc}") from None
        return cls.from_json(obj, str(path))

    def write(self, path) -> None:
        write_json_atomic(path, self.to_json())

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)


def _dump(value):
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, Mapping):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_dump(v) for v in value]
    return value


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _load(tp, value, where: str):
    """`value` (parsed JSON) as type `tp`; RecordError naming `where` otherwise."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _load(option, value, where)
            except RecordError as exc:
                errors.append(str(exc))
        raise RecordError(errors[0] if len(errors) == 1 else f"{where}: {value!r} fits no type")
    if origin is list or origin is tuple:
        if not isinstance(value, list):
            raise RecordError(f"{where}: expected a list, got {_what(value)}")
        (item,) = typing.get_args(tp)[:1]
        items = [_load(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise RecordError(f"{where}: expected an object, got {_what(value)}")
        if tp is dict:
            return value
        _, item = typing.get_args(tp)
        return {k: _load(item, v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Record):
        return _load_record(tp, value, where)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise RecordError(f"{where}: expected {tp.__name__}, got {_what(value)}")


def _load_record(cls, obj, where: str):
    if not isinstance(obj, dict):
        raise RecordError(f"{where}: expected a {cls.__name__} object, got {_what(obj)}")
    obj = dict(obj)
    if cls.SCHEMA:
        have = obj.pop("schema", None)
        if have != cls.SCHEMA:
            raise RecordError(
                f"{where}: schema {have!r}, this tokenmill reads {cls.SCHEMA!r} (a record "
                "written by another tokenmill version: rerun the job that wrote it)"
            )
    hints = _hints(cls)
    values = {}
    for f in fields(cls):
        key = _key(f)
        if key in obj:
            values[f.name] = _load(hints[f.name], obj.pop(key), f"{where}.{key}")
        elif f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
            continue
        else:
            raise RecordError(f"{where}: missing key '{key}' ({cls.__name__})")
    if obj:
        raise RecordError(f"{where}: unknown key '{sorted(obj)[0]}' ({cls.__name__})")
    return cls(**values)


def _what(value) -> str:
    return "null" if value is None else type(value).__name__


# ------------------------------------------------------------------------- GPU-job records

ATTEMPT_STATUSES = ("running", "ok", "failed", "interrupted", "killed", "refused")


@dataclass(frozen=True)
class SlurmJob(Record):
    """The SLURM job an attempt ran in (every field null, restart_count 0, outside SLURM)."""

    job_id: str | None
    nodelist: str | None
    restart_count: int  # SLURM_RESTART_COUNT: the requeues of this job id before this run
    cuda_visible_devices: str | None

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> SlurmJob:
        restarts = env.get("SLURM_RESTART_COUNT", "0")
        return cls(
            job_id=env.get("SLURM_JOB_ID"),
            nodelist=env.get("SLURM_JOB_NODELIST"),
            restart_count=int(restarts) if restarts.isdigit() else 0,
            cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        )


@dataclass(frozen=True)
class Held(Record):
    """What a GPU job held, for its cost (jobs/harness.py held): GPUs per node, nodes, GPUs in
    all (None: none of its own, as with external servers), the engine's version, and where the
    numbers came from."""

    gpus_per_node: int | None
    nodes: int | None
    gpus: int | None
    engine_version: str | list[str] | None
    source: str


@dataclass(frozen=True)
class Attempt(Record):
    """One attempt of a GPU job: a line of {journal}/_jobs/{stage}/{category}/{shard}/
    attempts.jsonl (the last line of an attempt id wins). `wall_s` runs from the process's
    start to its end (a killed attempt: to its last heartbeat); GPU-seconds = wall_s x gpus."""

    SCHEMA: ClassVar[str] = "tokenmill.attempt/1"
    stage: str
    category: str
    shard: str
    id: str  # host:pid:start ns, unique per attempt
    host: str
    pid: int
    slurm: SlurmJob
    started: str  # ISO 8601 UTC
    ended: str | None  # None while it runs
    status: str  # ATTEMPT_STATUSES
    cause: str | None  # one line: why it failed, was interrupted or refused
    deterministic: bool  # the same config fails the same way: a retry is refused
    gpus: int | None  # Held.gpus
    wall_s: float
    log: str  # the job's log (every attempt appended)

    @property
    def gpu_s(self) -> float:
        return self.wall_s * (self.gpus or 0)


@dataclass(frozen=True)
class FailureRecord(Record):
    """A deterministic failure of a GPU job ({journal}/_jobs/{stage}/{category}/{shard}/
    failure.json): the next attempt with the same `identity` (the config and input it was seen
    with) is refused before any engine starts; any change of them, or deleting the file, lets
    it run."""

    SCHEMA: ClassVar[str] = "tokenmill.failure/1"
    stage: str
    category: str
    shard: str
    identity: dict  # opaque: compared whole
    message: str
    time: str
    attempt: str  # Attempt.id of the attempt that failed
    slurm_job_id: str | None


# ----------------------------------------------------------------- the generate job's record


@dataclass(frozen=True)
class GenerateCounts(Record):
    """A generate job's counts. Prompt shards: prompts .. output_tokens; conversation shards
    (context: regenerated): conversations .. kept_turns; both: the engine's."""

    requested: int = 0
    retries: int = 0
    restarts: int = 0
    generated: int = 0
    engine_rejected: int = 0
    engine_errors: int = 0
    from_journal: int = 0
    rejected: int = 0
    prompts: int | None = None
    unique_samples: int | None = None
    to_generate: int | None = None
    kept: int | None = None
    output_tokens: int | None = None
    conversations: int | None = None
    to_generate_now: int | None = None
    prefix_exact_conversations: int | None = None
    turns_total: int | None = None
    turns_answered: int | None = None
    turns_generated_ok: int | None = None
    turns_from_journal: int | None = None
    conversation_ends: dict[str, int] | None = None
    kept_turns: int | None = None


@dataclass(frozen=True)
class GenerateTiming(Record):
    """Seconds: process start to the first request (startup_s: imports, keys, journal replay,
    engine start), the generation window (first request to last answer), writing the output
    and compacting the journal, and all of it (total_s)."""

    startup_s: float
    generation_s: float
    write_s: float
    total_s: float
    imports_s: float
    replay_s: float
    engine_start_s: float | None
    tokenizer_s: float | None = None  # a conversation shard's tokenizer, in the start-up


@dataclass(frozen=True)
class Rates(Record):
    requests_per_s: float | None
    output_tokens_per_s: float | None


@dataclass(frozen=True)
class JournalUse(Record):
    """What the job read from and did to its journal (generate/journal.py)."""

    dir: str
    compaction: dict | None  # opaque: Compaction.commit's figures, or {"error": ...}
    file: str | None = None  # this job's attempt file (None: nothing was sent)
    files_read: list[str] | None = None  # the journal files it read
    bytes_read: int | None = None
    lines_read: int | None = None
    torn_lines: int | None = None
    from_stale: int | None = None
    migration: dict | None = None  # opaque: ensure_layout's figures when the shard count changed


@dataclass(frozen=True)
class VocabCheck(Record):
    vocab_size: int | None
    source: str


@dataclass(frozen=True)
class GenerateJobRecord(Record):
    """generated/{category}/{shard}.meta.json: what one generate job did, written once its
    shard is. `attempts`: every attempt since the shard's previous record (failed, interrupted
    and killed ones too), this one last; their GPU-seconds are the shard's cost."""

    SCHEMA: ClassVar[str] = "tokenmill.generate_job/1"
    category: str
    shard: str
    generation_fingerprint: str
    mode: str
    engine: str
    context: str | None  # "regenerated" for a conversation shard
    start_time: str
    end_time: str
    host: str
    pid: int
    slurm: SlurmJob
    counts: GenerateCounts
    timing: GenerateTiming
    rates: Rates | None
    held: Held
    attempts: list[Attempt]
    journal: JournalUse
    engine_started: bool
    stop_token_ids_from: str | None = None
    vocab_check: VocabCheck | None = None
    fingerprint_change: dict | None = None  # opaque: job.fingerprint_change
    server_info: JSON = None  # opaque: what the engine reported (secrets redacted)
    model_info: JSON = None
    model_check: str | dict[str, str] | None = None  # external: per URL
    seeds_honoured: bool | None = None
    engine_argv: list[str] | None = None
    engine_url: str | None = None
    engine_starts: int | None = None
    engine_urls: list[str] | None = None

    @property
    def gpu_s(self) -> float:
        return sum(a.gpu_s for a in self.attempts)


# ------------------------------------------------------------ the hidden_states job's record


@dataclass(frozen=True)
class HiddenStatesJobRecord(Record):
    """hidden_states/{category}/{shard}.job.json: what one hidden_states job did."""

    SCHEMA: ClassVar[str] = "tokenmill.hidden_states_job/1"
    category: str
    shard: str
    backend: str
    start_time: str
    end_time: str
    host: str
    pid: int
    slurm: SlurmJob
    rows: int
    rows_computed: int
    tokens_computed: int
    compute_s: float
    total_s: float
    held: Held
    attempts: list[Attempt]

    @property
    def gpu_s(self) -> float:
        return sum(a.gpu_s for a in self.attempts)


@dataclass(frozen=True)
class ManifestFile(Record):
    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class HiddenStatesManifest(Record):
    """hidden_states/{category}/{shard}/manifest.json, written last: the shard folder's every
    file with its size and sha256 (hidden_states/job.py)."""

    SCHEMA: ClassVar[str] = "tokenmill.hidden_states/1"
    category: str
    shard: str
    rows: int
    tokens: int
    rows_key: str
    fingerprint: dict  # opaque: the stage fingerprint, compared whole
    layouts: list[str]
    layer_ids: list[int]
    dtype: str
    bytes: int
    files: list[ManifestFile]


@dataclass(frozen=True)
class TrainingShard(Record):
    """One shard of the training folder: its rows are the folder's rows first..first+rows-1."""

    category: str
    shard: str
    first: int
    rows: int
    manifest_sha256: str  # of the shard's manifest.json the links were made from


@dataclass(frozen=True)
class HiddenStatesTrainingManifest(Record):
    """hidden_states/all/manifest.json, written last: the run's one training folder per layout
    (hidden_states/training.py), or hidden_states/C/all/manifest.json, category C's. Its row
    files are relative links into the shard folders (shards in declared order); rows_files are
    the speculators rows folder's own files."""

    SCHEMA: ClassVar[str] = "tokenmill.hidden_states_training/1"
    rows: int
    tokens: int
    layouts: list[str]
    layer_ids: list[int]
    dtype: str
    shards: list[TrainingShard]
    rows_files: list[ManifestFile]
    category: str | None = None  # the category whose folder this is; None: the run's


# ---------------------------------------------------------------------- the statistics


@dataclass(frozen=True)
class StageCounts(Record):
    """in / kept / rejected of one stage (in = kept + rejected), and the reasons."""

    records_in: int | None = field(metadata={"key": "in"})
    kept: int
    rejected: int
    reasons: dict[str, int]
    in_source: str | None = None  # "metadata" or "inferred" (categories; null overall)
    not_generated: int | None = None  # merge


@dataclass(frozen=True)
class Distribution(Record):
    count: int
    sum: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: int | None


@dataclass(frozen=True)
class ReasoningCounts(Record):
    think_end_token: str | None
    with_think_end: int | None
    unterminated: int | None
    without_reasoning: int | None


@dataclass(frozen=True)
class CacheCeiling(Record):
    """Of the prompt tokens sent (every sample's prompt; a conversation's turn prompts), the
    share a cache holding every prefix could serve (prefix_reuse.compact_ceiling): over the
    category (shards that keep prefix siblings together reach it) and over its shards as
    assigned (one engine each), per token (to 16 tokens) and in whole blocks of `block`."""

    block: int
    prompt_tokens: int
    category_per_token: float | None
    category_per_block: float | None
    shards_per_token: float | None
    shards_per_block: float | None


@dataclass(frozen=True)
class PrefixCache(Record):
    samples: int
    samples_reporting: int
    cached_tokens: int | None
    prompt_tokens: int | None
    hit_rate: float | None
    ceiling: CacheCeiling | None = None  # absent: no prompts sent yet


@dataclass(frozen=True)
class GenerationCost(Record):
    """Time and GPU-hours of a category's generate jobs, every attempt counted (failed,
    interrupted and killed ones too); output tokens per second over the shards whose samples
    were all generated by the job that wrote them (timed_shards)."""

    wall_time_s: float
    generation_time_s: float
    output_tokens: int
    shards: int
    timed_shards: int
    attempts: int
    failed_attempts: int
    output_tokens_per_s: float | None
    gpus: int | str | None  # per job; "mixed"; None: no GPUs of the run's own
    gpu_hours: float | None
    output_tokens_per_gpu_hour: float | None


@dataclass(frozen=True)
class CoverageRow(Record):
    n: int
    ids: int
    capped: bool
    share: float
    draft: bool | None = None
    mapping: bool | None = None


@dataclass(frozen=True)
class TokenCoverage(Record):
    loss_tokens: int
    distinct_ids: int
    vocab_size: int
    top_n: list[CoverageRow]
    ids_for_share: dict[str, int | None]


@dataclass(frozen=True)
class ConversationCounts(Record):
    conversations: int
    prefix_exact: int
    turns_in_data: int
    turns_answered: int
    turns_generated: int
    turns_not_asked: int
    ends: dict[str, int]
    turns_kept: int
    turns_rejected: int
    turn_reasons: dict[str, int]
    samples: int
    conversation_samples: int
    turn_samples: int


@dataclass(frozen=True)
class ScopeStats(Record):
    """The statistics of one category, or of all of them (overall)."""

    stages: dict[str, StageCounts]
    finish_types: dict[str, int]
    lengths: dict[str, Distribution]
    reasoning: ReasoningCounts
    prefix_cache: PrefixCache
    generation: GenerationCost
    token_coverage: TokenCoverage | None = None
    conversations: ConversationCounts | None = None


@dataclass(frozen=True)
class Conservation(Record):
    ok: bool
    problems: list[str]


@dataclass(frozen=True)
class StatsSummary(Record):
    """stats/summary.json (dataset/stats.py)."""

    SCHEMA: ClassVar[str] = "tokenmill.stats/2"
    categories: dict[str, ScopeStats]
    overall: ScopeStats
    conservation: Conservation


# ------------------------------------------------------------- a category's rejection verdict


@dataclass(frozen=True)
class StageVerdict(Record):
    """One stage's share over a category's shards, and the limit it was judged by."""

    judged: int
    rejected: int
    max_fraction: float
    min_count: int


@dataclass(frozen=True)
class CategoryVerdict(Record):
    """rejected/verdict/{category}.json (dataset/verdict.py): the category passed its per-shard
    stages' limits on its whole share (a shard alone is judged only on what chance cannot
    explain, guards.shard_over_limit)."""

    SCHEMA: ClassVar[str] = "tokenmill.verdict/1"
    category: str
    shards: list[str]
    generate: StageVerdict
    merge: StageVerdict


# ------------------------------------------------------------------------ the provenance


@dataclass(frozen=True)
class FileDigest(Record):
    """A file as provenance records it: the path as given, its size and sha256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class OutputFile(Record):
    """An output of the run: path relative to the results folder (or the dataset folder, in
    that folder's own manifest); rows for Parquet files."""

    path: str
    size: int
    sha256: str
    rows: int | None = None


@dataclass(frozen=True)
class InputFile(Record):
    kind: str  # "file"
    path: str  # as the config writes it (relative to the workflow, or absolute)
    size: int
    sha256: str


@dataclass(frozen=True)
class HubInput(Record):
    kind: str  # "hub"
    name: str
    config: str | None
    split: str
    revision: str | None


@dataclass(frozen=True)
class ConfigProvenance(Record):
    resolved: dict  # the resolved config, secrets redacted (reproduce-config reads it whole)
    sha256: str  # of its canonical JSON before redaction
    files: list[FileDigest]  # the --configfiles


@dataclass(frozen=True)
class TokenizerProvenance(Record):
    path: str
    revision: str | None
    trust_remote_code: bool
    chat_template: str | None
    chat_template_kwargs: JSON
    fingerprints: list[str]  # of the tokenized shards
    files: list[FileDigest]  # a local tokenizer folder's files and the chat template file


@dataclass(frozen=True)
class ModelProvenance(Record):
    id: str
    revision: str | None
    engine: str


@dataclass(frozen=True)
class GenerationProvenance(Record):
    fingerprint: str
    sampling: dict
    stop_tokens: JSON
    seed_policy: str
    mode: str
    api_key_env: str | None  # the variable's NAME, never its value


@dataclass(frozen=True)
class EngineProvenance(Record):
    category: str
    shard: str
    meta: dict  # the generate job's record (GenerateJobRecord), redacted again


@dataclass(frozen=True)
class JobProvenance(Record):
    category: str
    shard: str
    slurm_job_id: str | None
    nodelist: str | None
    host: str
    start: str
    end: str
    attempts: int
    gpu_hours: float
    stage: str = "generate"  # or "hidden_states"


@dataclass(frozen=True)
class RunTimes(Record):
    start: str | None  # the first attempt's start
    end: str | None  # the last job record's end


@dataclass(frozen=True)
class WorkflowProvenance(Record):
    git_commit: str | None  # null when the workflow folder is not a git checkout
    dirty: bool | None


@dataclass(frozen=True)
class HiddenStatesProvenance(Record):
    rows: int
    tokens: int
    bytes: int
    layer_ids: list[int]
    dtype: str
    layouts: list[str]
    fingerprint: dict


@dataclass(frozen=True)
class Provenance(Record):
    """provenance.json (provenance/manifest.py, whose docstring says what each key holds), and
    the dataset folder's own copy (scope "dataset": outputs relative to that folder,
    run_outputs the run's)."""

    SCHEMA: ClassVar[str] = "tokenmill.provenance/1"
    results_dir: str
    config: ConfigProvenance
    inputs: dict[str, list[InputFile | HubInput]]
    prepare_metadata: dict[str, dict[str, str]]
    tokenizer: TokenizerProvenance
    model: ModelProvenance
    generation: GenerationProvenance
    engine: list[EngineProvenance]
    jobs: list[JobProvenance]
    times: RunTimes
    software: JSON  # python, platform, package versions: for people, never compared
    workflow: WorkflowProvenance
    outputs: list[OutputFile]
    draft_vocab: dict | None  # vocab_mapping.json as written (null: no draft vocabulary)
    token_counts: dict[str, int]  # loss tokens of each counts file
    generated_samples: dict[str, dict[str, str]]  # {path: {prompt_id: output digest}}
    hidden_states: dict[str, HiddenStatesProvenance] | None = None
    scope: str | None = None  # "dataset" in the dataset folder's own manifest
    run_outputs: list[OutputFile] | None = None
