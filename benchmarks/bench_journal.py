"""Benchmark: a generate job's journal replay, journal size and memory as the data grows.

    python benchmarks/bench_journal.py [--shards 16] [--samples 20000] [--tokens 500]
                                       [--gen-prompts 10000] [--repeat 3]

Every run is `tokenmill generate` in its own process (external mode: the stand-in server is
another process started here). Its peak RSS is its own VmHWM, read by the process as it exits
(a child's ru_maxrss would include this process's RSS at the time it was spawned).

(1) Replay follows the shard. A category of --shards shards x --samples samples x --tokens
    output tokens is journaled directly (JSONL lines exactly as the client writes them); one
    shard's job then runs with nothing left to generate (the server URL is dead: starting to
    generate would fail the job), with only its own shard journaled vs all shards journaled,
    both before compaction (JSONL) and after it (every shard's compacted Parquet file: the
    other shards' files are copies of this shard's, same size). Prints the job's replay time,
    its whole time (replay + writing the shard from the journal) and peak RSS, and the
    all/one ratios (target <= 1.2). For reference: the time to scan every JSONL file of the
    category, which every job paid before the journal was sharded.
(2) Journal bytes on disk per byte of the generated shard, before and after compaction.
(3) Memory follows a batch: jobs that generate --gen-prompts samples through an instant
    stand-in server at 200 and at 2,000 output tokens; peak RSS, bytes per output token and the
    job's start-up (process start to the first request: imports, keys, replay, server checks).
(4) Start-up with string stop tokens (needs sample/model): ids read from the tokenized shard's
    metadata vs the tokenizer loaded in the job (transformers imported), one prompt each.
Prints figures; no asserts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fake_sglang  # noqa: E402

from tokenmill import contracts, keys  # noqa: E402
from tokenmill.engines.launch import free_port  # noqa: E402
from tokenmill.generate import journal  # noqa: E402
from tokenmill.tokenization import shards  # noqa: E402
from tokenmill.tokenization import stage as tokenize_stage  # noqa: E402

VOCAB = 150_000
CATEGORY = "bench"


def gen_config(url: str, stop_tokens=(2,)) -> dict:
    return {
        "engine": "sglang",
        "mode": "external",
        "model": "fake/model",
        "revision": None,
        "launch": {},
        "external": {"urls": [url]},
        "api_key_env": None,
        "sampling": {"max_new_tokens": 4096, "temperature": 0.0},
        "stop_tokens": list(stop_tokens),
        "seed_policy": "none",
        "concurrency": 64,
        "request_timeout_s": 600,
        "retry": {"max_attempts": 3, "backoff_initial_s": 0.1, "backoff_max_s": 1.0},
        "progress_interval_s": 3600,
    }


def prompts_of_shard(shard: int, n_shards: int, n: int, mean_tokens: int, seed: int):
    """n hex prompt_ids that hash to `shard` (like prepare's) with random prompt ids."""
    rng = np.random.default_rng(seed)
    pids, i = [], 0
    while len(pids) < n:
        pid = hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()[:32]
        if shards.shard_of(pid, n_shards) == shard:
            pids.append(pid)
        i += 1
    pids.sort()
    lengths = rng.integers(1, 2 * mean_tokens, n)
    values = rng.integers(10, VOCAB, int(lengths.sum())).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return pids, offsets, values


def write_tokenized(path: Path, pids, offsets, values, n_shards: int, shard: int, extra=None):
    table = pa.table(
        {
            "prompt_id": pa.array(pids, pa.string()),
            "prompt_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
            "num_prompt_tokens": pa.array(np.diff(offsets).astype(np.int32)),
        },
        schema=contracts.TOKENIZED,
    )
    meta = {
        tokenize_stage.META_NUM_SHARDS: str(n_shards),
        contracts.META_CATEGORY: CATEGORY,
        contracts.META_SHARD: shards.shard_name(shard),
    }
    meta.update(extra or {})
    # Row groups cut as `tokenmill tokenize` cuts them (rows or tokens, whichever first).
    with contracts.ParquetWriter(path, contracts.TOKENIZED, "tokenize", meta) as writer:
        buf = contracts.RowGroupBuffer(writer.write, "prompt_ids")
        buf.add(table)
        buf.finish()


def _line(body: bytes) -> bytes:
    return body + b"\t" + f"{zlib.crc32(body):08x}".encode() + b"\n"


def _record_body(key: str, pid: str, out_json: bytes, n_out: int, n_prompt: int) -> bytes:
    # The client's record, field for field (see generate/client.py and engines/sglang.py).
    return (
        b'{"key":"%s","status":"ok","prompt_id":"%s","output_ids":%s,"finish_type":"stop",'
        b'"finish_matched_id":2,"finish_matched_str":null,"finish_message":null,'
        b'"prompt_tokens":%d,"completion_tokens":%d,"cached_tokens":0,"latency_s":1.234,'
        b'"weight_version":"default","server":"http://127.0.0.1:30000","attempts":1}'
        % (key.encode(), pid.encode(), out_json, n_prompt, n_out)
    )


def journal_shard(jdir: Path, shard: int, pids, offsets, values, fp, tokens, rng, pool=None):
    """One attempt file holding every sample of the shard (outputs of `tokens` +- 50%)."""
    d = jdir / CATEGORY
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{shards.shard_name(shard)}.bench.1.{shard}.jsonl"
    with open(path, "wb", buffering=1 << 20) as f:
        for i, pid in enumerate(pids):
            ids = values[offsets[i] : offsets[i + 1]]
            if pool is None:
                n = int(rng.integers(tokens // 2, tokens * 3 // 2))
                out = rng.integers(10, VOCAB, n).tolist() + [2]
                out_json = json.dumps(out, separators=(",", ":")).encode()
            else:
                out_json, n = pool[i % len(pool)]
            key = keys.sample_key(fp, ids)
            f.write(_line(_record_body(key, pid, out_json, n + 1, len(ids))))
    return path


def link_copy(src: Path, dst: Path) -> None:
    """A copy of a journal in which every file is a hard link: compaction only renames and
    deletes files (never writes one in place), so the source stays as it was."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, copy_function=os.link)


# `tokenmill ...` that writes its own peak RSS (VmHWM, KiB) to argv[1] as it exits.
WITH_PEAK_RSS = """
import atexit, sys
def peak():
    with open("/proc/self/status") as f:
        kib = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(sys.argv[1], "w") as f:
        f.write(kib)
atexit.register(peak)
from tokenmill.cli import main
sys.exit(main(sys.argv[2:]))
"""


def run_job(work: Path, tokenized: Path, jdir: Path, gen: dict, shard: int, env=None) -> dict:
    (work / "gen.json").write_text(json.dumps(gen))
    (work / "tok.json").write_text(json.dumps({"path": "sample/model"}))
    argv = [
        sys.executable, "-c", WITH_PEAK_RSS, str(work / "peak_kib"), "generate",
        "--generation-config", str(work / "gen.json"), "--tokenizer-config", str(work / "tok.json"),
        "--category", CATEGORY, "--shard", shards.shard_name(shard),
        "--tokenized", str(tokenized), "--out", str(work / "g.parquet"),
        "--rejected", str(work / "r.parquet"), "--meta", str(work / "m.json"),
        "--journal-dir", str(jdir), "--log-dir", str(work / "logs"), "--basedir", str(ROOT),
    ]  # fmt: skip
    log = open(work / "generate.log", "wb")  # noqa: SIM115
    t0, c0 = time.perf_counter(), _children_cpu()
    rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    log.close()
    if rc != 0:
        raise RuntimeError((work / "generate.log").read_text()[-3000:])
    meta = json.loads((work / "m.json").read_text())
    peak = int((work / "peak_kib").read_text()) / 1024
    meta["bench"] = {"wall_s": wall, "cpu_s": cpu, "peak_rss_mib": peak}
    return meta


def _children_cpu() -> float:
    """CPU seconds of the waited-for children (the job alone: the server is not its child)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _med(xs):
    return statistics.median(xs)


def part_replay(tmp: Path, a) -> None:
    n_shards, n, tokens = a.shards, a.samples, a.tokens
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: generating would fail
    gen = gen_config(dead)
    fp = keys.generation_fingerprint(gen)
    rng = np.random.default_rng(1)
    t = time.perf_counter()
    pids, off, vals = prompts_of_shard(0, n_shards, n, a.prompt_tokens, seed=0)
    tokenized = tmp / "tokenized-000.parquet"
    write_tokenized(tokenized, pids, off, vals, n_shards, 0)
    one = tmp / "journal-one"
    journal.ensure_layout(one, CATEGORY, n_shards)  # as the jobs that journaled would have
    own = journal_shard(one, 0, pids, off, vals, fp, tokens, rng)
    pool = []
    for _ in range(64):
        k = int(rng.integers(tokens // 2, tokens * 3 // 2))
        out = rng.integers(10, VOCAB, k).tolist() + [2]
        pool.append((json.dumps(out, separators=(",", ":")).encode(), k))
    everything = tmp / "journal-all"
    link_copy(one, everything)
    for s in range(1, n_shards):
        p, o, v = prompts_of_shard(s, n_shards, n, 16, seed=s)  # short prompts: keys only
        journal_shard(everything, s, p, o, v, fp, tokens, rng, pool)
    all_bytes = sum(f.stat().st_size for f in (everything / CATEGORY).iterdir())
    print(
        f"built: {n_shards} shards x {n} samples x ~{tokens} output tokens "
        f"({n_shards * n * tokens / 1e6:.0f} M tokens), journal {all_bytes / 2**20:.0f} MiB "
        f"of JSONL, shard 000's {own.stat().st_size / 2**20:.0f} MiB, "
        f"in {time.perf_counter() - t:.0f} s"
    )

    # The old cost: every job scanned every file of the category.
    t = time.perf_counter()
    idx = journal.Index({keys.sample_key(fp, vals[off[i] : off[i + 1]]) for i in range(n)})
    for path in sorted((everything / CATEGORY).glob("*.jsonl")):
        idx.add_jsonl(path)
    scan_all = time.perf_counter() - t
    t = time.perf_counter()
    idx = journal.Index(set(idx.entries))
    idx.add_jsonl(own)
    scan_own = time.perf_counter() - t

    results: dict[str, list[dict]] = {}
    work = tmp / "work"
    work.mkdir()
    generated_bytes = None
    for state in ("jsonl", "compacted"):
        if state == "compacted":
            # Compacted journals: run shard 000 once on each, then give the other shards
            # compacted files of the same size.
            for src in (one, everything):
                run_job(work, tokenized, src, gen, 0)
            for s in range(1, n_shards):
                (everything / CATEGORY / f"{s:03d}.bench.1.{s}.jsonl").unlink()
                os.link(
                    everything / CATEGORY / "000.parquet",
                    everything / CATEGORY / f"{s:03d}.parquet",
                )
        for rep in range(a.repeat):
            for label, src in (("one", one), ("all", everything)):
                jdir = tmp / "journal-run"
                link_copy(src, jdir)
                m = run_job(work, tokenized, jdir, gen, 0)
                assert not m["engine_started"] and m["counts"]["from_journal"] == n, m["counts"]
                read = m["journal"]["files_read"]
                assert all(f.startswith("000.") for f in read), read
                results.setdefault(f"{state}-{label}", []).append(m)
                if state == "jsonl" and label == "one" and rep == 0:
                    generated_bytes = (work / "g.parquet").stat().st_size
                    before = own.stat().st_size
                    after = sum(
                        f.stat().st_size for f in (jdir / CATEGORY).iterdir()
                        if f.suffix in (".jsonl", ".parquet")
                    )  # fmt: skip
        shutil.rmtree(tmp / "journal-run", ignore_errors=True)

    print(f"\n(1) one shard's job ({n} samples, nothing to generate), median of {a.repeat}:")
    print(
        "    journal   | journaled | replay (wall) | job (wall) | job (CPU) | peak RSS | files read"
    )
    cols = {
        "replay": lambda m: m["timing"]["replay_s"],
        "wall": lambda m: m["timing"]["total_s"],
        "cpu": lambda m: m["bench"]["cpu_s"],
        "rss": lambda m: m["bench"]["peak_rss_mib"],
    }
    for state in ("jsonl", "compacted"):
        med = {
            label: {c: _med([f(m) for m in results[f"{state}-{label}"]]) for c, f in cols.items()}
            for label in ("one", "all")
        }
        for label in ("one", "all"):
            x, m0 = med[label], results[f"{state}-{label}"][0]
            print(
                f"    {state:<9} | {('1 shard' if label == 'one' else f'{n_shards} shards'):>9} | "
                f"{x['replay']:>11.2f} s | {x['wall']:>8.2f} s | {x['cpu']:>7.2f} s | "
                f"{x['rss']:>4.0f} MiB | {len(m0['journal']['files_read'])} "
                f"({m0['journal']['bytes_read'] / 2**20:.0f} MiB)"
            )  # fmt: skip
        ratio = {c: med["all"][c] / med["one"][c] for c in cols}
        print(
            f"    {state}: all/one: replay {ratio['replay']:.2f}, job wall {ratio['wall']:.2f}, "
            f"job CPU {ratio['cpu']:.2f}, peak RSS {ratio['rss']:.2f} (target <= 1.2)"
        )
    print(
        f"    reference, the index scan of the JSONL files: this shard's file {scan_own:.2f} s, "
        f"every file of the category (what each job read before) {scan_all:.2f} s "
        f"({scan_all / scan_own:.1f}x)"
    )
    print(
        f"\n(2) journal bytes per generated byte (shard 000, generated shard "
        f"{generated_bytes / 2**20:.1f} MiB): JSONL before compaction "
        f"{before / generated_bytes:.2f}, compacted {after / generated_bytes:.2f}"
    )


def part_memory(tmp: Path, a) -> None:
    print(f"\n(3) jobs generating {a.gen_prompts} samples through an instant stand-in server:")
    print("    output tokens | job total | generation | start-up | peak RSS | bytes/output token")
    for length in (200, 2000):
        port = free_port()
        server = fake_sglang.start(port, "--output-len", str(length - 1))
        try:
            gen = gen_config(f"http://127.0.0.1:{port}")
            pids, off, vals = prompts_of_shard(0, 16, a.gen_prompts, a.prompt_tokens, seed=7)
            work = tmp / f"mem-{length}"
            work.mkdir()
            tokenized = work / "t.parquet"
            write_tokenized(tokenized, pids, off, vals, 16, 0)
            m = run_job(work, tokenized, work / "journal", gen, 0)
        finally:
            server.kill()
            server.wait()
        t, out = m["timing"], m["counts"]["output_tokens"]
        print(
            f"    {length:>13} | {t['total_s']:>7.1f} s | {t['generation_s']:>8.1f} s | "
            f"{t['startup_s']:>6.2f} s | {m['bench']['peak_rss_mib']:>4.0f} MiB | "
            f"{m['bench']['peak_rss_mib'] * 2**20 / out:>8.1f}  ({out / 1e6:.1f} M tokens, "
            f"{m['rates']['output_tokens_per_s']:.0f} tokens/s in the generation window)"
        )


def part_startup(tmp: Path, a) -> None:
    if not (ROOT / "sample" / "model" / "tokenizer.json").is_file():
        print("\n(4) skipped: sample/model is not in this checkout")
        return
    from tokenmill.tokenization.tokenizer import load_tokenizer, resolve_token_ids

    stop = ["<|im_end|>"]
    ids = resolve_token_ids(load_tokenizer({"path": "sample/model"}, ROOT), stop)
    port = free_port()
    server = fake_sglang.start(port)
    rows = {}
    try:
        gen = gen_config(f"http://127.0.0.1:{port}", stop_tokens=stop)
        pids, off, vals = prompts_of_shard(0, 1, 1, 64, seed=3)
        for label, extra in (
            ("ids in the shard's metadata", {
                tokenize_stage.META_STOP_TOKENS: json.dumps(stop),
                tokenize_stage.META_STOP_TOKEN_IDS: json.dumps(ids),
            }),
            ("tokenizer loaded in the job", {}),
        ):  # fmt: skip
            times = []
            for rep in range(a.repeat):
                work = tmp / f"start-{len(rows)}-{rep}"
                work.mkdir()
                write_tokenized(work / "t.parquet", pids, off, vals, 1, 0, extra)
                env = dict(os.environ, HF_HUB_OFFLINE="1")
                m = run_job(work, work / "t.parquet", work / "journal", gen, 0, env=env)
                times.append(m)
            rows[label] = times
    finally:
        server.kill()
        server.wait()
    print("\n(4) start-up with string stop tokens (one prompt), median:")
    for label, ms in rows.items():
        print(
            f"    {label:<28}: process start to first request "
            f"{_med([m['timing']['startup_s'] for m in ms]):.2f} s (imports "
            f"{_med([m['timing']['imports_s'] for m in ms]):.2f} s), peak RSS "
            f"{_med([m['bench']['peak_rss_mib'] for m in ms]):.0f} MiB, stop ids from "
            f"{ms[0]['stop_token_ids_from']}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, default=16)
    p.add_argument("--samples", type=int, default=20000, help="samples per shard")
    p.add_argument("--tokens", type=int, default=500, help="mean output tokens")
    p.add_argument("--prompt-tokens", type=int, default=845, help="mean prompt tokens")
    p.add_argument("--gen-prompts", type=int, default=10000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--parts", default="1,3,4", help="which parts to run (2 comes with 1)")
    a = p.parse_args()
    parts = set(a.parts.split(","))
    with tempfile.TemporaryDirectory(prefix="bench-journal-") as d:
        tmp = Path(d)
        if "1" in parts:
            part_replay(tmp, a)
        if "3" in parts:
            part_memory(tmp, a)
        if "4" in parts:
            part_startup(tmp, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
