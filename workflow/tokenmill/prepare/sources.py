"""Reading a category's sources as a stream of raw records, each with its location.

A source is a local file or glob (.jsonl/.ndjson, .json, .parquet) or a Hugging Face hub
dataset. Globs are expanded and sorted by path, so the record order (and therefore which of
two duplicates is kept) does not depend on the filesystem. Locations count from 1, as an
editor does: `:` a line number, `#` a record number.

    path:LINE                 JSONL (line number, 1 = the first line; blank lines count)
    path#N                    JSON (the N-th element of the list, 1 = the first)
    path#N                    Parquet (the N-th row, 1 = the first)
    hub:name[/config]:split#N the N-th row of the split, 1 = the first

Paths in locations are relative to the base directory (as written in the config), so
outputs do not depend on where the checkout lives. A record that cannot be parsed is still
yielded (with `error` set) so that it becomes a rejected row; a source that cannot be read
at all raises SourceError, naming the file.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".ndjson")
JSON_SUFFIXES = (".json",)
PARQUET_SUFFIXES = (".parquet", ".pq")
PARQUET_BATCH_ROWS = 1024


class SourceError(RuntimeError):
    """A source that cannot be read at all (missing, corrupt, wrong kind of file)."""


@dataclass(frozen=True)
class Record:
    location: str  # where the record came from (see module docstring)
    raw: str  # the record as text, kept as is for rejected rows
    data: dict | None  # the parsed record; None when it could not be parsed
    error: str | None = None  # why it could not be parsed


def _raw_json(value) -> str:
    # Parquet / hub rows may hold values JSON does not know (bytes, dates): show them as text.
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def expand_paths(pattern: str, basedir: str | os.PathLike = ".") -> list[tuple[str, Path]]:
    """(display path, real path) for every file matching `pattern`, sorted by display path."""
    base = Path(basedir)
    full = pattern if os.path.isabs(pattern) else str(base / pattern)
    matches = [m for m in glob.glob(full, recursive=True) if os.path.isfile(m)]
    if not matches:
        raise SourceError(f"source '{pattern}': no file matches (base directory '{base}')")
    out = []
    for m in matches:
        shown = m if os.path.isabs(pattern) else os.path.relpath(m, base)
        out.append((Path(shown).as_posix(), Path(m)))
    return sorted(out)


def iter_jsonl(shown: str, path: Path) -> Iterator[Record]:
    try:
        f = open(path, encoding="utf-8")  # noqa: SIM115 - closed below, errors reported
    except OSError as exc:
        raise SourceError(f"cannot read '{shown}': {exc}") from exc
    with f:
        try:
            for lineno, line in enumerate(f, start=1):
                text = line.rstrip("\r\n")
                if not text.strip():
                    continue  # blank lines are not records
                loc = f"{shown}:{lineno}"
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    yield Record(loc, text, None, f"invalid JSON: {exc}")
                    continue
                if not isinstance(value, dict):
                    yield Record(
                        loc, text, None, f"record is a {type(value).__name__}, not an object"
                    )
                    continue
                yield Record(loc, text, value)
        except UnicodeDecodeError as exc:
            raise SourceError(f"cannot read '{shown}': not UTF-8 text ({exc})") from exc


def iter_json(shown: str, path: Path) -> Iterator[Record]:
    # A JSON document has to be parsed whole; JSONL or Parquet stream, prefer them for big data.
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SourceError(f"cannot read '{shown}' as JSON: {exc}") from exc
    if isinstance(doc, dict) and isinstance(doc.get("data"), list):
        doc = doc["data"]
    if not isinstance(doc, list):
        raise SourceError(f"'{shown}': expected a JSON list of records or {{\"data\": [...]}}")
    for i, value in enumerate(doc):
        loc = f"{shown}#{i + 1}"
        if not isinstance(value, dict):
            yield Record(loc, _raw_json(value), None, f"record is a {type(value).__name__}")
            continue
        yield Record(loc, _raw_json(value), value)


def iter_parquet(shown: str, path: Path) -> Iterator[Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as exc:
        raise SourceError(f"cannot read '{shown}' as Parquet: {exc}") from exc
    row = 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            for value in batch.to_pylist():
                yield Record(f"{shown}#{row + 1}", _raw_json(value), value)
                row += 1
    except (OSError, pa.ArrowException) as exc:
        raise SourceError(f"cannot read '{shown}' as Parquet (row {row + 1}): {exc}") from exc
    finally:
        pf.close()


def iter_hub(spec: dict) -> Iterator[Record]:
    """A hub source's records; `spec` is validated (the schema fills config, split, revision)."""
    import datasets  # lazy: only hub sources need it (and it is slow to import)

    name, config, split = spec["hub"], spec["config"], spec["split"]
    where = f"hub:{name}" + (f"/{config}" if config else "") + f":{split}"
    try:
        ds = datasets.load_dataset(name, config, split=split, revision=spec["revision"])
    except Exception as exc:  # noqa: BLE001 - any loader failure is an unreadable source
        raise SourceError(f"cannot load hub dataset '{where}': {exc}") from exc
    for i, value in enumerate(ds):
        yield Record(f"{where}#{i + 1}", _raw_json(value), dict(value))


def iter_file(shown: str, path: Path) -> Iterator[Record]:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return iter_jsonl(shown, path)
    if name.endswith(JSON_SUFFIXES):
        return iter_json(shown, path)
    if name.endswith(PARQUET_SUFFIXES):
        return iter_parquet(shown, path)
    raise SourceError(f"'{shown}': unknown file type (expected .jsonl, .json or .parquet)")


def iter_source(spec: dict, basedir: str | os.PathLike = ".") -> Iterator[Record]:
    """Records of one normalized source spec ({path, ...} or {hub, ...}), in a stable order."""
    if "hub" in spec:
        yield from iter_hub(spec)
        return
    for shown, path in expand_paths(spec["path"], basedir):
        yield from iter_file(shown, path)
