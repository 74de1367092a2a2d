"""`tokenmill generate` end to end over real HTTP: resume after kills, restarts, no leaks.

Tests marked with `version` run against both modes of the fake server: SGLang 0.5.23 as read
from its source and 0.5.16 as measured (docs/sglang-api.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import fake_sglang
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill import contracts, keys
from tokenmill.engines.launch import free_port
from tokenmill.generate import journal
from tokenmill.tokenization import shards
from tokenmill.tokenization import stage as tokenize_stage

VERSIONS = ["0.5.23", "0.5.16"]
both_versions = pytest.mark.parametrize("version", VERSIONS)


def write_tokenized(path, prompts: dict[str, list[int]], metadata: dict | None = None):
    rows = [
        {"prompt_id": k, "prompt_ids": v, "num_prompt_tokens": len(v)} for k, v in prompts.items()
    ]
    contracts.write_table(
        pa.Table.from_pylist(rows, schema=contracts.TOKENIZED),
        path,
        contracts.TOKENIZED,
        "tokenize",
        metadata,
    )


def prompts(n: int) -> dict[str, list[int]]:
    return {f"p{i:03d}": [100 + i, i, i + 1, 7] for i in range(n)}


class Run:
    def __init__(
        self,
        tmp: Path,
        *fake_flags,
        n=30,
        mode="managed",
        urls=(),
        version=None,
        shard="003",
        journal_dir=None,
        counter=None,
        jobs=None,
        **gen_over,
    ):
        self.tmp = tmp
        self.shard = shard
        self.journal_dir = Path(journal_dir or tmp / "journal")
        if version:
            fake_flags = (*fake_flags, "--sglang-version", version)
        # Part of the launch command, so of the generation fingerprint: runs that should share
        # samples share it.
        self.counter = Path(counter or tmp / "requests.jsonl")
        self.tokenized = tmp / "t.parquet"
        write_tokenized(self.tokenized, prompts(n))
        cmd = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}"]
        cmd += ["--port", "{port}", "--counter-file", str(self.counter), *fake_flags]
        self.gen = {
            "engine": "sglang",
            "mode": mode,
            "model": "fake/model",
            "revision": None,
            "launch": {"command": cmd, "host": "127.0.0.1", "startup_timeout_s": 20},
            "external": {"urls": list(urls)},
            "api_key_env": None,
            "sampling": {"max_new_tokens": 32, "temperature": 0.0},
            "stop_tokens": [2],
            "seed_policy": "none",
            "concurrency": 4,
            "request_timeout_s": 10,
            "retry": {"max_attempts": 3, "backoff_initial_s": 0.02, "backoff_max_s": 0.1},
            "progress_interval_s": 0.5,
        }
        self.gen.update(gen_over)
        self.jobs = dict(jobs or {})  # the harness's settings (jobs.lock_wait_s, ...)
        self.tokenizer = {"path": "unused"}
        self.out = {k: tmp / f"{k}" for k in ("g.parquet", "r.parquet", "m.json")}

    def config(self) -> dict:
        """The whole config the job is given (--config-json), as the rule gives it."""
        return {
            "tokenizer": self.tokenizer,
            "categories": {"chat": {"sources": ["unused"], "format": "messages"}},
            "generation": self.gen,
            "jobs": self.jobs,
        }

    def argv(self):
        (self.tmp / "config.json").write_text(json.dumps(self.config()))
        return [
            sys.executable, "-m", "tokenmill", "generate",
            "--config-json", str(self.tmp / "config.json"),
            "--category", "chat", "--shard", self.shard,
            "--tokenized", str(self.tokenized),
            "--out", str(self.out["g.parquet"]), "--rejected", str(self.out["r.parquet"]),
            "--meta", str(self.out["m.json"]),
            "--journal-dir", str(self.journal_dir), "--log-dir", str(self.tmp / "logs"),
        ]  # fmt: skip

    def start(self, env=None):
        return subprocess.Popen(
            self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )

    def run(self, env=None, expect_rc=0):
        p = self.start(env)
        out, _ = p.communicate(timeout=90)
        assert p.returncode == expect_rc, out
        return out

    def requests(self) -> int:
        return fake_sglang.count_requests(self.counter)

    def journaled(self) -> int:
        """Records journaled for this shard: attempt-file lines plus compacted records."""
        return journal.journaled_lines(self.journal_dir, "chat", self.shard)

    def result(self):
        return pq.read_table(self.out["g.parquet"]), pq.read_table(self.out["r.parquet"])

    def meta(self):
        return json.loads(self.out["m.json"].read_text())

    def engine_pids(self) -> list[int]:
        log = (self.tmp / "logs" / "engine.log").read_text()
        return [int(x) for x in re.findall(r"pid=(\d+)", log)]


def _wait_for(cond, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _complete(r: Run, n: int):
    g, rej = r.result()
    ids = g.column("prompt_id").to_pylist() + rej.column("prompt_id").to_pylist()
    assert sorted(ids) == sorted(prompts(n)) and len(ids) == len(set(ids))
    assert g.column("prompt_id").to_pylist() == sorted(g.column("prompt_id").to_pylist())
    return g, rej


@both_versions
def test_complete_shard_then_rerun_starts_no_engine_and_is_identical(tmp_path, version):
    r = Run(tmp_path, "--reject-first-token", "105", version=version)
    out = r.run()
    assert "progress 30/30" in out
    g, rej = _complete(r, 30)
    assert r.requests() == 30 and g.num_rows == 29 and rej.num_rows == 1
    row = g.to_pylist()[0]
    assert row["output_ids"][-1] == 2 and row["finish_type"] == "stop"
    assert row["finish_matched_id"] == 2 and row["server"].startswith("http://127.0.0.1:")
    assert rej.to_pylist()[0]["reason"] == "engine_rejected"
    assert "exceeds" in rej.to_pylist()[0]["detail"]
    meta = contracts.read_metadata(r.out["g.parquet"])
    assert (meta["tokenmill.records_in"], meta["tokenmill.kept"], meta["tokenmill.rejected"]) == (
        "30",
        "29",
        "1",
    )
    m = r.meta()
    assert m["counts"]["requested"] == 30 and m["engine_started"] is True
    first = r.out["g.parquet"].read_bytes()
    r.run()
    assert r.requests() == 30  # nothing sent
    assert r.meta()["engine_started"] is False
    assert (tmp_path / "logs" / "engine.log").read_text().count("engine start #") == 1
    assert r.out["g.parquet"].read_bytes() == first
    # one edited prompt -> exactly one request
    p = prompts(30)
    p["p010"] = [555, 1, 2]
    write_tokenized(r.tokenized, p)
    r.run()
    assert r.requests() == 31
    assert fake_sglang.requested_ids(r.counter)[-1] == [555, 1, 2]


def test_prompts_that_share_a_prefix_are_sent_back_to_back_and_written_in_prompt_id_order(
    tmp_path,
):
    # four tool sets, interleaved in prompt_id order as a hash of the prompt_id spreads them
    sets = [[40 + s] * 20 + [s] * 20 for s in range(4)]
    p = {f"p{i:03d}": [1, 2] + sets[i % 4] + [300 + i] for i in range(24)}
    r = Run(tmp_path, concurrency=1)
    write_tokenized(r.tokenized, p)
    r.run()
    sent = fake_sglang.requested_ids(r.counter)
    tool_set = [ids[2] - 40 for ids in sent]
    runs = [t for j, t in enumerate(tool_set) if j == 0 or tool_set[j - 1] != t]
    assert len(sent) == 24 and sorted(runs) == [0, 1, 2, 3], tool_set  # a set's prompts together
    g = pq.read_table(r.out["g.parquet"])
    assert g.column("prompt_id").to_pylist() == sorted(p)


def test_sigkill_client_mid_shard_then_resume(tmp_path):
    hold = tmp_path / "hold"
    hold.write_text("12")  # 12 answered, the rest held: the kill lands mid-shard on any machine
    r = Run(tmp_path, "--latency", "0.05", "--hold-file", str(hold), n=60)
    p = r.start()
    _wait_for(lambda: r.journaled() >= 12)
    p.kill()
    p.wait(timeout=10)
    # the engine dies with its parent (PDEATHSIG), no orphan
    pid = r.engine_pids()[0]
    _wait_for(lambda: not _alive(pid), timeout=10)
    done = r.journaled()
    before = r.requests()
    assert done == 12
    hold.unlink()
    r.run()
    assert r.requests() - before == 60 - done  # only the missing samples
    _complete(r, 60)
    assert r.meta()["counts"]["from_journal"] == done


def test_sigterm_client_flushes_journal_stops_engine(tmp_path):
    hold = tmp_path / "hold"
    hold.write_text("8")
    r = Run(tmp_path, "--latency", "0.05", "--hold-file", str(hold), n=60)
    p = r.start()
    _wait_for(lambda: r.journaled() >= 8)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 128 + signal.SIGTERM, out
    assert "SIGTERM" in out
    pid = r.engine_pids()[0]
    assert not _alive(pid)
    assert not r.out["g.parquet"].exists() and not r.out["m.json"].exists()
    done = r.journaled()
    assert done == 8
    before = r.requests()
    hold.unlink()
    r.run()
    assert r.requests() - before == 60 - done
    _complete(r, 60)


@both_versions
def test_server_dies_mid_shard_is_restarted(tmp_path, version):
    marker = tmp_path / "died"
    flags = ("--latency", "0.05", "--die-after", "10", "--die-marker", str(marker))
    r = Run(tmp_path, *flags, n=40, version=version)
    out = r.run()
    assert marker.exists() and "restart 1" in out
    g, _ = _complete(r, 40)
    m = r.meta()
    assert m["counts"]["restarts"] == 1 and m["engine_starts"] == 2
    servers = g.column("server").to_pylist()
    first_url = sorted(set(servers), key=servers.index)
    before_death = sum(1 for s in servers if s != m["engine_url"])
    assert len(first_url) == 2
    # requests to the second server = what was not journaled before the death
    lines = [json.loads(x) for x in r.counter.read_text().splitlines()]
    second = len(lines) - next(i for i in range(1, len(lines)) if lines[i]["n"] == 1)
    assert second == 40 - before_death


def test_engine_dying_too_often_fails_clearly(tmp_path):
    r = Run(tmp_path, "--die-after", "3", n=20)
    r.gen["launch"]["max_restarts"] = 1
    out = r.run(expect_rc=1)
    assert "engine died 2 times" in out
    assert not r.out["g.parquet"].exists()
    assert r.journaled() >= 1  # partial work kept


def test_exit_at_start_fails_fast(tmp_path):
    r = Run(tmp_path, "--exit-at-start", "3", n=5)
    out = r.run(expect_rc=1)
    assert "failing at start" in out and "code 3" in out


# Behaviour change (issue 11): each prompt that exhausts its attempts on 503s is an engine_error
# row now; a shard where every prompt ended so fails through the rejection guard, naming them.
def test_retries_exhausted_names_prompt(tmp_path):
    r = Run(tmp_path, "--fail-503", "1000", n=3, concurrency=1)
    out = r.run(expect_rc=1)
    assert "3 of 3 prompts refused" in out and "nothing in the shard was generated" in out
    assert re.search(r"p00\d: engine_error: .*HTTP 503: The request queue is full", out), out
    assert r.requests() == 9 and r.journaled() == 0


def _held(tmp: Path) -> tuple[str, str]:
    """Fake server flags: requests after the Nth written to tmp/hold are held (no file: none)."""
    return "--hold-file", str(tmp / "hold")


def _killed_midway(r: Run, answered: int) -> Path:
    """Run (made with _held) until `answered` samples are journaled, SIGKILL the job: its
    attempt file stays. The hold is lifted afterwards."""
    hold = r.tmp / "hold"
    hold.write_text(str(answered))
    p = r.start()
    _wait_for(lambda: r.journaled() >= answered)
    p.kill()
    p.wait(timeout=10)
    hold.unlink()
    (jf,) = list((r.tmp / "journal" / "chat").glob("*.jsonl"))
    return jf


def test_torn_journal_line_is_dropped_and_regenerated(tmp_path):
    # Changed with compaction: a completed job leaves no JSONL file, so the torn line is made
    # where it happens, in the attempt file of a killed job.
    r = Run(tmp_path, *_held(tmp_path), n=20)
    jf = _killed_midway(r, 6)
    data = jf.read_bytes()
    assert data.count(b"\n") == 6
    jf.write_bytes(data[:-10])  # as if SIGKILL hit mid-write
    before = r.requests()
    r.run()
    assert r.requests() - before == 20 - 6 + 1
    assert r.meta()["journal"]["torn_lines"] == 1
    _complete(r, 20)


def test_bad_sampling_key_fails_before_any_request(tmp_path):
    r = Run(tmp_path, n=5, sampling={"max_new_tokens": 8, "seed": 3})
    out = r.run(expect_rc=1)
    assert "sampling_seed" in out and r.requests() == 0


@both_versions
def test_per_sample_seed_sent(tmp_path, version):
    flag = "--enable-deterministic-inference"
    r = Run(tmp_path, flag, n=5, seed_policy="per_sample", version=version)
    r.run()
    lines = [json.loads(x) for x in r.counter.read_text().splitlines()]
    keys = {row["sample_key"] for row in r.result()[0].to_pylist()}
    seeds = {x["sp"]["sampling_seed"] for x in lines}
    assert seeds == {int(k[:15], 16) for k in keys}
    assert r.meta()["seeds_honoured"] is True


@both_versions
def test_per_sample_seed_refused_by_a_server_that_ignores_seeds(tmp_path, version):
    r = Run(tmp_path, n=5, seed_policy="per_sample", version=version)
    out = r.run(expect_rc=1)
    assert "seed_policy: per_sample needs an SGLang server started with" in out
    assert "--enable-deterministic-inference" in out and r.requests() == 0
    r.gen["allow_ignored_seeds"] = True  # the opt-out: runs, and says so in meta/provenance
    r.run()
    assert r.meta()["seeds_honoured"] is False
    assert _complete(r, 5)[0].num_rows == 5


@both_versions
def test_all_400_shard_fails_loudly_and_caches_no_rejection(tmp_path, version):
    # max_new_tokens too large for the server's context: every request is a 400 that blames
    # the prompt. The job fails with the counts and the first messages, journals nothing, and
    # the same config against a server that can answer generates every prompt.
    r = Run(tmp_path, "--context-length", "20", n=30, version=version)
    out = r.run(expect_rc=1)
    assert re.search(r"\d+ of \d+ prompts refused by the engine \(\d+\.\d%", out), out
    assert "exceeds the model's maximum context length" in out
    assert not r.out["g.parquet"].exists() and r.journaled() == 0
    assert r.requests() < 30  # stopped early
    before = r.requests()
    r.gen["launch"]["command"].remove("--context-length")
    r.gen["launch"]["command"].remove("20")
    r.run()
    assert r.requests() - before == 30
    assert _complete(r, 30)[0].num_rows == 30


def test_prompt_the_engine_never_answers_is_an_engine_error_row_retried_next_run(tmp_path):
    r = Run(tmp_path, "--error-first-token", "105", n=20)
    r.run()
    g, rej = _complete(r, 20)
    (row,) = rej.to_pylist()
    assert row["prompt_id"] == "p005" and row["reason"] == "engine_error"
    assert "HTTP 500: Internal Server Error" in row["detail"]
    assert r.meta()["counts"]["engine_errors"] == 1
    assert r.requests() == 19 + 3 and r.journaled() == 19  # the error is not journaled
    r.run()  # a later run of the shard tries that prompt again, and only it
    assert r.requests() == 19 + 3 + 3


def test_prompt_that_resets_the_connection_is_an_engine_error_row_retried_next_run(tmp_path):
    # Issue 19: the server resets the connection for one prompt and answers every other (and
    # its health check): the shard completes with one engine_error row, which is not journaled;
    # the rerun asks only for it. It used to fail "engine unreachable" on every run.
    r = Run(tmp_path, "--reset-first-token", "105", n=20)
    r.run()
    g, rej = _complete(r, 20)
    (row,) = rej.to_pylist()
    assert row["prompt_id"] == "p005" and row["reason"] == "engine_error"
    assert "the server stays healthy" in row["detail"]
    assert r.meta()["counts"]["engine_errors"] == 1
    assert r.requests() == 19 + 3 and r.journaled() == 19
    r.run()
    assert r.requests() == 19 + 3 + 3


def test_external_server_killed_for_good_fails_the_job_clearly(tmp_path):
    # The server dies mid-shard and stays dead: connections reset, then refused, the health
    # check fails: the job fails naming the unreachable engine, with no engine_error rows.
    port = free_port()
    counter = tmp_path / "ext.jsonl"
    proc = fake_sglang.start(port, "--counter-file", str(counter), "--die-after", "8")
    try:
        r = Run(tmp_path, n=20, mode="external", urls=[f"http://127.0.0.1:{port}"])
        out = r.run(expect_rc=1)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert "engine unreachable" in out, out
    assert not r.out["g.parquet"].exists() and not r.out["r.parquet"].exists()
    assert r.journaled() == 8  # partial work kept


@both_versions
def test_same_500_on_every_request_fails_fast_with_the_engine_log(tmp_path, version):
    r = Run(tmp_path, "--fail-500", "100000", n=40, version=version, concurrency=8)
    r.gen["retry"]["max_attempts"] = 8
    t0 = time.monotonic()
    out = r.run(expect_rc=1)
    assert "all failed with the same answer, HTTP 500: 'Internal Server Error'" in out
    assert "last lines of the engine log" in out and "fake sglang listening" in out
    assert r.requests() <= 8 + 3  # not 40 prompts x 8 attempts
    assert time.monotonic() - t0 < 30


@both_versions
def test_sampling_key_the_server_version_refuses(tmp_path, version):
    r = Run(tmp_path, n=4, version=version, sampling={"max_new_tokens": 8, "beam_width": 1})
    if version == "0.5.16":  # it would answer every request with a plain-text 500
        out = r.run(expect_rc=1)
        assert "generation.sampling.beam_width: not accepted by SGLang 0.5.16" in out
        assert r.requests() == 0
    else:
        r.run()
        assert r.requests() == 4


def test_out_of_vocabulary_prompt_ids_are_never_sent(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 120}))
    # prompts hold ids 100..129: 10 of them are >= 120; the fake dies on such an id, as
    # SGLang's scheduler does
    r = Run(tmp_path, "--vocab-size", "120", n=30, model=str(model), version="0.5.16")
    out = r.run(expect_rc=1)
    assert "10 prompts hold token ids outside the model's vocabulary [0, 120)" in out
    assert "id 120 in prompt p020" in out and str(model / "config.json") in out
    assert r.requests() == 0 and not (tmp_path / "logs" / "engine.log").exists()


def test_fake_0_5_16_dies_on_an_out_of_vocabulary_id(tmp_path):
    port = free_port()
    proc = fake_sglang.start(port, "--sglang-version", "0.5.16", "--vocab-size", "50")
    try:
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/generate",
            data=json.dumps({"input_ids": [1, 60], "rid": "x"}).encode(),
            method="POST",
        )
        with pytest.raises(OSError):
            urllib.request.urlopen(req, timeout=5)
        assert proc.wait(timeout=10) != 0
    finally:
        proc.kill()


@both_versions
def test_two_jobs_with_the_same_prompts_against_one_server_lose_nothing(tmp_path, version):
    # The case: two categories with the same prompts at once against one external
    # server. Request ids made of the sample key and the attempt collided ("Duplicate request
    # ID detected", 400) and became permanent engine_rejected rows.
    port = free_port()
    counter = tmp_path / "ext.jsonl"
    flags = ["--sglang-version", version, "--latency", "0.1", "--counter-file", str(counter)]
    proc = fake_sglang.start(port, *flags)
    try:
        runs = []
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            urls = [f"http://127.0.0.1:{port}"]
            runs.append(Run(tmp_path / name, n=20, mode="external", urls=urls))
        procs = [x.start() for x in runs]
        for x, p in zip(runs, procs, strict=True):
            out, _ = p.communicate(timeout=90)
            assert p.returncode == 0, out
            g, rej = _complete(x, 20)
            assert g.num_rows == 20 and rej.num_rows == 0
        lines = [json.loads(x) for x in counter.read_text().splitlines()]
        assert len(lines) == 40 and len({x["rid"] for x in lines}) == 40
    finally:
        proc.kill()
        proc.wait(timeout=10)


@both_versions
def test_external_two_servers_api_key_never_leaks(tmp_path, version):
    key = "tm-SECRET-4242-key"
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            counter = tmp_path / f"ext{i}.jsonl"
            flags = ["--api-key", key, "--counter-file", str(counter), "--sglang-version", version]
            procs.append(fake_sglang.start(port, *flags))
            urls.append(f"http://127.0.0.1:{port}")
        r = Run(tmp_path, n=40, mode="external", urls=urls, api_key_env="TM_TEST_KEY")
        env = dict(os.environ, TM_TEST_KEY=key)
        out = r.run(env=env)
        n = [fake_sglang.count_requests(tmp_path / f"ext{i}.jsonl") for i in range(2)]
        assert sum(n) == 40 and min(n) >= 5
        _complete(r, 40)
        m = r.meta()
        assert m["server_info"][urls[0]]["api_key"] == "<redacted>"
        assert key not in out
        for path in tmp_path.rglob("*"):
            if path.is_file() and not path.name.startswith("ext"):
                assert key.encode() not in path.read_bytes(), path
        # a missing key variable is a clear error
        env.pop("TM_TEST_KEY")
        r.out["g.parquet"].unlink()
        out = r.run(env=env, expect_rc=1)
        assert "TM_TEST_KEY" in out
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_journal_records_carry_key_first(tmp_path):
    r = Run(tmp_path, *_held(tmp_path), n=3)
    jf = _killed_midway(r, 2)  # an attempt file (a completed job compacts it away)
    assert jf.name.startswith("003.")
    assert all(line.startswith(b'{"key":"') for line in jf.read_bytes().splitlines())
    r.run()
    wanted = set(r.result()[0]["sample_key"].to_pylist())
    found, _ = journal.load(tmp_path / "journal", "chat", wanted, shard="003")
    assert len(found) == 3


@pytest.mark.parametrize("stop", [[2]])
def test_integer_stop_tokens_need_no_tokenizer(tmp_path, stop):
    r = Run(tmp_path, n=3, stop_tokens=stop)
    r.run()
    assert all(x["sp"]["stop_token_ids"] == stop for x in map(json.loads, r.counter.open()))


def test_duplicate_prompts_cost_one_request_and_empty_prompt_is_rejected(tmp_path):
    r = Run(tmp_path, n=3)
    p = prompts(3)
    p["p100"] = list(p["p001"])
    p["p200"] = []
    write_tokenized(r.tokenized, p)
    r.run()
    assert r.requests() == 3
    g, rej = r.result()
    rows = {x["prompt_id"]: x for x in g.to_pylist()}
    assert rows["p100"]["output_ids"] == rows["p001"]["output_ids"]
    assert rows["p100"]["sample_key"] == rows["p001"]["sample_key"]
    assert rej.to_pylist()[0]["prompt_id"] == "p200"
    assert rej.to_pylist()[0]["reason"] == "empty_prompt"


def test_string_stop_tokens_resolved_with_the_tokenizer(tmp_path):
    repo = Path(__file__).resolve().parent.parent
    if not (repo / "sample" / "model").is_dir():
        pytest.skip("sample/model (the tiny demo tokenizer) is not in this checkout")
    r = Run(tmp_path, n=3, stop_tokens=["<|im_end|>"])
    r.tokenizer = {"path": "sample/model"}
    argv = r.argv()
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    p = subprocess.run(argv + ["--basedir", str(repo)], env=env, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (sp,) = {json.dumps(json.loads(x)["sp"]["stop_token_ids"]) for x in r.counter.open()}
    ids = json.loads(sp)
    assert len(ids) == 1 and isinstance(ids[0], int)
    assert r.result()[0].column("finish_matched_id").to_pylist() == ids * 3


def test_vllm_engine_managed_end_to_end(tmp_path):
    """engine: vllm through the whole stage (fake vLLM server): mapping, EOS, provenance, keys."""
    r = Run(tmp_path, "--api", "vllm", "--eos-id", "4", n=12, engine="vllm", stop_tokens=[])
    r.gen["launch"]["command"][2] = "--model"  # vLLM's spelling
    out = r.run()
    assert "progress 12/12" in out
    g, _ = _complete(r, 12)
    rows = g.to_pylist()
    assert {(x["finish_type"], x["output_ids"][-1], x["finish_matched_id"]) for x in rows} == {
        ("stop", 4, 4)
    }
    m = r.meta()
    assert m["engine"] == "vllm" and m["server_info"]["version"] == "0.32.0-fake"
    assert m["server_info"]["env_keep_alive"] == "600"  # managed vLLM: no 5 s idle cut
    assert m["model_info"]["model_path"] == "fake/model"
    sent = [json.loads(x)["vllm"] for x in r.counter.read_text().splitlines()]
    assert all(s["model"] == "fake/model" and s["max_tokens"] == 32 for s in sent)
    # The same config with only the engine changed (launch command, sampling, stop tokens
    # identical) is another sample key: nothing is reused across engines.
    from tokenmill.keys import generation_fingerprint

    fingerprint = contracts.read_metadata(r.out["g.parquet"])[contracts.META_GENERATION_FINGERPRINT]
    assert fingerprint == generation_fingerprint(r.gen)
    assert fingerprint != generation_fingerprint(dict(r.gen, engine="sglang"))


def test_vllm_unsupported_sampling_key_fails_before_any_request(tmp_path):
    r = Run(
        tmp_path, "--api", "vllm", n=3, engine="vllm", sampling={"max_new_tokens": 8, "regex": "a"}
    )
    out = r.run(expect_rc=1)
    assert "generation.sampling.regex: not supported with engine vllm" in out
    assert r.requests() == 0


def test_duplicate_rid_rejections_of_older_versions_are_asked_again(tmp_path):
    # Journals written before this fix hold 400 "Duplicate request ID" as final rejections;
    # only a 400 that blames the prompt stays final.
    r = Run(tmp_path, n=4)
    fp = keys.generation_fingerprint(r.gen)
    p = prompts(4)
    with journal.JournalWriter(tmp_path / "journal", "chat", "003") as w:
        for pid, msg in (("p001", "Duplicate request ID detected: x-1"),
                         ("p002", "The input (9 tokens) is longer than the model's context "
                                  "length (8 tokens).")):  # fmt: skip
            key = keys.sample_key(fp, p[pid])
            w.append({"key": key, "status": "rejected", "prompt_id": pid, "message": msg})
    r.run()
    assert sorted(x[0] for x in fake_sglang.requested_ids(r.counter)) == [100, 101, 103]
    g, rej = _complete(r, 4)
    assert rej.column("prompt_id").to_pylist() == ["p002"]


# ---------------------------------------------------------------------------------------------
# The journal follows the shard: locality, resharding, compaction, streaming output


def _journal_bytes(jdir: Path) -> int:
    return sum(p.stat().st_size for p in jdir.rglob("*") if p.suffix in (".jsonl", ".parquet"))


def test_job_reads_only_its_own_shards_journal(tmp_path):
    jdir = tmp_path / "journal"
    for other in ("000", "001"):  # two other shards of the category, journaled and compacted
        o = Run(tmp_path / other, n=40, shard=other, journal_dir=jdir)
        write_tokenized(o.tokenized, {f"{other}-{i}": [9, i, int(other)] for i in range(40)})
        o.run()
    # an unreadable leftover of another shard: any job that opened it would count torn lines
    (jdir / "chat" / "002.host.1.2.jsonl").write_bytes(b"garbage\n" * 100)
    r = Run(tmp_path / "mine", n=30, journal_dir=jdir)
    r.run()
    m = r.meta()
    assert m["journal"]["files_read"] == [] and m["journal"]["torn_lines"] == 0
    r.run()
    m = r.meta()
    assert m["engine_started"] is False and m["counts"]["from_journal"] == 30
    assert m["journal"]["files_read"] == ["003.parquet"]  # compacted: one file, this shard's
    assert m["journal"]["bytes_read"] == (jdir / "chat" / "003.parquet").stat().st_size
    assert m["journal"]["torn_lines"] == 0 and m["journal"]["compaction"] is None


def _hex_prompts(n: int) -> dict[str, list[int]]:
    """prompt_ids like prepare's (hex), so that shards.shard_of can place them."""
    return {hashlib.sha256(str(i).encode()).hexdigest()[:32]: [300 + i, i, 5] for i in range(n)}


