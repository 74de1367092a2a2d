"""Failure scenarios against the fake SGLang 0.5.16 (external mode), for any tokenmill tree.

    PYTHONPATH=TREE/workflow python benchmarks/failure_scenarios.py TREE/workflow OUT_DIR

Runs `tokenmill generate` from TREE (so a checkout before and after a change can be compared
with the same fake server) and prints, per scenario, exit code, requests the server received,
seconds and what was written:
A two jobs with the same 60 prompts at once against one server (request-id collisions);
B `beam_width` on 0.5.16; C every request a plain-text 500; D every request a 400 blaming the
prompt (max_new_tokens past the context), 200 prompts. Not part of `make bench` (no floor).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import fake_sglang
from test_generate import prompts, write_tokenized

from tokenmill.engines.launch import free_port

TREE = sys.argv[1]  # workflow dir of the tokenmill under test
OUT = Path(sys.argv[2])
env = dict(os.environ, PYTHONPATH=TREE, HF_HUB_OFFLINE="1")


def gen_cfg(urls, **over):
    g = {
        "engine": "sglang",
        "mode": "external",
        "model": "fake/model",
        "revision": None,
        "launch": {},
        "external": {"urls": urls},
        "api_key_env": None,
        "sampling": {"max_new_tokens": 32, "temperature": 0.0},
        "stop_tokens": [2],
        "seed_policy": "none",
        "concurrency": 32,
        "request_timeout_s": 60,
        "retry": {"max_attempts": 8, "backoff_initial_s": 1.0, "backoff_max_s": 60.0},
        "progress_interval_s": 30,
    }
    g.update(over)
    return g


def job(d: Path, gen, n, cat="chat"):
    d.mkdir(parents=True, exist_ok=True)
    write_tokenized(d / "t.parquet", prompts(n))
    (d / "gen.json").write_text(json.dumps(gen))
    (d / "tok.json").write_text("{}")
    argv = [
        sys.executable,
        "-m",
        "tokenmill",
        "generate",
        "--generation-config",
        str(d / "gen.json"),
        "--tokenizer-config",
        str(d / "tok.json"),
        "--category",
        cat,
        "--shard",
        "000",
        "--tokenized",
        str(d / "t.parquet"),
        "--out",
        str(d / "g.parquet"),
        "--rejected",
        str(d / "r.parquet"),
        "--meta",
        str(d / "m.json"),
        "--journal-dir",
        str(d / "journal"),
        "--log-dir",
        str(d / "logs"),
    ]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def rejected(d):
    import pyarrow.parquet as pq

    p = d / "r.parquet"
    return pq.read_table(p).column("reason").to_pylist() if p.exists() else None


def server(*flags):
    port = free_port()
    c = OUT / f"c{port}.jsonl"
    p = fake_sglang.start(port, "--sglang-version", "0.5.16", "--counter-file", str(c), *flags)
    return p, f"http://127.0.0.1:{port}", c


res = {}
# A: two jobs, same prompts, one server at once
p, url, c = server("--latency", "0.2")
t0 = time.monotonic()
jobs = [job(OUT / f"A{i}", gen_cfg([url], concurrency=8), 60, cat=f"cat{i}") for i in range(2)]
outs = [j.communicate()[0] for j in jobs]
res["A_two_jobs_same_prompts"] = {
    "rc": [j.returncode for j in jobs],
    "rejected_rows": [len(rejected(OUT / f"A{i}") or []) for i in range(2)],
    "requests": fake_sglang.count_requests(c),
    "s": round(time.monotonic() - t0, 1),
}
p.kill()
# B: beam_width on 0.5.16 (every request a plain-text 500)
p, url, c = server()
t0 = time.monotonic()
j = job(OUT / "B", gen_cfg([url], sampling={"max_new_tokens": 32, "beam_width": 1}), 64)
out = j.communicate(timeout=1200)[0]
res["B_beam_width_on_0516"] = {
    "rc": j.returncode,
    "requests": fake_sglang.count_requests(c),
    "s": round(time.monotonic() - t0, 1),
    "last": out.strip().splitlines()[-1][:300],
}
p.kill()
# C: every request a 500 (a key the version check does not know)
p, url, c = server("--fail-500", "1000000")
t0 = time.monotonic()
j = job(OUT / "C", gen_cfg([url]), 64)
out = j.communicate(timeout=1200)[0]
res["C_every_request_500"] = {
    "rc": j.returncode,
    "requests": fake_sglang.count_requests(c),
    "s": round(time.monotonic() - t0, 1),
    "last": out.strip().splitlines()[-1][:300],
}
p.kill()
# D: every request a 400 blaming the prompt (max_new_tokens past the context)
p, url, c = server("--context-length", "20")
t0 = time.monotonic()
j = job(OUT / "D", gen_cfg([url]), 200)
out = j.communicate(timeout=1200)[0]
rj = rejected(OUT / "D")
res["D_every_request_400"] = {
    "rc": j.returncode,
    "requests": fake_sglang.count_requests(c),
    "s": round(time.monotonic() - t0, 1),
    "rejected_rows_written": None if rj is None else len(rj),
    "journal_lines": sum(
        len(f.read_text().splitlines()) for f in (OUT / "D/journal").rglob("*.jsonl")
    ),
}
p.kill()
print(json.dumps(res, indent=1))
