"""Benchmark: peak memory and time of `tokenmill prepare` at several sizes.

    .venv/bin/python benchmarks/bench_prepare.py [--sizes 50000,200000] [--max-prompts N]

Writes a synthetic JSONL source per size (multi-turn conversations in the `messages` format,
about 3 KB per record, with 2 % duplicates and 1 % unparseable lines), then runs the prepare
stage on it in a fresh subprocess per size and prints wall time, peak RSS (the child's
ru_maxrss), bytes of peak RSS per prompt above the smallest run, and the sha256 of both output
files (so two versions of prepare can be checked for byte-identical outputs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ["the", "model", "answers", "every", "question", "with", "care", "and", "some", "code"]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def write_source(path: Path, n: int) -> None:
    with open(path, "w") as f:
        for i in range(n):
            if i % 100 == 99:
                f.write('{"messages": [not json\n')
                continue
            j = i - 7 if i % 50 == 49 else i  # a duplicate of a record a few lines up
            r = random.Random(j)
            msgs = [{"role": "system", "content": f"system {j % 13}"}]
            for t in range(3):
                msgs.append({"role": "user", "content": f"q{j}.{t} " + _text(r, 70)})
                msgs.append({"role": "assistant", "content": _text(r, 70)})
            f.write(json.dumps({"messages": msgs}) + "\n")


def child(source: str, out: str, rejected: str, max_prompts: int | None) -> None:
    from tokenmill.prepare import stage

    # The source by its name, relative to its folder: locations (file:line) in the outputs then
    # do not depend on the temporary folder, and the sha256s can be compared across runs.
    cat = {"sources": [Path(source).name], "format": "messages", "max_prompts": max_prompts}
    t0 = time.perf_counter()
    rc = stage.main(
        ["--category", "bench", "--category-config", json.dumps(cat)]
        + ["--out", out, "--rejected", rejected, "--basedir", str(Path(source).parent)]
    )
    wall = time.perf_counter() - t0
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rc": rc, "wall_s": wall, "peak_rss_mib": peak_kib / 1024}))


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="50000,200000")
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child, args.max_prompts)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in [int(s) for s in args.sizes.split(",")]:
            src, out, rej = (Path(tmp) / f"{name}{n}" for name in ("src", "out", "rej"))
            src = src.with_suffix(".jsonl")
            write_source(src, n)
            cmd = [sys.executable, __file__, "--child", str(src), f"{out}.parquet"]
            cmd += [f"{rej}.parquet"]
            if args.max_prompts:
                cmd += ["--max-prompts", str(args.max_prompts)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                sys.exit(res.stdout + res.stderr)
            r = json.loads(res.stdout.strip().splitlines()[-1])
            if r["rc"]:
                sys.exit(res.stderr)
            r.update(
                records=n,
                source_mib=src.stat().st_size / 2**20,
                prompts_sha=sha(Path(f"{out}.parquet")),
                rejected_sha=sha(Path(f"{rej}.parquet")),
            )
            rows.append(r)
            src.unlink()
    base = rows[0]
    for r in rows:
        grow = (r["peak_rss_mib"] - base["peak_rss_mib"]) * 2**20
        per = grow / (r["records"] - base["records"]) if r["records"] != base["records"] else 0
        print(
            f"{r['records']:>9,} records ({r['source_mib']:.0f} MiB JSONL): "
            f"{r['wall_s']:6.1f} s, peak RSS {r['peak_rss_mib']:7.1f} MiB "
            f"(+{per:,.0f} B per extra record), prompts {r['prompts_sha']}, "
            f"rejected {r['rejected_sha']}, rc {r['rc']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
