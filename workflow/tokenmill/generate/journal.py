"""Crash-safe journal of completed generations (outside Snakemake's outputs), kept per shard.

Layout of {journal_dir}/{category}/:

    journal.json                      the layout: {"format": 2, "num_shards": N, "migrations"}
    {shard}.{host}.{pid}.{ns}.jsonl   one per job attempt, append-only while the job runs
    {shard}.migrated-{ns}.jsonl       records moved here when the shard count changed
    {shard}.parquet                   the shard's compacted records (rewritten by compaction)
    {shard}.stale.parquet             records the shard no longer asks for (older generation
                                      settings, edited prompts): read only when a sample is
                                      missing everywhere else; safe to delete to reclaim space
    generation-{shard}.json           the generation fingerprint and its material (keys.py) the
                                      shard's last job ran with: says what a change invalidates
    .lock                             flock, held while the layout or a shard's files change

A job reads only its own shard's files (`ShardJournal.open`), so replay costs what the shard
holds, not what the category holds. When the shard count changes, the first job to notice
moves every record to the shard of its prompt_id once (`ensure_layout`) and writes the new
count into journal.json; every other job then finds its records in its own files.

JSONL lines are `JSON<TAB>CRC32HEX<LF>` where the JSON starts with `{"key":"<32 hex>"`; a reader
skips lines of unwanted keys by looking at that fixed slice before paying for a JSON parse. A
line without its newline or with a bad checksum (a write torn by SIGKILL or a full disk) is
dropped. Every record is handed to the kernel with one write() (it survives SIGKILL of the
process); fsync runs periodically and on close (it survives a node crash up to the last fsync).

Compaction (`Compaction`, once the shard's output is written): the shard's records go into a
new {shard}.parquet written in output order, unwanted ones into {shard}.stale.parquet; both are
written under hidden temporary names and fsynced, then renamed over the old files, and only then
are the JSONL files deleted. A kill at any point leaves either the old files or a durable
superset of them: a record may exist twice for a while (readers keep one per key), never zero
times. Migration follows the same order (write, fsync, rename, then delete).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import contracts
from tokenmill.tokenization import shards

log = logging.getLogger(__name__)

_PREFIX = b'{"key":"'
_KEY_LEN = 32
_KEY_END = len(_PREFIX) + _KEY_LEN
_OK_MARK = b'","status":"ok"'  # right after the key in every record the client writes
_PID_MARK = b'"prompt_id":"'

MANIFEST = "journal.json"
LAYOUT_FORMAT = 2
LOCK = ".lock"

# A row group of a compacted file (and of the generated shard) ends as contracts.row_group_ends
# says (contracts.RowGroupBuffer): a job's memory per buffered row group is bounded by
# contracts.ROW_GROUP_TOKENS whatever the output length.

# Records decoded from JSONL at once (Python lists of ints are ~36 bytes a token).
DECODE_BATCH = 256

META_RECORDS_IN, META_DUPLICATES = (
    contracts.META_JOURNAL_RECORDS_IN,
    contracts.META_JOURNAL_DUPLICATES,
)

# A compacted file: the record's key, status and prompt_id, the GENERATED columns it carries,
# the rejection message, and every other field of the record as JSON (nothing is lost).
_GEN_FIELDS = [f for f in contracts.GENERATED if f.name not in ("prompt_id", "sample_key")]
JOURNAL = pa.schema(
    [
        pa.field("key", pa.string(), nullable=False),
        pa.field("status", pa.string()),
        pa.field("prompt_id", pa.string()),
        pa.field("message", pa.large_string()),
        *[f.with_nullable(True) for f in _GEN_FIELDS],
        pa.field("extra", pa.large_string()),  # JSON object of the record's other fields
    ]
)
_TYPED = [n for n in JOURNAL.names if n != "extra"]
_TYPED_SET = set(_TYPED)


class JournalError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# Lines and records


def encode_line(record: dict) -> bytes:
    """One journal line; `record["key"]` must come first (it does: we build the dict so)."""
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
    return body + b"\t" + f"{zlib.crc32(body):08x}".encode() + b"\n"


def _intact_body(line: bytes) -> bytes | None:
    """The JSON body of a complete line whose checksum matches, else None (no JSON parse)."""
    if not line.endswith(b"\n"):
        return None
    body, sep, crc = line[:-1].rpartition(b"\t")
    if not sep or len(crc) != 8:
        return None
    try:
        return body if int(crc, 16) == zlib.crc32(body) else None
    except ValueError:
        return None


def decode_line(line: bytes) -> dict | None:
    """The record of a complete, intact line, else None."""
    body = _intact_body(line)
    if body is None:
        return None
    try:
        rec = json.loads(body)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "key" in rec else None


def _line_key(line: bytes) -> str | None:
    if not line.startswith(_PREFIX) or len(line) < _KEY_END:
        return None
    return line[len(_PREFIX) : _KEY_END].decode("ascii", "replace")


def _line_prompt_id(line: bytes, body: bytes) -> str | None:
    """prompt_id of an intact line: a slice for the client's records, a JSON parse otherwise."""
    at = line.find(_PID_MARK, _KEY_END, _KEY_END + 64)
    if at >= 0:
        start = at + len(_PID_MARK)
        end = line.find(b'"', start)
        value = line[start:end]
        if end > 0 and b"\\" not in value:
            return value.decode()
    rec = json.loads(body)
    pid = rec.get("prompt_id")
    return pid if isinstance(pid, str) else None


