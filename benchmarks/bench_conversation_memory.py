"""Peak RSS of one `tokenmill generate` job and one merge on a conversation shard
(context: regenerated), for several shard shapes, and the ratios between them.

    python benchmarks/bench_conversation_memory.py [--shapes 1000x4,1000x16,10000x4]
                                                   [--output-len 200] [--template non-exact]

For each shape CONVERSATIONSxTURNS: writes a shard of distinct prefix-exact conversations (a
52-token first prompt, 4-token segments, answers of --output-len tokens from the stand-in
server; 0: 1-5 tokens), starts tests/fake_sglang.py (no latency) and runs the real CLI against
it (external mode, so the server is not the job's child), then runs it again on the same
journal (every turn from the compacted journal, 0 requests), then merges the generated shard
(dataset/merge.py, in its own process). Peak RSS is each process's own: /usr/bin/time's %M for
the generate job (a fresh process: ru_maxrss of a child of this bench would carry this bench's
size over through fork), VmHWM for the merge.

`--template non-exact` measures merge alone on the shape a template that is not prefix-exact
gives (the demo's, which drops earlier turns' reasoning): every turn is its own dataset row and
turn k's prompt holds the first prompt plus, for each earlier turn, a 4-token segment and the
answer part of its output (the reasoning dropped), so the shard's tokens grow with the square
of the turns. The generated shard is written directly with those prompts and
--output-len-token outputs (reasoning, think-end, answer, stop), keys computed as generate
computes them: building such prompts through the CLI needs a chat template and a real tokenizer,
which the prefix-exact shape does not.

The last lines compare shapes with as many conversations (all of them in flight at once, as
generation.concurrency allows): the peak at 16 turns over the peak at 4 turns; issue 19's
target is within 1.3x. Prints numbers; no asserts.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import fake_sglang  # noqa: E402
from bench_conversations import conversation_shard  # noqa: E402
from test_conversation_stream import THINK_END, non_exact_shards  # noqa: E402

from tokenmill.engines.launch import free_port  # noqa: E402

STOP = 2
VOCAB = 2048  # the stand-in's ids are below 1010, the shard's below 1500


def generate(tmp: Path, tokenized: Path, tag: str) -> dict:
    argv = [
        "/usr/bin/time", "-f", "%M", "-o", str(tmp / f"{tag}.time"),
        sys.executable, "-m", "tokenmill", "generate",
        "--generation-config", str(tmp / "gen.json"), "--tokenizer-config", str(tmp / "tok.json"),
        "--category", "mt", "--shard", "000", "--tokenized", str(tokenized),
        "--out", str(tmp / "generated.parquet"), "--rejected", str(tmp / f"{tag}.r.parquet"),
        "--meta", str(tmp / f"{tag}.m.json"), "--journal-dir", str(tmp / "journal"),
        "--log-dir", str(tmp / "logs"),
    ]  # fmt: skip
    t0 = time.monotonic()
    with open(tmp / f"{tag}.log", "w") as log:
        rc = subprocess.call(argv, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit((tmp / f"{tag}.log").read_text()[-3000:])
    meta = json.loads((tmp / f"{tag}.m.json").read_text())
    kib = int((tmp / f"{tag}.time").read_text().split()[-1])
    return {"peak_rss_mib": round(kib / 1024, 1), "wall_s": round(wall, 1),
            **{k: meta["counts"].get(k) for k in ("requested", "retries", "engine_errors",
                                                  "turns_from_journal")}}  # fmt: skip


def merge(tmp: Path, tokenized: Path) -> dict:
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, __file__, "--merge", str(tokenized), str(tmp / "generated.parquet"),
         str(tmp)],
        capture_output=True, text=True,
    )  # fmt: skip
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    res = json.loads(out.stdout.splitlines()[-1])
    res["wall_s"] = round(time.monotonic() - t0, 1)
    return res


def merge_child(tokenized: str, generated: str, tmp: str) -> int:
    """Runs in its own process: merge one conversation shard, print its peak RSS (VmHWM)."""
    from tokenmill import contracts
    from tokenmill.dataset import merge as m
    from tokenmill.dataset import validate

    rules = validate.Rules(
        vocab_size=VOCAB, stop_ids=(STOP,), max_sequence_tokens=1 << 24, think_end_id=THINK_END
    )
    fp = contracts.read_metadata(generated)[contracts.META_GENERATION_FINGERPRINT]
    res = m.merge_shard(
        tokenized,
        generated,
        f"{tmp}/dataset.parquet",
        f"{tmp}/mrej.parquet",
        rules,
        fp,
        "mt",
        "000",
        counts_out=f"{tmp}/counts.parquet",
    )  # as the merge_shard rule runs it
    hwm = next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmHWM:")
    )
    groups = contracts.pq.ParquetFile(f"{tmp}/dataset.parquet").num_row_groups
    print(json.dumps({"peak_rss_mib": round(hwm / 1024, 1), "kept": res.kept,
                      "rejected": res.rejected, "row_groups": groups}))  # fmt: skip
    return 0


def shape_run(port: int, conversations: int, turns: int, template: str, output_len: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        shape = f"{conversations} conversations x {turns} turns ({template})"
        if template == "non-exact":
            tokenized, _ = non_exact_shards(tmp, conversations, turns, output_len)
            res = {"merge": merge(tmp, tokenized)}
            print(f"{shape}, merge: {json.dumps(res['merge'])}", flush=True)
            return res
        tokenized = tmp / "000.parquet"
        conversation_shard(tokenized, [turns] * conversations)
        gen = {
            "engine": "sglang", "mode": "external", "model": "fake/model", "revision": None,
            "external": {"urls": [f"http://127.0.0.1:{port}"]},
            "sampling": {"max_new_tokens": 4096, "temperature": 0.0}, "stop_tokens": [STOP],
            "seed_policy": "none", "concurrency": 256, "request_timeout_s": 60,
            "retry": {"max_attempts": 3, "backoff_initial_s": 0.05, "backoff_max_s": 0.5},
            "progress_interval_s": 3600,
        }  # fmt: skip
        (tmp / "gen.json").write_text(json.dumps(gen))
        (tmp / "tok.json").write_text(json.dumps({"path": "unused"}))
        res = {}
        for tag in ("generate", "rerun"):
            res[tag] = generate(tmp, tokenized, tag)
            print(f"{shape}, {tag}: {json.dumps(res[tag])}", flush=True)
        res["merge"] = merge(tmp, tokenized)
        print(f"{shape}, merge: {json.dumps(res['merge'])}", flush=True)
        return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1000x4,1000x16,10000x4",
                    help="CONVERSATIONSxTURNS, comma-separated")  # fmt: skip
    ap.add_argument("--output-len", type=int, default=200,
                    help="answer tokens before the stop token (0: 1-5)")  # fmt: skip
    ap.add_argument(
        "--template",
        choices=("exact", "non-exact"),
        default="exact",
        help="prefix-exact conversations (generate and merge) or not (merge)",
    )
    ap.add_argument("--merge", nargs=3, metavar=("TOKENIZED", "GENERATED", "DIR"),
                    help=argparse.SUPPRESS)  # fmt: skip
    args = ap.parse_args()
    if args.merge:
        return merge_child(*args.merge)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    port = free_port()
    flags = ["--output-len", str(args.output_len)] if args.output_len else []
    server = fake_sglang.start(port, *flags) if args.template == "exact" else None
    results = {}
    try:
        for n, t in shapes:
            results[n, t] = shape_run(port, n, t, args.template, args.output_len)
    finally:
        if server is not None:
            server.kill()
    for (n, t), res in results.items():
        base = results.get((n, 4))
        if t == 4 or base is None:
            continue
        for step in res:
            ratio = res[step]["peak_rss_mib"] / base[step]["peak_rss_mib"]
            print(f"{n} conversations, {step}: peak RSS at {t} turns / at 4 turns = {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
