"""A deterministic failure is paid once: its record next to the shard's journal.

When a generate job fails for a reason that the same config cannot change (fail-fast: the first
requests of the run all answered with the same deterministic error), `tokenmill generate` writes
`{journal_dir}/{category}/{shard}.failure.json`: the generation fingerprint, a hash of the whole
generation section (operational keys included), the tokenized shard's size and mtime, and the
message. The scheduler's next attempt of the job (the profile's `retries`) finds a record that
matches its own config and exits at once, before any engine starts or request is sent, naming
the first attempt's message. Transient failures (the engine died or could not be reached,
timeouts, SIGTERM, preemption, an engine that fails at start) are never recorded: they are
retried as before. Any change of the generation section or of the shard (or deleting the file)
makes the record not match; a successful run deletes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from tokenmill import contracts, keys


def failure_path(journal_dir, category: str, shard: str) -> Path:
    return Path(journal_dir) / category / f"{shard}.failure.json"


def identity(gen, tokenized) -> dict:
    """What a recorded failure holds for: the config and the shard it was seen with."""
    st = os.stat(tokenized)
    return {
        "generation_fingerprint": keys.generation_fingerprint(gen),
        "settings_hash": hashlib.sha256(contracts.canonical_json(gen.raw).encode()).hexdigest(),
        "tokenized": {"size": st.st_size, "mtime_ns": st.st_mtime_ns},
    }


def record(path: Path, ident: dict, message: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        **ident,
        "message": message,
        "time": datetime.now(UTC).isoformat(timespec="seconds"),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
    contracts.write_json_atomic(path, body)


def recorded(path: Path, ident: dict) -> dict | None:
    """The record when it was made with this very config and shard (None otherwise)."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if all(body.get(k) == v for k, v in ident.items()):
        return body
    return None


def clear(path: Path) -> None:
    # Look first: a run that had no failure to clear touches nothing in the journal's folder.
    if path.exists():
        path.unlink(missing_ok=True)