def _run_sharded(tmp: Path, jdir: Path, all_prompts: dict, n_shards: int) -> list[Run]:
    runs = []
    for s in range(n_shards):
        name = shards.shard_name(s)
        mine = {p: v for p, v in all_prompts.items() if shards.shard_of(p, n_shards) == s}
        r = Run(tmp / f"{n_shards}-{name}", shard=name, journal_dir=jdir,
                counter=tmp / "requests.jsonl")  # fmt: skip
        write_tokenized(r.tokenized, mine, {tokenize_stage.META_NUM_SHARDS: str(n_shards)})
        r.run()
        runs.append(r)
    return runs


def test_changed_shard_count_moves_records_once(tmp_path):
    jdir = tmp_path / "journal"
    everything = _hex_prompts(60)
    before = _run_sharded(tmp_path, jdir, everything, 2)
    assert before[0].requests() == 60
    assert json.loads((jdir / "chat" / journal.MANIFEST).read_text())["num_shards"] == 2

    after = _run_sharded(tmp_path, jdir, everything, 3)
    metas = [r.meta() for r in after]
    # nothing generated again: every prompt's record was found in its new shard's files
    assert after[0].requests() == 60
    assert all(m["engine_started"] is False for m in metas)
    assert [m["counts"]["from_journal"] for m in metas] == [
        sum(shards.shard_of(p, 3) == s for p in everything) for s in range(3)
    ]
    # the first job moved the records, once; the others found the new layout
    moved = metas[0]["journal"]["migration"]
    assert moved["from_shards"] == 2 and moved["to_shards"] == 3
    assert moved["records_moved"] >= 30
    assert [m["journal"].get("migration") for m in metas[1:]] == [None, None]
    manifest = json.loads((jdir / "chat" / journal.MANIFEST).read_text())
    assert manifest["num_shards"] == 3 and len(manifest["migrations"]) == 1
    for s, m in enumerate(metas):
        assert all(f.startswith(f"{s:03d}.") for f in m["journal"]["files_read"]), m["journal"]
    got = [pid for r in after for pid in r.result()[0].column("prompt_id").to_pylist()]
    assert sorted(got) == sorted(everything)
    # every shard's journal is compacted again: one Parquet file per shard, no JSONL (and the
    # fingerprint each shard's last job ran with)
    names = sorted(p.name for p in (jdir / "chat").iterdir() if not p.name.startswith("."))
    records = [f"{s:03d}.parquet" for s in range(3)]
    fingerprints = [f"generation-{s:03d}.json" for s in range(3)]
    assert names == [*records, *fingerprints, journal.MANIFEST]


