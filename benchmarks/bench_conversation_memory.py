"""Peak RSS of one `tokenmill generate` job on a conversation shard (context: regenerated).

    python benchmarks/bench_conversation_memory.py [--conversations 20000] [--turns 4]

Writes a shard of distinct prefix-exact conversations (a 52-token first prompt, 4-token
segments, 1-5 token answers from the stand-in server), starts
tests/fake_sglang.py (no latency) and runs the real CLI against it (external mode, so the
server is not the job's child). Peak RSS is the job's own (os.wait4's rusage of that one
process). A second run on the same journal (every turn from the compacted journal, 0 requests)
is measured too. Prints numbers; no asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import fake_sglang  # noqa: E402
from bench_conversations import conversation_shard  # noqa: E402

from tokenmill.generate.launch import free_port  # noqa: E402

STOP = 2


def generate(tmp: Path, tokenized: Path, tag: str) -> dict:
    argv = [
        sys.executable, "-m", "tokenmill", "generate",
        "--generation-config", str(tmp / "gen.json"), "--tokenizer-config", str(tmp / "tok.json"),
        "--category", "mt", "--shard", "000", "--tokenized", str(tokenized),
        "--out", str(tmp / f"{tag}.g.parquet"), "--rejected", str(tmp / f"{tag}.r.parquet"),
        "--meta", str(tmp / f"{tag}.m.json"), "--journal-dir", str(tmp / "journal"),
        "--log-dir", str(tmp / "logs"),
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(tmp / f"{tag}.log", "w") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(p.pid, 0)
    wall = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit((tmp / f"{tag}.log").read_text()[-3000:])
    meta = json.loads((tmp / f"{tag}.m.json").read_text())
    return {"peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "wall_s": round(wall, 1),
            "requested": meta["counts"]["requested"],
            "turns_from_journal": meta["counts"]["turns_from_journal"],
            "compaction": meta["journal"]["compaction"]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=20000)
    ap.add_argument("--turns", type=int, default=4)
    args = ap.parse_args()
    port = free_port()
    server = fake_sglang.start(port)
    try:
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            tokenized = tmp / "000.parquet"
            conversation_shard(tokenized, [args.turns] * args.conversations)
            gen = {
                "engine": "sglang", "mode": "external", "model": "fake/model", "revision": None,
                "external": {"urls": [f"http://127.0.0.1:{port}"]},
                "sampling": {"max_new_tokens": 16, "temperature": 0.0}, "stop_tokens": [STOP],
                "seed_policy": "none", "concurrency": 256, "request_timeout_s": 60,
                "retry": {"max_attempts": 3, "backoff_initial_s": 0.05, "backoff_max_s": 0.5},
                "progress_interval_s": 3600,
            }  # fmt: skip
            (tmp / "gen.json").write_text(json.dumps(gen))
            (tmp / "tok.json").write_text(json.dumps({"path": "unused"}))
            shape = f"{args.conversations} conversations x {args.turns} turns"
            for tag in ("generate", "rerun"):
                print(f"{shape}, {tag}: {json.dumps(generate(tmp, tokenized, tag))}", flush=True)
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
