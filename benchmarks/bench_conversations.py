"""Turn-ordered scheduling (context: regenerated) against independent prompts.

    python benchmarks/bench_conversations.py

A stand-in SGLang server holds every request 1 s; the client runs 256 requests in flight.
(a) independent prompts: N items in one queue (what `context: dataset` does);
(b) the same number of requests as conversations of 1..7 turns (mean 4), each turn queued when
    the previous one is answered and journaled, through the real turn loop
    (generate/conversations.py: Conversations.replay/follow, prefix-exact prompts built from ids,
    the Client's follow hook, the journal).
Prints (b)'s request rate as a fraction of (a)'s (target >= 0.90). No asserts.
"""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fake_sglang  # noqa: E402
import pyarrow as pa  # noqa: E402

from tokenmill import (
    contracts,  # noqa: E402
    engines,  # noqa: E402
)
from tokenmill.engines.launch import free_port  # noqa: E402
from tokenmill.generate import conversations, journal
from tokenmill.generate.client import Client, ClientOptions, Item  # noqa: E402

CONCURRENCY = 256
STOP = 2


def _opts() -> ClientOptions:
    return ClientOptions.with_defaults(
        sampling={"max_new_tokens": 64, "temperature": 0.0}, stop_token_ids=[STOP],
        concurrency=CONCURRENCY, request_timeout_s=60, max_attempts=3,
        backoff_initial_s=0.1, backoff_max_s=1, progress_interval_s=3600,
    )  # fmt: skip


def independent(url: str, n: int, jdir: str) -> float:
    items = [Item(f"p{i}", f"{i:032x}", [1000 + i % 500] + list(range(63))) for i in range(n)]
    with journal.JournalWriter(jdir, "bench", "ind") as w:
        client = Client([url], _opts(), w.append)
        t0 = time.perf_counter()
        stats = asyncio.run(client.run(items))
        wall = time.perf_counter() - t0
    assert stats.done == n and stats.retries == 0
    return wall


def conversation_shard(path: Path, turns: list[int]) -> None:
    """Prefix-exact conversations with turns[c] turns each; first prompts are distinct for up
    to 250,000 conversations (bench_conversation_memory.py uses it too)."""
    rows = []
    for c, t in enumerate(turns):
        prompt = [1000 + c % 500, 1000 + c // 500 % 500, *range(10, 60)]
        rows.append({
            "prompt_id": f"{c:032x}", "prompt_ids": prompt, "num_prompt_tokens": len(prompt),
            "num_turns": t, "prefix_exact": True,
            "turn_segments": [[5, 6, 100 + k, 7] for k in range(t - 1)],
            "tool_call_ids": [None] * t, "messages": "[]", "tools": None,
        })  # fmt: skip
    meta = {contracts.META_CONTEXT: "regenerated", "tokenmill.max_prompt_tokens": "100000"}
    schema = contracts.TOKENIZED_CONVERSATIONS
    contracts.write_table(pa.Table.from_pylist(rows, schema=schema), path, schema, "tokenize", meta)


def turn_ordered(url: str, turns: list[int], jdir: str) -> tuple[float, dict]:
    path = Path(jdir) / "conv.parquet"
    conversation_shard(path, turns)
    api = engines.for_config({"engine": "sglang"})
    convs = conversations.Conversations(path, "fp", "none", [STOP], {}, ".", api.prompt_at_fault)
    sj = journal.ShardJournal(jdir, "bench", "000")
    index = sj.open(None)
    convs.replay(index)
    writer, append = sj.writer(index)
    with writer:
        client = Client([url], _opts(), append, follow=lambda rec: convs.follow(rec, index))
        t0 = time.perf_counter()
        stats = asyncio.run(client.run(convs.pending()))
        wall = time.perf_counter() - t0
    index.close()
    assert stats.done == sum(turns) and stats.retries == 0, (stats.done, sum(turns))
    return wall, convs.counts()


def main() -> int:
    port = free_port()
    proc = fake_sglang.start(port, "--latency", "1.0")
    url = f"http://127.0.0.1:{port}"
    try:
        rng = random.Random(0)
        turns = [rng.randint(1, 7) for _ in range(1024)]
        n = sum(turns)
        with tempfile.TemporaryDirectory() as jdir:
            independent(url, 300, jdir)  # warm-up
            w_ind = independent(url, n, jdir)
        with tempfile.TemporaryDirectory() as jdir:
            w_conv, counts = turn_ordered(url, turns, jdir)
        r_ind, r_conv = n / w_ind, n / w_conv
        print(
            f"1 s server, {CONCURRENCY} in flight, {n} requests: independent prompts "
            f"{r_ind:.1f} req/s; {len(turns)} conversations of 1-7 turns (mean "
            f"{n / len(turns):.2f}) in turn order {r_conv:.1f} req/s -> fraction "
            f"{r_conv / r_ind:.3f} (target >= 0.90); ends {counts['conversation_ends']}"
        )
    finally:
        proc.kill()
        proc.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
