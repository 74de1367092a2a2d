"""`tokenmill generate` end to end over real HTTP: resume after kills, restarts, no leaks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import fake_sglang
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill import contracts
from tokenmill.generate import journal
from tokenmill.generate.launch import free_port


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
    def __init__(self, tmp: Path, *fake_flags, n=30, mode="managed", urls=(), **gen_over):
        self.tmp = tmp
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


def test_complete_shard_then_rerun_starts_no_engine_and_is_identical(tmp_path):
    r = Run(tmp_path, "--reject-first-token", "105")
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


def test_server_dies_mid_shard_is_restarted(tmp_path):
    marker = tmp_path / "died"
    r = Run(tmp_path, "--latency", "0.05", "--die-after", "10", "--die-marker", str(marker), n=40)
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


def test_retries_exhausted_names_prompt(tmp_path):
    r = Run(tmp_path, "--fail-503", "1000", n=3, concurrency=1)
    out = r.run(expect_rc=1)
    assert re.search(r"prompt p00\d .*failed after 3 attempts.*503", out), out


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


def test_per_sample_seed_sent(tmp_path):
    r = Run(tmp_path, n=5, seed_policy="per_sample")
    r.run()
    lines = [json.loads(x) for x in r.counter.read_text().splitlines()]
    keys = {row["sample_key"] for row in r.result()[0].to_pylist()}
    seeds = {x["sp"]["sampling_seed"] for x in lines}
    assert seeds == {int(k[:15], 16) for k in keys}


def test_external_two_servers_api_key_never_leaks(tmp_path):
    key = "tm-SECRET-4242-key"
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            counter = tmp_path / f"ext{i}.jsonl"
            procs.append(fake_sglang.start(port, "--api-key", key, "--counter-file", str(counter)))
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
