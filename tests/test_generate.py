"""`tokenmill generate` end to end over real HTTP: resume after kills, restarts, no leaks.

Tests marked with `version` run against both modes of the fake server: SGLang 0.5.23 as read
from its source and 0.5.16 as measured (docs/sglang-api.md).
"""

from __future__ import annotations

import json
import os
import re
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

from tokenmill import contracts
from tokenmill.generate import journal
from tokenmill.generate.launch import free_port

VERSIONS = ["0.5.23", "0.5.16"]
both_versions = pytest.mark.parametrize("version", VERSIONS)


def write_tokenized(path, prompts: dict[str, list[int]]):
    rows = [
        {"prompt_id": k, "prompt_ids": v, "num_prompt_tokens": len(v)} for k, v in prompts.items()
    ]
    contracts.write_table(
        pa.Table.from_pylist(rows, schema=contracts.TOKENIZED),
        path,
        contracts.TOKENIZED,
        "tokenize",
    )


def prompts(n: int) -> dict[str, list[int]]:
    return {f"p{i:03d}": [100 + i, i, i + 1, 7] for i in range(n)}


class Run:
    def __init__(
        self, tmp: Path, *fake_flags, n=30, mode="managed", urls=(), version=None, **gen_over
    ):
        self.tmp = tmp
        if version:
            fake_flags = (*fake_flags, "--sglang-version", version)
        self.counter = tmp / "requests.jsonl"
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
        self.out = {k: tmp / f"{k}" for k in ("g.parquet", "r.parquet", "m.json")}

    def argv(self):
        (self.tmp / "gen.json").write_text(json.dumps(self.gen))
        (self.tmp / "tok.json").write_text(json.dumps({"path": "unused"}))
        return [
            sys.executable, "-m", "tokenmill", "generate",
            "--generation-config", str(self.tmp / "gen.json"),
            "--tokenizer-config", str(self.tmp / "tok.json"),
            "--category", "chat", "--shard", "003",
            "--tokenized", str(self.tokenized),
            "--out", str(self.out["g.parquet"]), "--rejected", str(self.out["r.parquet"]),
            "--meta", str(self.out["m.json"]),
            "--journal-dir", str(self.tmp / "journal"), "--log-dir", str(self.tmp / "logs"),
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
        d = self.tmp / "journal" / "chat"
        return sum(len(p.read_bytes().splitlines()) for p in d.glob("*.jsonl")) if d.exists() else 0

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


def test_torn_journal_line_is_dropped_and_regenerated(tmp_path):
    r = Run(tmp_path, n=20)
    r.run()
    (jf,) = list((tmp_path / "journal" / "chat").glob("*.jsonl"))
    data = jf.read_bytes()
    jf.write_bytes(data[:-10])  # as if SIGKILL hit mid-write
    r.run()
    assert r.requests() == 21
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
    assert re.search(r"\d+ of \d+ prompts refused by the engine \(\d+% > ", out), out
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
    r = Run(tmp_path, n=3)
    r.run()
    (jf,) = list((tmp_path / "journal" / "chat").glob("*.jsonl"))
    assert jf.name.startswith("003.")
    found, _ = journal.load(
        tmp_path / "journal", "chat", set(r.result()[0]["sample_key"].to_pylist())
    )
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
    argv = r.argv()
    (tmp_path / "tok.json").write_text(json.dumps({"path": "sample/model"}))
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
    from tokenmill import keys

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
