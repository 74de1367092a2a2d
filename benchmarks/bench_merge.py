"""Benchmark: tokenmill merge (+ validation) against the I/O floor, with peak memory.

    .venv/bin/python benchmarks/bench_merge.py [--samples 100000] [--shards 4] [--repeat 3]
        [--vocab 32000]
    .venv/bin/python benchmarks/bench_merge.py --memory 200,2000 --samples 12000

Builds synthetic tokenized and generated shards (token lengths scaled down to fit a small
machine), then runs, each in its own subprocess so peak RSS is per side, --repeat times in turn:
  merge : merge.merge_shard on every shard as the pipeline runs it (join, sample keys, every
          validation rule, one pass over the inputs, DATASET output + rejected file + the
          shard's loss-token counts for the draft vocabulary);
  floor : what the issue defines: pyarrow reads the two inputs of every shard (all columns) and
          writes the output (the DATASET table merge wrote, loaded before the clock starts) with
          the contracts' writer options (zstd 3): the unavoidable read + compress + write;
  merge+jsonl : merge with the JSONL export;
  merge-counts : merge without the token counts (what counting costs).
With --counting-cost, only merge with and without the counts, alternating in one process.
With --memory N,N,..., only merge's peak RSS for one shard of --samples rows whose outputs have
N tokens on average, generated rows in prompt_id order and shuffled.
Prints the median wall time of each side, throughput (samples/s, tokens/s), the merge/floor
ratio (target <= 2x), each side's CPU seconds (all threads of the process; merge's writer
thread overlaps its next batch, so its CPU time exceeds its wall time on an idle machine), and
each side's peak RSS next to the size of one shard and of the whole dataset in memory. Each
side starts its clock after pyarrow's lazy pandas import (a fixed cost per process, which both
would otherwise pay differently).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill import contracts, keys
from tokenmill.dataset import export, merge, validate

GEN_CFG = {"model": "bench", "sampling": {"max_new_tokens": 256}, "stop_tokens": [2]}
VOCAB = 32000  # --vocab; ids are uniform in [10, VOCAB): every id is seen, the densest counts


def _lists(rng, n, lo, hi, tail=None, vocab=VOCAB):
    lengths = rng.integers(lo, hi, n)
    off = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=off[1:])
    vals = rng.integers(10, vocab, int(off[-1])).astype(np.int32)
    if tail is not None:
        vals[off[1:] - 1] = tail
    return off, vals


def build(
    directory: Path,
    samples: int,
    shards: int,
    vocab: int = VOCAB,
    output_tokens: int | None = None,
    shuffle: bool = True,
) -> int:
    """Shards of synthetic inputs; outputs of 16-111 tokens, or of output_tokens/2 to
    3*output_tokens/2 (mean output_tokens) when given. `shuffle`: generated rows in a random
    order (the default, the harder case for the join), else in prompt_id order (as generate
    writes them)."""
    rng = np.random.default_rng(0)
    fp = keys.generation_fingerprint(GEN_CFG)
    tokens = 0
    per = samples // shards
    for s in range(shards):
        pids = np.array([f"{s:03d}-{i:07d}" for i in range(per)], dtype=object)
        p_off, p_val = _lists(rng, per, 16, 112, vocab=vocab)
        n = output_tokens
        o_lo, o_hi = (n // 2, n * 3 // 2) if n else (16, 112)
        o_off, o_val = _lists(rng, per, o_lo, o_hi, tail=2, vocab=vocab)
        tokens += len(p_val) + len(o_val)
        sample_keys = [keys.sample_key(fp, p_val[p_off[i] : p_off[i + 1]]) for i in range(per)]
        prompt_ids = pa.ListArray.from_arrays(pa.array(p_off.astype(np.int32)), pa.array(p_val))
        output_ids = pa.ListArray.from_arrays(pa.array(o_off.astype(np.int32)), pa.array(o_val))
        tok = pa.table(
            {
                "prompt_id": pa.array(pids, pa.string()),
                "prompt_ids": prompt_ids,
                "num_prompt_tokens": pa.array(np.diff(p_off).astype(np.int32)),
            }
        )
        contracts.write_table(tok, directory / f"tok{s:03d}.parquet", contracts.TOKENIZED, "t")
        # generated rows arrive in completion order, not prompt_id order
        order = rng.permutation(per) if shuffle else np.arange(per)
        finish = np.where(rng.random(per) < 0.02, "length", "stop").astype(object)
        gen = pa.table(
            {
                "prompt_id": pa.array(pids, pa.string()),
                "sample_key": pa.array(sample_keys, pa.string()),
                "output_ids": output_ids,
                "finish_type": pa.array(finish, pa.string()),
                "finish_matched_id": pa.array([2] * per, pa.int64()),
                "finish_matched_str": pa.array([None] * per, pa.string()),
                "prompt_tokens": pa.array(np.diff(p_off).astype(np.int32)),
                "completion_tokens": pa.array(np.diff(o_off).astype(np.int32)),
                "cached_tokens": pa.array([0] * per, pa.int32()),
                "latency_s": pa.array([1.0] * per),
                "server": pa.array(["s"] * per),
                "weight_version": pa.array(["w"] * per),
            }
        ).take(pa.array(order))
        contracts.write_table(gen, directory / f"gen{s:03d}.parquet", contracts.GENERATED, "g")
    return tokens


def run_side(side: str, directory: Path, shards: int, vocab: int = VOCAB) -> dict:
    out = directory / side
    out.mkdir(exist_ok=True)
    # pyarrow imports pandas on its first to_numpy() (~0.2 s, once per process, not per token):
    # done before either side's clock starts.
    pa.array([0]).to_numpy()
    t0, c0 = time.perf_counter(), time.process_time()
    if side == "floor":
        wall = cpu = 0.0
        for s in range(shards):
            # The output as merge built it, loaded outside the clock: the floor writes it.
            output = pq.ParquetFile(directory / "merge" / f"{s:03d}.parquet").read()
            t0, c0 = time.perf_counter(), time.process_time()
            pq.ParquetFile(directory / f"tok{s:03d}.parquet", memory_map=True).read()
            pq.ParquetFile(directory / f"gen{s:03d}.parquet", memory_map=True).read()
            pq.write_table(
                output,
                out / f"{s:03d}.parquet",
                row_group_size=contracts.ROW_GROUP_SIZE,
                **contracts.WRITER_OPTIONS,
            )
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            del output
    else:
        rules = validate.Rules(vocab_size=vocab, stop_ids=(2,), think_end_id=5)
        fp = keys.generation_fingerprint(GEN_CFG)
        for s in range(shards):
            merge.merge_shard(
                directory / f"tok{s:03d}.parquet",
                directory / f"gen{s:03d}.parquet",
                out / f"{s:03d}.parquet",
                out / f"rej{s:03d}.parquet",
                rules,
                fp,
                "bench",
                f"{s:03d}",
                counts_out=None if side == "merge-counts" else out / f"counts{s:03d}.parquet",
            )
            if side == "merge+jsonl":
                export.export_jsonl(out / f"{s:03d}.parquet", out / f"{s:03d}.jsonl")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"side": side, "wall_s": wall, "cpu_s": cpu, "peak_rss_mb": peak_rss_mib()}


def peak_rss_mib() -> float:
    """This process's peak RSS: VmHWM, the high-water mark of its own address space. Not
    ru_maxrss: Linux carries that over from the parent through fork and exec, so a side
    started by a parent that holds the built shards reported the parent's size (the merge
    figures of issue 19 item 6, 574 and 974 MiB, were partly this bench's own memory)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def counting_cost(directory: Path, shards: int, vocab: int, repeat: int) -> None:
    """Merge with and without the token counts, alternating in one process: on a busy machine
    the minimum of paired runs shows what counting costs when the side-by-side ratio cannot."""
    rules = validate.Rules(vocab_size=vocab, stop_ids=(2,), think_end_id=5)
    fp = keys.generation_fingerprint(GEN_CFG)
    pa.array([0]).to_numpy()
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(repeat):
        for counts in (True, False):
            t0, c0 = time.perf_counter(), time.process_time()
            for s in range(shards):
                merge.merge_shard(
                    directory / f"tok{s:03d}.parquet",
                    directory / f"gen{s:03d}.parquet",
                    directory / f"out{s:03d}.parquet",
                    directory / f"rej{s:03d}.parquet",
                    rules,
                    fp,
                    "bench",
                    f"{s:03d}",
                    counts_out=directory / f"counts{s:03d}.parquet" if counts else None,
                )
            times[counts].append((time.perf_counter() - t0, time.process_time() - c0))
    for counts, runs in times.items():
        wall, cpu = sorted(r[0] for r in runs), sorted(r[1] for r in runs)
        print(
            f"merge {'with' if counts else 'without':<7} counts: wall min {wall[0]:.3f} s, "
            f"median {np.median(wall):.3f} s; CPU min {cpu[0]:.3f} s, median {np.median(cpu):.3f} s"
        )
    extra = min(r[1] for r in times[True]) / min(r[1] for r in times[False]) - 1
    print(f"counting adds {extra:+.1%} CPU (minimum of {repeat} paired runs)")


