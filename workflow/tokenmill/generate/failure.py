"""What a deterministic generate failure holds for: the identity the job harness compares.

When a generate job fails for a reason that the same config cannot change (fail-fast: the first
requests of the run all answered with the same deterministic error), the harness
(jobs/harness.py) writes the shard's failure record (contracts.FailureRecord) with this
identity: the generation fingerprint, a hash of the whole generation section (operational keys
included) and the tokenized shard's size and mtime. The scheduler's next attempt of the job (the
profile's `retries`) with the same identity is refused before any engine starts or request is
sent, naming the first attempt's message. Transient failures (the engine died or could not be
reached, timeouts, SIGTERM, preemption, an engine that fails at start) are never recorded: they
are retried as before. Any change of the generation section or of the shard (or deleting the
record) makes it not match; a successful run deletes it.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from tokenmill import contracts, keys
from tokenmill.jobs import harness


def run_identity(gen) -> dict:
    """What a failure every shard shares holds for: the generation config it was seen with."""
    return {
        "generation_fingerprint": keys.generation_fingerprint(gen),
        "settings_hash": hashlib.sha256(contracts.canonical_json(gen.raw).encode()).hexdigest(),
    }


def identity(gen, tokenized) -> dict:
    """What a recorded failure holds for: the config and the shard it was seen with."""
    st = os.stat(tokenized)
    return {**run_identity(gen), "tokenized": {"size": st.st_size, "mtime_ns": st.st_mtime_ns}}


class RunStop:
    """Whether another job of the run failed for a reason every shard shares (its fail-fast:
    the run-wide failure record, layout.run_failure_record, with this config's run identity):
    the client asks before each request, the file is read at most every `every_s` seconds."""

    def __init__(self, path, identity: dict, own_shard: tuple[str, str], every_s=0.5):
        self.path, self.identity, self.own, self.every_s = Path(path), identity, own_shard, every_s
        self._next = 0.0
        self._said: str | None = None

    def __call__(self) -> str | None:
        now = time.monotonic()
        if self._said is None and now >= self._next:
            self._next = now + self.every_s
            self._said = harness.shared_failure(self.path, self.identity, self.own)
        return self._said