KILL_AT = """
import os, signal, sys
jdir, n = sys.argv[1], int(sys.argv[2])
seen = [0]

def killing(fn):
    def inner(*a, **k):
        # the journal's own files: the shard lock ({shard}.lock) is not part of compaction
        if str(a[0]).startswith(jdir) and ".lock" not in str(a[0]):
            seen[0] += 1
            if seen[0] == n:  # the nth rename or delete in the journal: die before it
                os.kill(os.getpid(), signal.SIGKILL)
        return fn(*a, **k)
    return inner

os.replace, os.rename, os.unlink = killing(os.replace), killing(os.rename), killing(os.unlink)
from tokenmill.generate import stage
sys.exit(stage.main(sys.argv[3:]))
"""


def test_compaction_survives_a_kill_at_every_step(tmp_path):
    r = Run(tmp_path, *_held(tmp_path), n=24)
    _killed_midway(r, 10)  # attempt file 1: 10 records
    jdir = r.journal_dir / "chat"
    with journal.JournalWriter(r.journal_dir, "chat", "003") as w:  # a sample nobody wants
        w.append({"key": "f" * 32, "status": "ok", "prompt_id": "old", "output_ids": [7, 2]})

    def killed_at(n: int) -> int:
        argv = [sys.executable, "-c", KILL_AT, str(jdir), str(n), *r.argv()[4:]]
        return subprocess.run(argv, capture_output=True, timeout=90).returncode

    assert killed_at(1) == -signal.SIGKILL  # generated the rest (file 2), died compacting
    assert len(list(jdir.glob("003.*.jsonl"))) == 3
    reference = r.out["g.parquet"].read_bytes()
    want = set(pq.read_table(r.out["g.parquet"]).column("sample_key").to_pylist())
    assert len(want) == 24
    requests = r.requests()
    snapshot = tmp_path / "snapshot"
    shutil.copytree(jdir, snapshot)

    steps = 0
    for n in range(1, 20):
        shutil.rmtree(jdir)
        shutil.copytree(snapshot, jdir)
        rc = killed_at(n)
        if rc == 0:
            break  # the job did fewer than n renames/deletes in the journal: all were tried
        assert rc == -signal.SIGKILL
        steps += 1
        found, _ = journal.load(r.journal_dir, "chat", want | {"f" * 32}, shard="003")
        assert set(found) == want | {"f" * 32}, f"records lost by a kill at step {n}"
        r.run()  # the next job: no request, the same output, a compacted journal
        assert r.requests() == requests and r.meta()["engine_started"] is False
        assert r.out["g.parquet"].read_bytes() == reference
        assert not list(jdir.glob("*.jsonl")), n
        found, _ = journal.load(r.journal_dir, "chat", want | {"f" * 32}, shard="003")
        assert set(found) == want | {"f" * 32}
        assert found["f" * 32]["output_ids"] == [7, 2]
    else:
        raise AssertionError("the job never completed")
    # two temporary files of the killed compaction, the stale file, the compacted file, three
    # attempt files: each rename or delete was a kill point
    assert steps == 7, steps


