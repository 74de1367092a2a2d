"""Stable shard assignment: a prompt's shard is a function of its prompt_id alone.

prompt_ids are hex sha256 prefixes (formats.prompt_id), so their first 16 hex digits are a
uniform 64-bit number. Editing one prompt changes its prompt_id and therefore moves it into one
(possibly different) shard; every other prompt stays where it was.
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill.layout import shard_name, shard_names  # noqa: F401 - their owner: the layout


def shard_of(prompt_id: str, n: int) -> int:
    """The shard of `prompt_id` among `n` shards. Raises ValueError for a non-hex id."""
    if n < 1:
        raise ValueError(f"number of shards must be >= 1, got {n}")
    head = prompt_id[:16]
    if len(head) < 16:
        raise ValueError(f"prompt_id '{prompt_id}' is shorter than 16 hex digits")
    return int(head, 16) % n


def shard_path(out_dir: str | os.PathLike, shard: int) -> Path:
    return Path(out_dir) / f"{shard_name(shard)}.parquet"
