"""How much of the prompt tokens an engine's prefix cache can serve, and the order and shards
that let it.

An engine with a prefix cache serves a prompt's leading tokens from the cache when an earlier
prompt on the same engine computed them: SGLang's radix cache per token, vLLM's block cache in
whole blocks (128 tokens on its CPU build). The last token of a prompt is always computed. With
a cache that holds every prefix, a prompt reuses its longest common prefix with any earlier
prompt on that engine, less its last token, cut down to whole blocks.

In the lexicographic order of the token ids (a depth-first walk of the prompts' trie) a
prompt's longest common prefix with any earlier prompt is the one with the prompt just before
it, and a prompt that is a prefix of another comes first. That order reaches the ceiling, so
the ceiling is a sum over neighbours, and it is the dispatch order a job uses (`trie_order`).

A prompt is held as its key: the token ids as big-endian 4-byte words, whose byte order is the
lexicographic order of the ids (4 bytes per token in memory). A generate job orders its queue
by a compact key instead (`dispatch_key`: one 8-byte hash per 16 tokens, half a byte per token),
which walks the trie of 16-token blocks: prompts sharing blocks stay together, the ceiling
within the last 16 tokens of a prefix aside.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# The shard sizes `affine_shards` keeps: each within this share of the mean.
BALANCE = 0.10
# dispatch_key: tokens per hash (a job's queue), and each block size's hash multipliers
DISPATCH_BLOCK = 16
_MULTIPLIERS: dict[int, np.ndarray] = {}


def key(ids) -> bytes:
    """The sort key of a prompt's token ids (non-negative ids below 2**32)."""
    return np.asarray(ids, dtype=">u4").tobytes()


def dispatch_key(ids, block: int = DISPATCH_BLOCK) -> bytes:
    """A compact sort key: per whole block of `block` tokens, and for the rest, a 64-bit hash of
    its ids (and, for the rest, its length), big-endian. Equal leading blocks give equal leading
    words, so sorting by it keeps prompts that share blocks together."""
    a = np.asarray(ids, dtype=np.uint64)
    mult = _multipliers(block)
    whole = len(a) // block * block
    rest = len(a) - whole
    with np.errstate(over="ignore"):  # the hash wraps modulo 2**64 on purpose
        words = (a[:whole].reshape(-1, block) * mult[:block]).sum(axis=1, dtype=np.uint64)
        if rest:
            tail = (a[whole:] * mult[:rest]).sum(dtype=np.uint64) + mult[-1] * np.uint64(rest)
            words = np.append(words, tail)
    return words.astype(">u8").tobytes()


def _multipliers(block: int) -> np.ndarray:
    if block not in _MULTIPLIERS:
        rng = np.random.default_rng(20261206 + block)  # fixed: the order is deterministic
        _MULTIPLIERS[block] = rng.integers(1, 2**63, size=block + 1, dtype=np.uint64)
    return _MULTIPLIERS[block]


def tokens(k: bytes) -> int:
    return len(k) // 4


def common_prefix(a: bytes, b: bytes, word: int = 4) -> int:
    """The number of leading words of `word` bytes two keys share (tokens, for `key`s)."""
    n = min(len(a), len(b)) // word
    if a[: word * n] == b[: word * n]:
        return n
    x, y = np.frombuffer(a, f">u{word}", n), np.frombuffer(b, f">u{word}", n)
    return int(np.argmax(x != y))


def reusable(k: bytes, shared: int, block: int) -> int:
    """The tokens of prompt `k` a cache can serve when `shared` leading tokens were computed
    before: never the last token, and only whole blocks of `block` tokens."""
    return _served(tokens(k), shared, block)


def _served(n: int, shared: int, block: int) -> int:
    return min(shared, n - 1) // block * block if n else 0


def trie_order(keys: Sequence) -> list[int]:
    """The positions of `keys` in a depth-first walk of their trie (deterministic)."""
    return sorted(range(len(keys)), key=lambda i: (keys[i], i))


def dispatch_order(items: list, ids=lambda item: item.ids(), window=lambda item: 0) -> list:
    """`items` in the order a job sends them: the trie order of their prompts' dispatch keys, so
    prompts that share a prefix are sent back to back while the engine holds it. Stable (equal
    prompts keep their order). `window(item)`: items are ordered within each window, windows in
    order (a job reads its prompts a few row groups at a time)."""
    keys = [(window(it), dispatch_key(ids(it))) for it in items]
    return [items[i] for i in trie_order(keys)]


@dataclass(frozen=True)
class Ceiling:
    """Of `prompt_tokens` sent, how many a cache that holds every prefix can serve: per token
    (a radix cache) and in whole blocks of `block` tokens."""

    prompt_tokens: int
    per_token: int
    block: int
    per_block: int

    def share(self, of: str) -> float | None:
        n = self.per_token if of == "per_token" else self.per_block
        return round(n / self.prompt_tokens, 6) if self.prompt_tokens else None

    def __add__(self, other: Ceiling) -> Ceiling:
        assert self.block == other.block
        return Ceiling(
            self.prompt_tokens + other.prompt_tokens,
            self.per_token + other.per_token,
            self.block,
            self.per_block + other.per_block,
        )


