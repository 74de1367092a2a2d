"""Crash-safe, append-only journal of completed generations (outside Snakemake's outputs).

Layout: {journal_dir}/{category}/{shard}.{host}.{pid}.{time_ns}.jsonl, one file per job attempt,
so concurrent jobs never share a file and need no locks. Each line is `JSON<TAB>CRC32HEX<LF>`
where the JSON starts with `{"key":"<32 hex>"`; a reader can skip lines of other shards by
looking at that fixed slice before paying for a JSON parse. A line without its newline or with a
bad checksum (a write torn by SIGKILL or a full disk) is dropped.

Every record is handed to the kernel with one write() (it survives SIGKILL of the process);
fsync runs periodically and on close (it survives a node crash up to the last fsync).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

_PREFIX = b'{"key":"'
_KEY_LEN = 32


def encode_line(record: dict) -> bytes:
    """One journal line; `record["key"]` must come first (it does: we build the dict so)."""
    body = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode()
    return body + b"\t" + f"{zlib.crc32(body):08x}".encode() + b"\n"


def decode_line(line: bytes) -> dict | None:
    """The record of a complete, intact line, else None."""
    if not line.endswith(b"\n"):
        return None
    body, sep, crc = line[:-1].rpartition(b"\t")
    if not sep or len(crc) != 8:
        return None
    try:
        if int(crc, 16) != zlib.crc32(body):
            return None
        rec = json.loads(body)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "key" in rec else None


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

    def append(self, record: dict) -> None:
        if "key" not in record or next(iter(record)) != "key":
            record = {"key": record["key"], **{k: v for k, v in record.items() if k != "key"}}
        line = encode_line(record)
        # One write() per record: the kernel has it even if we are SIGKILLed right after.
        n = os.write(self._fd, line)
        if n != len(line):  # short writes only happen on a full disk; keep the line whole
            os.write(self._fd, line[n:])
        self.records += 1
        self._dirty = True
        now = time.monotonic()
        if now - self._last_sync >= self._fsync_interval:
            self.sync()

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


def journal_files(journal_dir, category: str) -> list[Path]:
    d = Path(journal_dir) / category
    return sorted(d.glob("*.jsonl")) if d.is_dir() else []


def load(journal_dir, category: str, wanted: Iterable[str]) -> tuple[dict[str, dict], dict]:
    """Records of the wanted keys from ALL journal files of the category (a prompt may have
    moved shard when the shard count changed). A result beats a rejection for the same key.

    Returns (records by key, stats {files, lines, torn}).
    """
    wanted = set(wanted)
    found: dict[str, dict] = {}
    stats = {"files": 0, "lines": 0, "torn": 0}
    for path in journal_files(journal_dir, category):
        stats["files"] += 1
        try:
            data = path.read_bytes()
        except OSError as exc:
            log.warning("journal: cannot read %s: %s", path, exc)
            continue
        for line in data.splitlines(keepends=True):
            stats["lines"] += 1
            if not line.startswith(_PREFIX):
                stats["torn"] += 1
                continue
            key = line[len(_PREFIX) : len(_PREFIX) + _KEY_LEN].decode("ascii", "replace")
            if key not in wanted:
                continue
            prev = found.get(key)
            if prev is not None and prev.get("status") == "ok":
                continue
            rec = decode_line(line)
            if rec is None:
                stats["torn"] += 1
                log.warning("journal: dropped a torn/corrupt line in %s", path.name)
                continue
            if prev is None or rec.get("status") == "ok":
                found[key] = rec
    return found, stats