def records_to_table(records: list[dict]) -> pa.Table:
    """Records -> a JOURNAL table (GENERATED fields typed, the rest as JSON in `extra`)."""
    cols: dict[str, list] = {name: [] for name in JOURNAL.names}
    for rec in records:
        for name in _TYPED:
            cols[name].append(rec.get(name))
        extra = {k: v for k, v in rec.items() if k not in _TYPED_SET}
        cols["extra"].append(json.dumps(extra, ensure_ascii=False) if extra else None)
    return pa.table(cols, schema=JOURNAL)


def table_to_records(table: pa.Table) -> list[dict]:
    """A JOURNAL table -> records (null fields left out, `extra` merged back)."""
    out = []
    for row in table.to_pylist():
        extra = row.pop("extra", None)
        rec = {k: v for k, v in row.items() if v is not None}
        if extra:
            rec.update(json.loads(extra))
        out.append(rec)
    return out


def _ok_mask(table: pa.Table) -> np.ndarray:
    return pc.fill_null(pc.equal(table.column("status"), "ok"), False).to_numpy(
        zero_copy_only=False
    )


# ---------------------------------------------------------------------------------------------
# Writing


class JournalWriter:
    """Append-only writer for one job attempt."""

    def __init__(self, journal_dir, category: str, shard: str, fsync_interval_s: float = 2.0):
        d = Path(journal_dir) / category
        d.mkdir(parents=True, exist_ok=True)
        host = socket.gethostname().split(".")[0].replace("/", "_") or "host"
        self.path = d / f"{shard}.{host}.{os.getpid()}.{time.time_ns()}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._fsync_interval = fsync_interval_s
        self._last_sync = time.monotonic()
        self._dirty = False
        self.records = 0
        self.size = 0

    def append(self, record: dict) -> tuple[int, int]:
        """Journal one record; returns (offset, length) of its line in the file."""
        if "key" not in record or next(iter(record)) != "key":
            record = {"key": record["key"], **{k: v for k, v in record.items() if k != "key"}}
        line = encode_line(record)
        offset = self.size
        # One write() per record: the kernel has it even if we are SIGKILLed right after.
        n = os.write(self._fd, line)
        if n != len(line):  # short writes only happen on a full disk; keep the line whole
            os.write(self._fd, line[n:])
        self.size += len(line)
        self.records += 1
        self._dirty = True
        now = time.monotonic()
        if now - self._last_sync >= self._fsync_interval:
            self.sync()
        return offset, len(line)

    def sync(self) -> None:
        if self._fd is not None and self._dirty:
            os.fsync(self._fd)
            self._dirty = False
        self._last_sync = time.monotonic()

    def close(self) -> None:
        if self._fd is None:
            return
        self.sync()
        os.close(self._fd)
        self._fd = None
        if self.records == 0:
            # An attempt that completed nothing leaves no file behind.
            self.path.unlink(missing_ok=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_parquet(path: Path, schema: pa.Schema) -> pq.ParquetWriter:
    return pq.ParquetWriter(path, schema, **contracts.WRITER_OPTIONS)


# ---------------------------------------------------------------------------------------------
# Reading: an index of where each wanted key's record is, records fetched in batches


@dataclass
class _Source:
    path: Path
    kind: str  # "live" | "jsonl" | "stale" | "parquet" (any compacted file, for load())
    size: int = 0  # bytes scanned (jsonl): compaction deletes the file only if it is unchanged
    lines: int = 0  # intact records of wanted keys, duplicates included
    unwanted: int = 0  # records of keys nobody asked for (they go to the stale file)
    records_in: int = 0  # compacted file: journal lines compacted into it so far
    duplicates: int = 0
    fd: int | None = None
    pf: pq.ParquetFile | None = None
    cached: tuple[int, pa.Table] | None = None

    def pread(self, offset: int, length: int) -> bytes:
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDONLY)
        return os.pread(self.fd, length, offset)

    def row_group(self, g: int) -> pa.Table:
        if self.cached is None or self.cached[0] != g:
            t = self.pf.read_row_group(g).cast(JOURNAL).replace_schema_metadata(None)
            self.cached = (g, t)
        return self.cached[1]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.pf = None
        self.cached = None