def ceiling(keys: Iterable[bytes], block: int) -> Ceiling:
    """The ceiling over prompts sent to one engine (one cache), in any order."""
    return _ceiling(((k, tokens(k)) for k in keys), common_prefix, block)


def compact_ceiling(prompts: Iterable[tuple[bytes, int]], block: int) -> Ceiling:
    """The ceiling from compact keys, (dispatch_key(ids), len(ids)) per prompt sent (half a byte
    per token: a whole category fits in memory). Shared prefixes count in whole DISPATCH_BLOCK
    units, so per token it is at most DISPATCH_BLOCK - 1 tokens short per prompt; in blocks of
    a multiple of DISPATCH_BLOCK it is exact (up to 64-bit hash collisions)."""
    if block % DISPATCH_BLOCK:
        raise ValueError(f"block must be a multiple of {DISPATCH_BLOCK}, got {block}")
    return _ceiling(prompts, lambda a, b: common_prefix(a, b, 8) * DISPATCH_BLOCK, block)


def _ceiling(prompts: Iterable[tuple[bytes, int]], shared_tokens, block: int) -> Ceiling:
    """(key, tokens) pairs in trie order, each sharing `shared_tokens(previous, key)` tokens
    with the one before it."""
    total = per_token = per_block = 0
    previous = None
    for k, n in sorted(prompts):
        shared = shared_tokens(previous, k) if previous is not None else 0
        total += n
        per_token += _served(n, shared, 1)
        per_block += _served(n, shared, block)
        previous = k
    return Ceiling(total, per_token, block, per_block)


def compact_keys(ids_column) -> list[tuple[bytes, int]]:
    """(dispatch_key, length) of every prompt of an Arrow list<int32> column."""
    return [
        (dispatch_key(ids.values.to_numpy(zero_copy_only=False)), len(ids)) for ids in ids_column
    ]


def category_and_shards(shards: Iterable[list[tuple[bytes, int]]], block: int):
    """(ceiling over the category, ceiling over its shards: an engine each) of the compact
    keys of the prompts each shard sends."""
    everything: list[tuple[bytes, int]] = []
    sharded = Ceiling(0, 0, block, 0)
    for sent in shards:
        sharded = sharded + compact_ceiling(sent, block)
        everything += sent
    return compact_ceiling(everything, block), sharded


def sharded_ceiling(shards: Iterable[Iterable[bytes]], block: int) -> Ceiling:
    """The ceiling when each group of prompts goes to an engine of its own (a managed job per
    shard, its cache empty at the start)."""
    out = Ceiling(0, 0, block, 0)
    for keys in shards:
        out = out + ceiling(keys, block)
    return out


def affine_shards(keys: Sequence[bytes], n: int, balance: float = BALANCE) -> list[int]:
    """A shard in [0, n) for each key, so that prompts sharing a prefix share a shard: the
    trie order cut into n runs, each cut placed, within `balance` of the mean shard size, where
    the neighbours across it share the fewest tokens (on a tie, the place whose next prompt has
    the smallest hash: content, not position, decides). Deterministic; adding prompts moves few
    others, since a cut stays between the same two prompts while that place stays in its
    window."""
    if n < 1:
        raise ValueError(f"number of shards must be >= 1, got {n}")
    order = trie_order(keys)
    size = len(order)
    shared = [0] + [common_prefix(keys[order[i - 1]], keys[order[i]]) for i in range(1, size)]
    reach = int(balance * size / n / 2)  # each cut moves at most this far: sizes within balance
    cuts = [0]
    for s in range(1, n):
        even = round(s * size / n)
        lo, hi = max(cuts[-1], even - reach), min(size, even + reach)
        cuts.append(
            min(
                range(lo, hi + 1),
                key=lambda c: (_at(shared, c), _mark(keys, order, c), abs(c - even), c),
            )
        )
    cuts.append(size)
    out = [0] * size
    for s in range(n):
        for i in order[cuts[s] : cuts[s + 1]]:
            out[i] = s
    return out


def _mark(keys: Sequence[bytes], order: list[int], c: int) -> bytes:
    """A tie-break between equally good cuts that depends on the prompt after the cut, not on
    its position: a prompt added elsewhere shifts the even cuts, not which one wins."""
    if not 0 < c < len(order):
        return b"\xff" * 8
    return hashlib.blake2b(keys[order[c]], digest_size=8).digest()


def _at(shared: list[int], c: int) -> int:
    return shared[c] if 0 < c < len(shared) else 0
