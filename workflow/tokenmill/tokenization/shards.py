"""Which shard a prompt goes to (categories.C.shard_by).

prefix (the default): prompts that share a prefix share a shard, so that the shard's engine
serves it from its prefix cache (prefix_reuse.affine_shards over the category's prompts, each
shard within prefix_reuse.BALANCE of the mean). It needs the whole category before any row is
placed. Adding a prompt moves few others (one added to 4,000 in 16 shards changes 2.3 shards
on average: tests/test_prefix_reuse.py), and every changed shard reruns its generate job, which
finds the moved prompts' samples in the journal and sends nothing for them. A rejected prompt
(no tokens to share) keeps its prompt_id's shard. Each shard's metadata holds the assignment's
digest (AssignmentDigest); the journal is laid out by it (generate/journal.ensure_layout).

prompt_id: a function of the prompt_id alone. prompt_ids are hex sha256 prefixes
(formats.prompt_id), so their first 16 hex digits are a uniform 64-bit number. Editing one prompt
changes its prompt_id and therefore moves it into one (possibly different) shard; every other
prompt stays where it was. Shards written before shard_by existed were placed this way.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from tokenmill import contracts, prefix_reuse
from tokenmill.layout import shard_name, shard_names  # noqa: F401 - their owner: the layout

BY_PREFIX, BY_PROMPT_ID = "prefix", "prompt_id"
SHARD_BY = (BY_PREFIX, BY_PROMPT_ID)
# The assignment's key of a prompt: a hash per 64 tokens of its first 4,096 (8 bytes per 64
# tokens held for the whole category; longer shared prefixes are together already at 4,096).
ASSIGN_BLOCK, ASSIGN_TOKENS = 64, 4096


def shard_of(prompt_id: str, n: int) -> int:
    """The shard of `prompt_id` among `n` shards by its hash. Raises ValueError for a non-hex id."""
    if n < 1:
        raise ValueError(f"number of shards must be >= 1, got {n}")
    head = prompt_id[:16]
    if len(head) < 16:
        raise ValueError(f"prompt_id '{prompt_id}' is shorter than 16 hex digits")
    return int(head, 16) % n


def assignment_key(ids) -> bytes:
    return prefix_reuse.dispatch_key(np.asarray(ids)[:ASSIGN_TOKENS], ASSIGN_BLOCK)


def assign(keys: list[bytes], n: int) -> list[int]:
    """The prefix-affine shard of each prompt, from its assignment_key (category order)."""
    return prefix_reuse.affine_shards(keys, n)


def shard_path(out_dir: str | os.PathLike, shard: int) -> Path:
    return Path(out_dir) / f"{shard_name(shard)}.parquet"


class AssignmentDigest:
    """The digest of a prefix assignment: sha256 over "prompt_id:shard" lines in prompt_id
    order. Tokenize computes it as it places the rows and writes it into every shard's
    metadata (contracts.META_ASSIGNMENT); the journal is laid out by it."""

    def __init__(self):
        self._h = hashlib.sha256()

    def add(self, prompt_ids: Iterable[str], placed: Iterable[int]) -> None:
        """Rows in prompt_id order."""
        self._h.update(
            "".join(f"{p}:{s}\n" for p, s in zip(prompt_ids, placed, strict=True)).encode()
        )

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:32]


class Assignment:
    """Where a category's tokenized shards placed each prompt (shard_by: prefix), by its digest.
    The prompt-to-shard map is read from every shard's prompt_id column only when asked for (a
    journal that must move records): a job whose journal is laid out by the same digest reads
    nothing but its own shard's metadata."""

    def __init__(self, tokenized_dir, num_shards: int, digest: str | None = None):
        self.shard_by, self.num_shards = BY_PREFIX, num_shards
        self._dir, self._digest = Path(tokenized_dir), digest
        self._by_prompt_id: dict[str, int] | None = None

    @property
    def digest(self) -> str:
        if self._digest is None:  # shards written before the digest was in their metadata
            self._read()
        return self._digest

    def shard_of(self, prompt_id: str) -> int:
        """The shard of a prompt; one the shards do not hold goes by its prompt_id's hash."""
        if self._by_prompt_id is None:
            self._read()
        s = self._by_prompt_id.get(prompt_id)
        return s if s is not None else shard_of(prompt_id, self.num_shards)

    def _read(self) -> None:
        by_pid: dict[str, int] = {}
        for i in range(self.num_shards):
            pids = pq.read_table(shard_path(self._dir, i), columns=["prompt_id"]).column(0)
            by_pid.update(dict.fromkeys(pids.to_pylist(), i))
        digest = AssignmentDigest()
        order = sorted(by_pid)
        digest.add(order, (by_pid[p] for p in order))
        self._digest = self._digest or digest.hexdigest()
        self._by_prompt_id = by_pid


def assignment_of(tokenized_path, metadata: dict, num_shards: int) -> Assignment | None:
    """The assignment a tokenized shard belongs to (None: placed by the prompt_id's hash)."""
    if shard_by_of(metadata) != BY_PREFIX:
        return None
    digest = metadata.get(contracts.META_ASSIGNMENT)
    return Assignment(Path(tokenized_path).parent, num_shards, digest)


def shard_by_of(metadata: dict) -> str:
    """How a tokenized shard's rows were placed (shards written before shard_by: by prompt_id)."""
    return metadata.get(contracts.META_SHARD_BY) or BY_PROMPT_ID