@dataclass
class Index:
    """Where the record of each wanted key is: key -> (source, a, b, ok), where (a, b) is
    (offset, length) of a JSONL line or (row group, row) of a compacted file. A result beats a
    rejection for the same key; otherwise the first record found wins."""

    wanted: set[str] | None
    sources: list[_Source] = field(default_factory=list)
    entries: dict[str, tuple[int, int, int, bool]] = field(default_factory=dict)
    lines: int = 0
    torn: int = 0

    # -- building
    def _offer(self, key: str, src: int, a: int, b: int, ok: bool) -> None:
        prev = self.entries.get(key)
        if prev is None or (ok and not prev[3]):
            self.entries[key] = (src, a, b, ok)

    def _wants(self, key: str) -> bool:
        return self.wanted is None or key in self.wanted

    def add_jsonl(self, path: Path, kind: str = "jsonl") -> None:
        src = len(self.sources)
        s = _Source(path, kind)
        self.sources.append(s)
        offset = 0
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below; iteration is buffered
        except OSError as exc:
            log.warning("journal: cannot read %s: %s", path, exc)
            return
        with f:
            for line in f:
                n = len(line)
                self.lines += 1
                key = _line_key(line)
                if key is None:
                    self.torn += 1
                elif not self._wants(key):
                    s.unwanted += 1
                else:
                    prev = self.entries.get(key)
                    if prev is None or not prev[3]:
                        # The status sits right after the key in the client's records: only
                        # other shapes pay for a JSON parse.
                        ok = line[_KEY_END : _KEY_END + len(_OK_MARK)] == _OK_MARK
                        rec = {} if ok and _intact_body(line) is not None else decode_line(line)
                        if rec is None:
                            self.torn += 1
                            log.warning("journal: dropped a torn/corrupt line in %s", path.name)
                        else:
                            s.lines += 1
                            self._offer(key, src, offset, n, ok or rec.get("status") == "ok")
                    else:
                        s.lines += 1  # a duplicate of a result we already hold
                offset += n
        s.size = offset

    def add_parquet(self, path: Path, kind: str, only: set[str] | None = None) -> None:
        """A compacted file; `only`: offer these keys and no others (the stale search)."""
        src = len(self.sources)
        pf = pq.ParquetFile(path)
        meta = contracts.read_metadata(path)
        s = _Source(path, kind, pf=pf)
        s.records_in = int(meta.get(META_RECORDS_IN, pf.metadata.num_rows))
        s.duplicates = int(meta.get(META_DUPLICATES, 0))
        self.sources.append(s)
        for g in range(pf.num_row_groups):
            t = pf.read_row_group(g, columns=["key", "status"])
            ks = t.column("key").to_pylist()
            ok = _ok_mask(t)
            self.lines += len(ks)
            for r, key in enumerate(ks):
                if only is not None:
                    if key in only and key not in self.entries:
                        self._offer(key, src, g, r, bool(ok[r]))
                elif self._wants(key):
                    s.lines += 1
                    self._offer(key, src, g, r, bool(ok[r]))
                else:
                    s.unwanted += 1

    def add_written(self, src: int, key: str, offset: int, length: int, ok: bool) -> None:
        self.lines += 1
        self.sources[src].lines += 1
        self._offer(key, src, offset, length, ok)

    # -- reading
    def has(self, key: str) -> bool:
        return key in self.entries

    def ok(self, key: str) -> bool:
        return self.entries[key][3]

    def ask_again(self, keys: Iterable[str], prompt_at_fault: Callable[[str], bool]) -> set[str]:
        """The journaled refusals among `keys` to send again: those whose message does not blame
        the prompt. Earlier versions journaled every 400 as final ("Duplicate request ID"
        included); only a 400 that blames the prompt (the engine's `prompt_at_fault`) is."""
        refused = list(dict.fromkeys(k for k in keys if self.has(k) and not self.ok(k)))
        if not refused:
            return set()
        messages = self.fetch(refused).column("message").to_pylist()
        return {k for k, m in zip(refused, messages, strict=True) if not prompt_at_fault(m or "")}

    def done(self, key: str, again: set[str]) -> bool:
        """Does the journal answer `key` for good (see ask_again)?"""
        return self.has(key) and key not in again

    def fetch(self, keys: list[str]) -> pa.Table:
        """The records of `keys` (all indexed) as one JOURNAL table, in the order given."""
        by_src: dict[int, list[tuple[int, int, int]]] = {}
        for pos, key in enumerate(keys):
            src, a, b, _ = self.entries[key]
            by_src.setdefault(src, []).append((pos, a, b))
        parts, order = [], []
        for src, items in by_src.items():
            s = self.sources[src]
            if s.kind == "jsonl":
                recs = []
                for _, offset, length in items:
                    rec = decode_line(s.pread(offset, length))
                    if rec is None:
                        raise JournalError(f"{s.path}: the line at byte {offset} changed on disk")
                    recs.append(rec)
                parts.append(records_to_table(recs))
            else:
                groups: dict[int, list[int]] = {}
                for i, item in enumerate(items):
                    groups.setdefault(item[1], []).append(i)
                rows, sel = [], []
                for g, idx in groups.items():
                    rows.append(s.row_group(g).take(pa.array([items[i][2] for i in idx])))
                    sel.extend(idx)
                t = pa.concat_tables(rows)
                if sel != sorted(sel):
                    t = t.take(pa.array(np.argsort(np.array(sel), kind="stable")))
                parts.append(t)
            order.extend(pos for pos, _, _ in items)
        if not parts:
            return JOURNAL.empty_table()
        table = pa.concat_tables(parts)
        if order != sorted(order):
            table = table.take(pa.array(np.argsort(np.array(order), kind="stable")))
        return table

    def close(self) -> None:
        for s in self.sources:
            s.close()

    # -- what compaction needs to know
    def kinds(self) -> set[str]:
        return {self.sources[src].kind for src, *_ in self.entries.values()}

    @property
    def unwanted(self) -> int:
        """Records read whose key nobody asked for (0 when every key is wanted)."""
        return sum(s.unwanted for s in self.sources)

    def stats(self) -> dict:
        read = self.sources
        return {
            "files": len(read),
            "files_read": [s.path.name for s in read],
            "bytes_read": sum(s.size if s.kind == "jsonl" else _size(s.path) for s in read),
            "lines": self.lines,
            "torn": self.torn,
        }


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------
# One shard's journal


