"""Benchmark: tokenmill tokenize (the whole stage) against the tokenization floor.

    /work/main/.venv/bin/python benchmarks/bench_tokenize.py [--prompts 20000] [--shards 8]
        [--processes 1 2] [--shard-by prompt_id prefix] [--repeat 1]

Builds a deterministic synthetic prompts file (multi-turn conversations, tools on every third
one) for the tiny Kimi-shaped tokenizer, then times, best of --repeat (runs interleaved):
  floor : render every chat template (tokenize=False) and batch-encode the rendered texts
          with the fast tokenizer (ids only, no attention masks), in memory: no Parquet,
          no sharding, no rejections;
  stage : tok_stage.tokenize_category end to end (load the tokenizer, fingerprint, read the
          prompts Parquet by batches, encode, shard, spill, write every shard + rejected file)
          with each --processes value (1: in process, Rust batch encode on all cores and a
          thread that shards and writes; K > 1: K spawned processes, each encoding serially),
          and each --shard-by value (prefix: every kept row spilled, then placed by
          prefix_reuse.affine_shards; tokenization/shards.py).
Prints wall time, prompts/s, tokens/s and stage/floor (target <= 1.5x), and CPU seconds (all
threads, and worker processes) as a check that is less sensitive to a busy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import pyarrow as pa  # noqa: E402

from tokenmill import contracts  # noqa: E402
from tokenmill.prepare import stage as prepare_stage  # noqa: E402
from tokenmill.prepare.formats import prompt_id  # noqa: E402
from tokenmill.testing.tiny_model import build_tiny_tokenizer  # noqa: E402
from tokenmill.tokenization import stage as tok_stage  # noqa: E402
from tokenmill.tokenization.tokenizer import load_tokenizer  # noqa: E402

_TEXT = (
    "the quick brown fox jumps over lazy dog a user asks question and assistant answers "
    "def add return print import json with open data for in range class self items "
    "Paris France capital weather search query result function call tool 42 3.14 sum mean"
)
WORDS = _TEXT.split(" ")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name.replace('_', ' ')} for the user",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for name in ("get_weather", "search_web", "run_code")
]


def conversations(n: int, seed: int = 0) -> list[tuple[list, list | None]]:
    rng = random.Random(seed)

    def text(lo, hi):
        return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))

    convs = []
    for i in range(n):
        messages = [{"role": "system", "content": text(5, 20)}] if i % 5 == 0 else []
        tools = TOOLS[: 1 + i % 3] if i % 3 == 0 else None
        for turn in range(rng.randint(1, 4)):
            messages.append({"role": "user", "content": text(10, 120)})
            if tools and turn == 0:
                name = tools[0]["function"]["name"]
                call = {"type": "function", "function": {"name": name, "arguments": {"q": 1}}}
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                messages.append({"role": "tool", "content": text(5, 40)})
            messages.append({"role": "assistant", "content": text(10, 80)})
        messages.pop()  # the prompt ends before the assistant turn to regenerate
        convs.append((messages, tools))
    return convs


def write_prompts(path: Path, convs) -> list[tuple[list, list | None]]:
    """Write the prompts file as prepare would; returns the conversations as the stage sees them."""
    rows = {}
    for i, (messages, tools) in enumerate(convs):
        pid = prompt_id(messages, tools)
        rows[pid] = prepare_stage.prompt_row(pid, f"bench:{i}", messages, tools)
    ordered = [rows[p] for p in sorted(rows)]
    table = pa.Table.from_pylist(ordered, schema=contracts.PROMPTS)
    contracts.write_table(table, path, contracts.PROMPTS, "prepare")
    return [
        (json.loads(r["messages"]), json.loads(r["tools"]) if r["tools"] else None) for r in ordered
    ]


def floor(tok, convs, kwargs, chunk: int) -> int:
    tokens = 0
    for i in range(0, len(convs), chunk):
        texts = [
            tok.apply_chat_template(
                m, tools=t, add_generation_prompt=True, tokenize=False, **kwargs
            )
            for m, t in convs[i : i + chunk]
        ]
        ids = tok(
            texts,
            add_special_tokens=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]
        tokens += sum(len(x) for x in ids)
    return tokens


def timed(fn):
    """(result, wall s, CPU s of this process's threads and of reaped child processes)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child_cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    return result, time.perf_counter() - wall, time.process_time() - cpu + child_cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=20000)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--shard-by", nargs="+", default=["prompt_id", "prefix"], choices=["prompt_id", "prefix"]
    )
    parser.add_argument("--repeat", type=int, default=1, help="best of N, runs interleaved")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_tokenize_") as tmp:
        tmp = Path(tmp)
        tok_dir = tmp / "tokenizer"
        build_tiny_tokenizer(tok_dir, template="kimi")
        kwargs = {"thinking": True}
        cfg = {"path": str(tok_dir), "revision": None, "trust_remote_code": False,
               "chat_template": None, "chat_template_kwargs": kwargs}  # fmt: skip
        prompts = tmp / "prompts.parquet"
        convs = write_prompts(prompts, conversations(args.prompts))
        n = len(convs)
        tok = load_tokenizer(cfg)
        floor(tok, convs[:64], kwargs, tok_stage.CHUNK_ROWS)  # warm up the template cache
        load_before = os.getloadavg()[0]

        best: dict[str, tuple[float, float]] = {}
        tokens = None
        for r in range(args.repeat):
            tokens, wall, cpu = timed(lambda: floor(tok, convs, kwargs, tok_stage.CHUNK_ROWS))
            best["floor"] = min(best.get("floor", (wall, cpu)), (wall, cpu))
            for procs in args.processes:
                for by in args.shard_by:
                    out = tmp / f"out_{procs}_{by}_{r}"
                    rejected = tmp / f"rejected_{procs}_{by}_{r}.parquet"
                    summary, wall, cpu = timed(
                        lambda out=out, rejected=rejected, procs=procs, by=by: (
                            tok_stage.tokenize_category(
                                prompts, "bench", args.shards, cfg, 1_000_000, out, rejected,
                                workers=procs, shard_by=by,
                            )
                        )
                    )  # fmt: skip
                    if summary.prompt_tokens != tokens or summary.kept != n:
                        print(f"MISMATCH: stage {summary.as_dict()} vs floor {tokens} tokens")
                        return 1
                    key = f"stage p={procs} {by}"
                    best[key] = min(best.get(key, (wall, cpu)), (wall, cpu))

        cores = len(os.sched_getaffinity(0))
        print(f"cores: {cores}  prompts: {n}  prompt tokens: {tokens} ({tokens / n:.0f}/prompt)  "
              f"shards: {args.shards}  best of {args.repeat}  load average: "
              f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}")  # fmt: skip
        head = ["seconds", "prompts/s", "tokens/s", "x floor", "CPU s", "CPU x floor"]
        print(f"{'':<24}" + "".join(f"{h:>12}" for h in head))
        floor_wall, floor_cpu = best["floor"]
        for key, (wall, cpu) in best.items():
            cells = [wall, n / wall, tokens / wall, wall / floor_wall, cpu, cpu / floor_cpu]
            fmts = [".2f", ".0f", ".0f", ".2f", ".2f", ".2f"]
            print(f"{key:<24}" + "".join(f"{c:>12{f}}" for c, f in zip(cells, fmts, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
