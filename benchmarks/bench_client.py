"""Benchmark of the generate client against a stand-in SGLang server in another process.

    python benchmarks/bench_client.py

(1) client ceiling: an instant server; requests/s and requests/s per client CPU core (client
    CPU time from getrusage of this process only; the server is another process). Target >= 2000.
(2) latency-bound: a server holding every request 1 s at concurrency 256; achieved throughput
    as a fraction of the ideal 256 req/s. Target >= 0.95.
Both runs journal every record exactly as `tokenmill generate` does. Prints figures; no asserts.
"""

from __future__ import annotations

import asyncio
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fake_sglang  # noqa: E402

from tokenmill.engines.launch import free_port  # noqa: E402
from tokenmill.generate import journal  # noqa: E402
from tokenmill.generate.client import Client, ClientOptions, Item  # noqa: E402


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _items(n: int) -> list[Item]:
    return [Item(f"p{i}", f"{i:032x}", [1000 + i % 500] + list(range(63))) for i in range(n)]


def run(url: str, n: int, concurrency: int, jdir: str) -> tuple[float, float]:
    opts = ClientOptions.with_defaults(
        sampling={"max_new_tokens": 64, "temperature": 0.0},
        stop_token_ids=[2],
        concurrency=concurrency,
        request_timeout_s=60,
        max_attempts=3,
        backoff_initial_s=0.1,
        backoff_max_s=1,
        progress_interval_s=3600,
    )
    items = _items(n)
    with journal.JournalWriter(jdir, "bench", f"c{concurrency}") as w:
        client = Client([url], opts, w.append)
        c0, t0 = _cpu(), time.perf_counter()
        stats = asyncio.run(client.run(items))
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    assert stats.done == n and stats.retries == 0
    return wall, cpu


def main() -> int:
    procs = []
    try:
        p_fast, p_slow = free_port(), free_port()
        procs.append(fake_sglang.start(p_fast))
        procs.append(fake_sglang.start(p_slow, "--latency", "1.0"))
        with tempfile.TemporaryDirectory() as jdir:
            run(f"http://127.0.0.1:{p_fast}", 500, 64, jdir)  # warm-up
            n = 10000
            wall, cpu = run(f"http://127.0.0.1:{p_fast}", n, 64, jdir)
            print(
                f"(1) instant server, concurrency 64, {n} requests: {n / wall:.0f} req/s wall, "
                f"client CPU {cpu:.2f}s -> {n / cpu:.0f} req/s per client core "
                f"(target >= 2000; ratio {n / cpu / 2000:.2f})"
            )
            conc, n = 256, 256 * 12
            wall, cpu = run(f"http://127.0.0.1:{p_slow}", n, conc, jdir)
            ideal = conc / 1.0
            print(
                f"(2) 1 s server, concurrency {conc}, {n} requests: {n / wall:.1f} req/s "
                f"of ideal {ideal:.0f} -> fraction {n / wall / ideal:.3f} (target >= 0.95); "
                f"client CPU {cpu:.2f}s"
            )
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
