"""sha256 of what a run publishes and what its stages hand on, for comparing two runs of the
same config (a refactor must leave them byte-identical):

    python benchmarks/demo_digests.py results > before.txt   # ... change, rerun ...
    python benchmarks/demo_digests.py results | diff before.txt -

Parquet files are compared by their rows (the footer records the writer's version), generated
shards by their token columns: latency, server and cached-token counts are the engine's timing,
not the data. The generate jobs' records (`.meta.json`: hosts, times, attempts), provenance and
the dataset card are left out; every other file is compared byte for byte."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

TIMING_COLUMNS = {"latency_s", "server", "cached_tokens"}
# records of what a job did (hosts, times, attempts), not data
SKIPPED = ("provenance.json", "README.md")
FOLDERS = ("prompts", "rejected", "tokenized", "generated", "dataset", "export", "token_counts")


def parquet_digest(path: Path) -> str:
    table = pq.read_table(path)
    keep = [c for c in table.column_names if c not in TIMING_COLUMNS]
    rows = table.select(keep).to_pylist()
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=str).encode()).hexdigest()


def digests(results: Path) -> dict[str, str]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((results / folder).rglob("*")):
            if not path.is_file() or path.name in SKIPPED or path.name.endswith(".meta.json"):
                continue
            rel = path.relative_to(results).as_posix()
            if path.suffix == ".parquet":
                out[rel] = parquet_digest(path)
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


if __name__ == "__main__":
    for rel, digest in digests(Path(sys.argv[1])).items():
        print(digest, rel)