def _shard_of_name(name: str) -> str:
    return name.split(".", 1)[0]


class ShardJournal:
    """The files of one shard in the category's journal directory."""

    def __init__(self, journal_dir, category: str, shard: str):
        self.dir = Path(journal_dir) / category
        self.shard = shard
        self.live = self.dir / f"{shard}.parquet"
        self.stale = self.dir / f"{shard}.stale.parquet"

    @property
    def generation_file(self) -> Path:
        """The generation fingerprint (and its material) this shard's last job ran with."""
        return self.dir / f"generation-{self.shard}.json"

    def read_generation(self) -> dict | None:
        """{"fingerprint", "material"} of the shard's last job; None: none recorded."""
        try:
            return json.loads(self.generation_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def write_generation(self, fingerprint: str, material: dict) -> None:
        """Record the fingerprint this job runs with (atomically; no secrets in `material`)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{self.generation_file.name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"fingerprint": fingerprint, "material": material},
                                  indent=1, sort_keys=True) + "\n")  # fmt: skip
        os.replace(tmp, self.generation_file)

    def jsonl_files(self) -> list[Path]:
        return sorted(self.dir.glob(f"{self.shard}.*.jsonl")) if self.dir.is_dir() else []

    def open(self, wanted: set[str] | None) -> Index:
        """The index of the wanted keys (None: every key; conversation shards, whose later
        turns' keys are known only once the earlier turns are read): the shard's compacted
        file, then its JSONL files. Files of other shards are never opened."""
        index = Index(None if wanted is None else set(wanted))
        if self.live.is_file():
            index.add_parquet(self.live, "live")
        for path in self.jsonl_files():
            index.add_jsonl(path)
        return index

    def search_stale(self, index: Index, missing: Iterable[str]) -> int:
        """Look for still missing keys among the records the shard no longer asked for."""
        missing = set(missing)
        if not missing or not self.stale.is_file():
            return 0
        before = len(index.entries)
        index.add_parquet(self.stale, "stale", only=missing)
        return len(index.entries) - before

    def writer(self, index: Index) -> tuple[JournalWriter, Callable[[dict], None]]:
        """This attempt's writer, and a function that journals a record and indexes it."""
        w = JournalWriter(self.dir.parent, self.dir.name, self.shard)
        src = len(index.sources)
        index.sources.append(_Source(w.path, "jsonl"))

        def append(rec: dict) -> None:
            offset, length = w.append(rec)
            index.sources[src].size = w.size
            index.add_written(src, rec["key"], offset, length, rec.get("status") == "ok")

        return w, append

    def needs_compaction(self, index: Index) -> bool:
        """Anything to fold into the shard's compacted file (JSONL files, unwanted records in
        it, records found in the stale file)?"""
        return (
            any(s.kind == "jsonl" or (s.kind == "live" and s.unwanted) for s in index.sources)
            or "stale" in index.kinds()
        )


class Compaction:
    """Writes the shard's next compacted file while its output is streamed (`add` gets the
    records in output order, one per key), then `commit` swaps it in (see the module doc)."""

    def __init__(self, journal: ShardJournal, index: Index, category: str):
        self.j, self.index = journal, index
        d = journal.dir
        for pattern in (f".{journal.shard}.parquet.*.tmp", f".{journal.shard}.stale.parquet.*.tmp"):
            for old in d.glob(pattern):  # left by a killed compaction
                old.unlink(missing_ok=True)
        stamp = time.time_ns()
        self.live_tmp = d / f".{journal.shard}.parquet.{stamp}.tmp"
        self.stale_tmp = d / f".{journal.shard}.stale.parquet.{stamp}.tmp"
        live = [s for s in index.sources if s.kind == "live"]
        jsonl = [s for s in index.sources if s.kind == "jsonl"]
        chosen = sum(1 for src, *_ in index.entries.values() if index.sources[src].kind != "stale")
        # Journal lines compacted into this shard's file so far, and how many were the same
        # sample journaled again (both cumulative: `journaled_lines` reads them).
        self.records_in = sum(s.records_in for s in live) + sum(s.lines for s in jsonl)
        self.duplicates = (
            sum(s.duplicates for s in live) + sum(s.lines for s in live + jsonl) - chosen
        )
        self.rows = 0
        self.stale_added = 0
        self._meta = {contracts.META_CATEGORY: category, contracts.META_SHARD: journal.shard}
        self._writer: pq.ParquetWriter | None = None
        self._buf = contracts.RowGroupBuffer(self._write, "output_ids")

    def _write(self, table: pa.Table) -> None:
        if self._writer is None:
            self._writer = _write_parquet(self.live_tmp, self._schema())
        self._writer.write_table(table, row_group_size=contracts.ROW_GROUP_SIZE)

    def _schema(self) -> pa.Schema:
        meta = dict(self._meta)
        meta[META_RECORDS_IN] = str(self.records_in)
        meta[META_DUPLICATES] = str(self.duplicates)
        return contracts.with_metadata(JOURNAL, "journal", meta)

    def add(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        self._buf.add(table)

    def _finish_live(self) -> None:
        self._buf.finish()
        if self._writer is None:
            self._writer = _write_parquet(self.live_tmp, self._schema())
            self._writer.write_table(JOURNAL.empty_table())
        self._writer.close()
        _fsync(self.live_tmp)

    def _unwanted_count(self) -> int:
        return sum(s.unwanted for s in self.index.sources if s.kind in ("live", "jsonl"))

    def _write_stale(self) -> bool:
        """Unwanted records of the live and JSONL files, after the old stale file's rows."""
        if not self._unwanted_count():
            return False
        have: set[str] = set()
        schema = contracts.with_metadata(JOURNAL, "journal", self._meta)
        writer = _write_parquet(self.stale_tmp, schema)
        buf = contracts.RowGroupBuffer(
            lambda t: writer.write_table(t, row_group_size=contracts.ROW_GROUP_SIZE), "output_ids"
        )
        if self.j.stale.is_file():
            old = pq.ParquetFile(self.j.stale)
            for g in range(old.num_row_groups):
                t = old.read_row_group(g).cast(JOURNAL).replace_schema_metadata(None)
                have.update(pc.filter(t.column("key"), _ok_mask(t)).to_pylist())
                buf.add(t)
        wanted = self.index.wanted or set()

        def keep(t: pa.Table) -> pa.Table:
            ks = t.column("key").to_pylist()
            ok = _ok_mask(t)
            mask = np.zeros(len(ks), dtype=bool)
            for i, k in enumerate(ks):
                if k not in wanted and k not in have:
                    mask[i] = True
                    if ok[i]:
                        have.add(k)
            return t.filter(pa.array(mask))

        for s in self.index.sources:
            if s.kind == "live" and s.unwanted:
                pf = pq.ParquetFile(s.path)
                for g in range(pf.num_row_groups):
                    t = keep(pf.read_row_group(g).cast(JOURNAL).replace_schema_metadata(None))
                    self.stale_added += t.num_rows
                    buf.add(t)
            elif s.kind == "jsonl" and s.unwanted:
                for recs in _batched(_jsonl_records(s.path, lambda k: k not in wanted)):
                    t = keep(records_to_table(recs))
                    self.stale_added += t.num_rows
                    buf.add(t)
        buf.finish()
        writer.close()
        _fsync(self.stale_tmp)
        return True

    def commit(self, num_shards: int | None) -> dict:
        """Make the new files the shard's journal, then delete what they replace."""
        t0 = time.monotonic()
        self._finish_live()
        with_stale = self._write_stale()
        deleted, kept = [], []
        with _locked(self.j.dir):
            manifest = read_manifest(self.j.dir)
            if num_shards is not None and (manifest or {}).get("num_shards") != num_shards:
                # Another run changed the shard count meanwhile: its migration owns the files.
                self.abort()
                log.warning("journal: layout changed during the job; compaction skipped")
                return {"skipped": "layout changed"}
            if with_stale:
                os.replace(self.stale_tmp, self.j.stale)
            os.replace(self.live_tmp, self.j.live)
            _fsync(self.j.dir)
            for s in self.index.sources:
                if s.kind != "jsonl" or not s.path.exists():
                    continue
                if _size(s.path) == s.size:
                    s.close()
                    s.path.unlink(missing_ok=True)
                    deleted.append(s.path.name)
                else:  # appended to after we read it (not ours to delete)
                    kept.append(s.path.name)
            _fsync(self.j.dir)
        if kept:
            log.warning("journal: kept %s: it grew while this job compacted", kept)
        return {
            "records": self.rows,
            "records_in": self.records_in,
            "stale_added": self.stale_added,
            "files_deleted": len(deleted),
            "bytes": _size(self.j.live),
            "seconds": round(time.monotonic() - t0, 3),
        }

    def abort(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        self.live_tmp.unlink(missing_ok=True)
        self.stale_tmp.unlink(missing_ok=True)


def _jsonl_records(path: Path, want: Callable[[str], bool]) -> Iterator[dict]:
    """Intact records of a JSONL file whose key passes `want`."""
    with open(path, "rb") as f:
        for line in f:
            key = _line_key(line)
            if key is None or not want(key):
                continue
            rec = decode_line(line)
            if rec is not None:
                yield rec


def _batched(it: Iterable[dict], n: int = DECODE_BATCH) -> Iterator[list[dict]]:
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


# ---------------------------------------------------------------------------------------------
# Layout: the shard count the journal is sharded by, and the one-time migration


@contextlib.contextmanager
def _locked(d: Path):
    """An exclusive flock on the category's .lock (layout changes, compaction commits)."""
    d.mkdir(parents=True, exist_ok=True)
    fd = os.open(d / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:  # a filesystem without locks: still safe for one job per shard
            log.warning("journal: cannot lock %s (%s); going on without it", d / LOCK, exc)
        yield
    finally:
        os.close(fd)


def read_manifest(d: Path) -> dict | None:
    try:
        return json.loads((d / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise JournalError(f"{d / MANIFEST}: not JSON ({exc})") from None


def _write_manifest(d: Path, manifest: dict) -> None:
    tmp = d / f".{MANIFEST}.{time.time_ns()}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _fsync(tmp)
    os.replace(tmp, d / MANIFEST)
    _fsync(d)


def _record_files(d: Path) -> list[Path]:
    """Every file holding records (JSONL and compacted), sorted."""
    if not d.is_dir():
        return []
    return sorted(
        p for p in d.iterdir() if not p.name.startswith(".") and p.suffix in (".jsonl", ".parquet")
    )


def ensure_layout(
    journal_dir, category: str, num_shards: int, assignment: shards.Assignment | None = None
) -> dict | None:
    """Make the category's journal sharded like the tokenized shards: `num_shards` by the
    prompt_id's hash, or by `assignment` (shard_by: prefix, its digest in journal.json).

    Cheap when it already is (one small file read). Otherwise, under the category lock, the
    first job moves every record whose prompt_id now belongs to another shard into that shard's
    files, once, and records the new layout in journal.json. Returns the migration's stats, or
    None when nothing had to move.
    """
    d = Path(journal_dir) / category
    digest = assignment.digest if assignment is not None else None

    def laid_out(manifest) -> bool:
        return (
            manifest is not None
            and manifest.get("num_shards") == num_shards
            and manifest.get("assignment") == digest
        )

    if laid_out(read_manifest(d)):
        return None
    with _locked(d):
        manifest = read_manifest(d)
        if laid_out(manifest):
            return None  # another job migrated while we waited
        migrations = (manifest or {}).get("migrations") or []
        stats = None
        if _record_files(d):
            stats = _migrate(d, num_shards, assignment)
            stats["from_shards"] = (manifest or {}).get("num_shards")
            stats["from_assignment"] = (manifest or {}).get("assignment")
            stats["assignment"] = digest
            migrations = migrations + [stats]
            log.info("journal %s: sharded by %d now (%s)", d, num_shards, json.dumps(stats))
        new = {"format": LAYOUT_FORMAT, "num_shards": num_shards, "migrations": migrations}
        if digest is not None:
            new["assignment"] = digest
        _write_manifest(d, new)
        return stats


def _target(
    prompt_id: str | None, prefix: str, n: int, assignment: shards.Assignment | None = None
) -> str:
    try:
        if assignment is not None and prompt_id:
            return shards.shard_name(assignment.shard_of(prompt_id))
        return shards.shard_name(shards.shard_of(prompt_id or "", n))
    except ValueError:
        # No shard can hold it (tokenize rejects such ids): keep it near where it was.
        return shards.shard_name(int(prefix) % n) if prefix.isdigit() else shards.shard_name(0)


def _file_lines(path: Path) -> Iterator[tuple[bytes, str | None]]:
    """(journal line, prompt_id) of every intact record of a JSONL or compacted file."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as f:
            for line in f:
                body = _intact_body(line) if line.startswith(_PREFIX) else None
                if body is not None:
                    yield line, _line_prompt_id(line, body)
        return
    pf = pq.ParquetFile(path)
    for g in range(pf.num_row_groups):
        t = pf.read_row_group(g).cast(JOURNAL).replace_schema_metadata(None)
        for start in range(0, t.num_rows, DECODE_BATCH):
            for rec in table_to_records(t.slice(start, DECODE_BATCH)):
                yield encode_line(rec), rec.get("prompt_id")


def _prompt_ids(path: Path) -> Iterator[str | None]:
    if path.suffix == ".jsonl":
        for _, pid in _file_lines(path):
            yield pid
        return
    pf = pq.ParquetFile(path)
    for g in range(pf.num_row_groups):
        yield from pf.read_row_group(g, columns=["prompt_id"]).column(0).to_pylist()


def _migrate(d: Path, n: int, assignment: shards.Assignment | None = None) -> dict:
    t0 = time.monotonic()
    for old in d.glob(".*.migrated-*.tmp"):  # left by a killed migration
        old.unlink(missing_ok=True)
    stamp = time.time_ns()
    outs: dict[str, tuple[Path, object]] = {}
    moved_files, files, records, nbytes = [], 0, 0, 0
    try:
        for path in _record_files(d):
            files += 1
            nbytes += _size(path)
            prefix = _shard_of_name(path.name)
            stays = prefix.isdigit() and shards.shard_name(int(prefix) % n) == prefix
            if stays and all(
                _target(p, prefix, n, assignment) == prefix for p in _prompt_ids(path)
            ):
                continue  # every record is already in its shard's file
            for line, pid in _file_lines(path):
                target = _target(pid, prefix, n, assignment)
                if target not in outs:
                    tmp = d / f".{target}.migrated-{stamp}.jsonl.tmp"
                    outs[target] = (tmp, open(tmp, "wb", buffering=1 << 20))  # noqa: SIM115
                outs[target][1].write(line)
                records += 1
            moved_files.append(path)
        for _, f in outs.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
    except BaseException:
        for tmp, f in outs.values():
            f.close()
            tmp.unlink(missing_ok=True)
        raise
    # The new files first (durably), then the files they replace.
    for target, (tmp, _) in outs.items():
        os.replace(tmp, d / f"{target}.migrated-{stamp}.jsonl")
    _fsync(d)
    for path in moved_files:
        path.unlink()
    _fsync(d)
    return {
        "to_shards": n,
        "files_read": files,
        "files_moved": len(moved_files),
        "records_moved": records,
        "bytes_read": nbytes,
        "seconds": round(time.monotonic() - t0, 3),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


# ---------------------------------------------------------------------------------------------
# Whole-category reading (tests, inspection): not what a generate job does


def journal_files(journal_dir, category: str, shard: str | None = None) -> list[Path]:
    files = _record_files(Path(journal_dir) / category)
    return [p for p in files if shard is None or _shard_of_name(p.name) == shard]


def load(journal_dir, category: str, wanted: Iterable[str], shard: str | None = None):
    """Records of the wanted keys from every journal file of the category (or of one shard),
    as dicts. A result beats a rejection for the same key.

    Returns (records by key, stats {files, lines, torn}).
    """
    index = Index(set(wanted))
    for path in journal_files(journal_dir, category, shard):
        if path.suffix == ".jsonl":
            index.add_jsonl(path)
        else:
            index.add_parquet(path, "parquet")
    try:
        keys = list(index.entries)
        found = {}
        for start in range(0, len(keys), DECODE_BATCH):
            chunk = keys[start : start + DECODE_BATCH]
            found.update(zip(chunk, table_to_records(index.fetch(chunk)), strict=True))
    finally:
        index.close()
    return found, {"files": len(index.sources), "lines": index.lines, "torn": index.torn}


def journaled_lines(journal_dir, category: str, shard: str) -> int:
    """Records ever journaled for a shard: lines of its JSONL files plus the lines compacted
    into its compacted file (a sample journaled twice counts twice, even once compacted)."""
    sj = ShardJournal(journal_dir, category, shard)
    n = sum(p.read_bytes().count(b"\n") for p in sj.jsonl_files())
    if sj.live.is_file():
        n += int(contracts.read_metadata(sj.live).get(META_RECORDS_IN, 0))
    return n