def _old_build_tables(shard_rows: list[tuple[str, list[int]]], records: dict, fp: str):
    """The generate stage's output before streaming (kept here as the reference): every record
    in memory, one table, one write."""
    gen_rows = {name: [] for name in contracts.GENERATED.names}
    rej_rows = []
    for pid, ids in sorted(shard_rows):
        key = keys.sample_key(fp, ids)
        if not ids:
            reason, detail = "empty_prompt", "prompt_ids is empty"
        else:
            rec = records[key]
            if rec.get("status") == "ok":
                for name in contracts.GENERATED.names:
                    gen_rows[name].append(rec.get(name))
                gen_rows["prompt_id"][-1] = pid
                gen_rows["sample_key"][-1] = key
                continue
            reason, detail = "engine_rejected", rec.get("message")
        rej_rows.append(
            {
                "stage": "generate",
                "category": "chat",
                "reason": reason,
                "detail": detail,
                "prompt_id": pid,
                "record": contracts.canonical_json(
                    {"sample_key": key, "num_prompt_tokens": len(ids)}
                ),
            }
        )
    return pa.table(gen_rows, schema=contracts.GENERATED), contracts.rejected_table(rej_rows)


def test_streamed_output_equals_the_old_output_byte_for_byte(tmp_path):
    n = 20000  # three row groups of the generated shard
    r = Run(tmp_path, "--exit-at-start", "3", n=n)  # an engine start would fail the job
    rows = [(f"p{i:06d}", [5 + i % 7, i, i // 3]) for i in range(n)]
    rows[5] = ("p000005", [])  # empty prompt
    rows[7] = ("p000007", list(rows[6][1]))  # a duplicate prompt: one sample, two rows
    write_tokenized(r.tokenized, dict(reversed(rows)))  # not sorted: the output is
    fp = keys.generation_fingerprint(r.gen)
    records = {}
    with journal.JournalWriter(r.journal_dir, "chat", "003") as w:
        for i, (pid, ids) in enumerate(rows):
            key = keys.sample_key(fp, ids)
            if not ids or key in records:
                continue
            if i % 97 == 3:
                # a refusal that blames the prompt: final (others are asked again)
                msg = f"The input ({i} tokens) is longer than the model's context length."
                rec = {"key": key, "status": "rejected", "prompt_id": pid, "message": msg}
            else:
                rec = {
                    "key": key, "status": "ok", "prompt_id": pid,
                    "output_ids": list(range(i % 40)) + [2], "finish_type": "stop",
                    "finish_matched_id": 2 if i % 5 else None, "finish_message": None,
                    "prompt_tokens": len(ids), "completion_tokens": i % 40 + 1,
                    "cached_tokens": i % 3, "latency_s": i / 7, "weight_version": "w1",
                    "server": "http://127.0.0.1:1", "attempts": 1 + i % 2,
                }  # fmt: skip
            records[key] = rec
            w.append(rec)
    old_gen, old_rej = _old_build_tables(rows, records, fp)
    file_meta = {
        contracts.META_GENERATION_FINGERPRINT: fp,
        contracts.META_CATEGORY: "chat",
        contracts.META_SHARD: "003",
        "tokenmill.records_in": str(n),
        "tokenmill.kept": str(old_gen.num_rows),
        "tokenmill.rejected": str(old_rej.num_rows),
    }
    contracts.write_table(old_gen, tmp_path / "old-g.parquet", contracts.GENERATED, "generate",
                          file_meta)  # fmt: skip
    contracts.write_table(old_rej, tmp_path / "old-r.parquet", contracts.REJECTED, "generate",
                          file_meta)  # fmt: skip
    assert pq.ParquetFile(tmp_path / "old-g.parquet").num_row_groups == 3
    for source in ("JSONL", "compacted Parquet"):
        r.run()
        m = r.meta()
        assert m["engine_started"] is False, source
        assert r.out["g.parquet"].read_bytes() == (tmp_path / "old-g.parquet").read_bytes(), source
        assert r.out["r.parquet"].read_bytes() == (tmp_path / "old-r.parquet").read_bytes(), source
    assert m["journal"]["files_read"] == ["003.parquet"]
    # every record survived compaction with every field (attempts, finish_message included)
    found, _ = journal.load(r.journal_dir, "chat", set(records), shard="003")
    drop_none = lambda rec: {k: v for k, v in rec.items() if v is not None}  # noqa: E731
    assert {k: drop_none(v) for k, v in found.items()} == {
        k: drop_none(v) for k, v in records.items()
    }


def test_journal_stays_within_a_small_factor_of_the_generated_data(tmp_path):
    r = Run(tmp_path, *_held(tmp_path), n=200)
    _killed_midway(r, 50)
    r.run()
    m = r.meta()
    jdir = r.journal_dir / "chat"
    generated = r.out["g.parquet"].stat().st_size
    factor = _journal_bytes(jdir) / generated
    assert [p.name for p in jdir.glob("*.jsonl")] == []  # two attempt files, compacted
    assert m["journal"]["compaction"]["files_deleted"] == 2
    assert m["journal"]["compaction"]["records"] == 200
    assert factor <= 1.5, factor  # 1.04 here (the JSONL files were 2-3 times the output)
    assert journal.journaled_lines(r.journal_dir, "chat", "003") == 200  # none twice


def test_held_resources_record_what_the_job_was_given():
    """The record's `held` (the GPUs that dataset/stats.py counts, jobs/harness.py held): a
    SLURM allocation's own numbers, else the job's config (the category's override x
    launch.nnodes); none for external servers. The engine version is the one its server_info
    reports."""
    from argparse import Namespace

    from tokenmill.generate.job import engine_version
    from tokenmill.generate.stage import load_settings
    from tokenmill.jobs.harness import held as held_by

    def held(env, managed=True, per_node=2, version="0.5.23"):
        h = held_by(managed, per_node, 2, "config", version, env)
        return h.gpus_per_node, h.nodes, h.gpus, h.engine_version

    slurm = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"}
    assert held(slurm | {"SLURM_GPUS_ON_NODE": "4"}) == (4, 2, 8, "0.5.23")
    assert held(slurm | {"SLURM_GPUS_PER_NODE": "h100:3"}) == (3, 2, 6, "0.5.23")
    assert held({"SLURM_JOB_ID": "7", "CUDA_VISIBLE_DEVICES": "0,1"}) == (2, 1, 2, "0.5.23")
    assert held({"SLURM_JOB_ID": "7"}) == (0, 1, 0, "0.5.23")  # a CPU allocation
    # no allocation: the config the job was started with, the category's override first
    assert held({}) == (2, 2, 4, "0.5.23")
    config = {
        "tokenizer": {"path": "t"},
        "generation": {"model": "m", "resources": {"gpus": 2}, "launch": {"nnodes": 2}},
        "categories": {c: {"sources": ["x"], "format": "messages"} for c in ("chat", "code")},
    }
    config["categories"]["chat"]["resources"] = {"gpus": 3}
    args = Namespace(config_json=json.dumps(config), category="chat")
    gen, _, resources, jobs, source = load_settings(args)
    assert (resources.gpus, gen.launch.nnodes, jobs.lock_wait_s) == (3, 2, 3600)
    assert source == "categories.chat.resources over "
    assert load_settings(Namespace(config_json=json.dumps(config), category="code"))[2].gpus == 2
    assert engine_version(None, True) is None  # the engine never started: no version
    infos = {"http://a": {"version": "1"}, "http://b": {"version": "1"}}
    assert engine_version(infos, False) == "1"
    ext = held(slurm | {"SLURM_GPUS_ON_NODE": "4"}, managed=False, version="1")
    assert ext == (None, None, None, "1")


def test_timing_separates_startup_from_the_generation_window(tmp_path):
    r = Run(tmp_path, "--startup-delay", "1.5", "--latency", "0.02", n=40, concurrency=4)
    out = r.run()
    t = r.meta()["timing"]
    assert t["engine_start_s"] >= 1.5 and t["startup_s"] >= t["engine_start_s"]
    assert t["generation_s"] < 1.5  # 40 requests of 20 ms at 4 in flight: about 0.2 s
    assert t["startup_s"] + t["generation_s"] + t["write_s"] <= t["total_s"] + 0.01
    (attempt,) = r.meta()["attempts"]  # this job's only attempt: its wall time is the cost's
    assert attempt["status"] == "ok" and attempt["wall_s"] >= t["total_s"] - 0.01
    rates = r.meta()["rates"]
    assert rates["requests_per_s"] == pytest.approx(40 / t["generation_s"], rel=0.01)
    held = r.meta()["held"]  # what the job held, for the cost figures (no SLURM here: config)
    if "SLURM_JOB_ID" not in os.environ:
        assert (held["gpus_per_node"], held["nodes"], held["gpus"]) == (1, 1, 1)
    assert held["engine_version"] == r.meta()["server_info"].get("version")
    # the progress line's rate counts from the first request, not from the job's start
    rps = float(re.findall(r"progress 40/40 req/s=([\d.]+)", out)[-1])
    assert rps > 40 / 1.5
    assert rps == pytest.approx(rates["requests_per_s"], rel=0.5)
    # a rerun sends nothing: startup only, no generation window
    r.run()
    t = r.meta()["timing"]
    assert t["generation_s"] == 0.0 and r.meta()["rates"]["requests_per_s"] is None


BLOCKED = "raise ImportError('the generate job must not import this')\n"


def test_generate_needs_neither_transformers_nor_torch(tmp_path, repo_root):
    if not (repo_root / "sample" / "model" / "tokenizer.json").is_file():
        pytest.skip("sample/model (the tiny demo tokenizer) is not in this checkout")
    from tokenmill.prepare.formats import prompt_id
    from tokenmill.prepare.stage import prompt_row

    convs = [[{"role": "user", "content": f"question {i}?"}] for i in range(5)]
    rows = sorted((prompt_row(prompt_id(c, None), f"t:{i}", c, None)
                   for i, c in enumerate(convs)), key=lambda x: x["prompt_id"])  # fmt: skip
    prompts_file = tmp_path / "prompts.parquet"
    contracts.write_table(
        pa.Table.from_pylist(rows, schema=contracts.PROMPTS), prompts_file, contracts.PROMPTS,
        "prepare",
    )  # fmt: skip

    def tokenize(stop_tokens) -> subprocess.CompletedProcess:
        argv = [
            sys.executable, "-m", "tokenmill", "tokenize", "--prompts", str(prompts_file),
            "--category", "chat", "--shards", "1", "--shard-by", "prompt_id",
            "--max-prompt-tokens", "512",
            "--tokenizer-config", json.dumps({"path": "sample/model"}),
            "--basedir", str(repo_root), "--out-dir", str(tmp_path / "tok"),
            "--rejected", str(tmp_path / "tok-rejected.parquet"),
            "--stop-tokens", json.dumps(stop_tokens),
        ]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, timeout=120)

    bad = tokenize(["<|im_end|>", "no such token"])
    assert bad.returncode == 1 and "generation.stop_tokens" in bad.stderr
    p = tokenize(["<|im_end|>"])
    assert p.returncode == 0, p.stderr
    shard = tmp_path / "tok" / "000.parquet"
    meta = contracts.read_metadata(shard)
    (stop_id,) = json.loads(meta[tokenize_stage.META_STOP_TOKEN_IDS])
    assert json.loads(meta[tokenize_stage.META_STOP_TOKENS]) == ["<|im_end|>"]

    blocker = tmp_path / "blocked"
    for name in ("transformers", "torch"):
        (blocker / name).mkdir(parents=True)
        (blocker / name / "__init__.py").write_text(BLOCKED)
    env = dict(os.environ, PYTHONPATH=f"{blocker}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    probe = subprocess.run([sys.executable, "-c", "import transformers"], env=env,
                           capture_output=True, text=True)  # fmt: skip
    assert probe.returncode == 1 and "must not import" in probe.stderr  # the blocker works

    r = Run(tmp_path, n=1, shard="000", stop_tokens=["<|im_end|>"])
    r.tokenized = shard
    r.run(env=env)
    sent = {json.dumps(json.loads(x)["sp"]["stop_token_ids"]) for x in r.counter.open()}
    assert sent == {json.dumps([stop_id])}
    m = r.meta()
    assert m["stop_token_ids_from"] == "tokenized shard metadata"
    assert m["counts"]["kept"] == 5