def memory(samples: int, output_tokens: list[int], vocab: int) -> None:
    """Peak RSS of merge (one shard, its own subprocess) at each output length, generated rows
    in prompt_id order (as generate writes them) and shuffled; the ratio to the first length."""
    print(f"merge peak RSS, one shard of {samples:,} rows, outputs of N/2 to 3N/2 tokens")
    print(f"{'order':<9} {'N':>6} {'tokens':>12} {'peak RSS MiB':>13} {'x first N':>10}")
    for shuffle in (False, True):
        first = None
        for n in output_tokens:
            with tempfile.TemporaryDirectory(prefix="bench_merge.") as tmp:
                tokens = build(Path(tmp), samples, 1, vocab, output_tokens=n, shuffle=shuffle)
                cmd = [sys.executable, __file__, "--side", "merge", "--dir", tmp, "--shards", "1"]
                cmd += ["--vocab", str(vocab)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
            rss = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]
            first = first or rss
            order = "shuffled" if shuffle else "sorted"
            print(f"{order:<9} {n:>6} {tokens:>12,} {rss:>13.0f} {rss / first:>9.2f}x", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3, help="runs per side; medians printed")
    parser.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary size of the ids")
    parser.add_argument(
        "--counting-cost",
        action="store_true",
        help="only: merge with and without the token counts, --repeat paired runs in one process",
    )
    parser.add_argument(
        "--memory",
        metavar="N,N,...",
        help="only: merge peak RSS for one shard of --samples rows at each output length N",
    )
    parser.add_argument("--side")
    parser.add_argument("--dir")
    args = parser.parse_args()
    if args.side:  # child process
        print(json.dumps(run_side(args.side, Path(args.dir), args.shards, args.vocab)))
        return 0
    if args.memory:
        memory(args.samples, [int(n) for n in args.memory.split(",")], args.vocab)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_merge.") as tmp:
        d = Path(tmp)
        t0 = time.perf_counter()
        tokens = build(d, args.samples, args.shards, args.vocab)
        if args.counting_cost:
            counting_cost(d, args.shards, args.vocab, args.repeat)
            return 0
        samples = args.samples // args.shards * args.shards
        print(
            f"input: {samples:,} samples in {args.shards} shards, {tokens:,} tokens "
            f"(prompt 16-111, output 16-111 tokens each, vocabulary {args.vocab:,}; built in "
            f"{time.perf_counter() - t0:.1f}s)"
        )
        in_mem = tokens * 4 / 2**20
        print(
            f"tokens in memory as int32: whole dataset {in_mem:.0f} MiB, "
            f"one shard {in_mem / args.shards:.0f} MiB"
        )
        runs: dict[str, list[dict]] = {
            "floor": [],
            "merge": [],
            "merge+jsonl": [],
            "merge-counts": [],
        }
        for _ in range(args.repeat):
            # merge first: the floor writes the output merge wrote
            for side in ("merge", "floor", "merge+jsonl", "merge-counts"):
                cmd = [sys.executable, __file__, "--side", side, "--dir", tmp]
                cmd += ["--shards", str(args.shards), "--vocab", str(args.vocab)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
                runs[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        res = {
            side: {
                "wall_s": float(np.median([r["wall_s"] for r in rs])),
                "cpu_s": float(np.median([r["cpu_s"] for r in rs])),
                "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
            }
            for side, rs in runs.items()
        }  # fmt: skip
        floor = res["floor"]["wall_s"]
        ratios = [
            m["wall_s"] / f["wall_s"] for m, f in zip(runs["merge"], runs["floor"], strict=True)
        ]
        print(f"median of {args.repeat} runs per side; merge/floor per run: "
              + ", ".join(f"{r:.2f}x" for r in ratios))  # fmt: skip
        print(
            f"{'side':<12} {'wall s':>8} {'samples/s':>11} {'tokens/s':>12} {'x floor':>8} "
            f"{'CPU s':>7} {'CPU x floor':>12} {'peak RSS MiB':>13}"
        )
        for side, r in res.items():
            print(
                f"{side:<12} {r['wall_s']:>8.2f} {samples / r['wall_s']:>11,.0f} "
                f"{tokens / r['wall_s']:>12,.0f} {r['wall_s'] / floor:>8.2f} "
                f"{r['cpu_s']:>7.2f} {r['cpu_s'] / res['floor']['cpu_s']:>12.2f} "
                f"{r['peak_rss_mb']:>13.0f}"
            )
        ratio = res["merge"]["wall_s"] / floor
        cpu_ratio = res["merge"]["cpu_s"] / res["floor"]["cpu_s"]
        print(
            f"merge / floor = {ratio:.2f}x (target <= 2x): {'OK' if ratio <= 2 else 'ABOVE'}; "
            f"in CPU seconds {cpu_ratio:.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
