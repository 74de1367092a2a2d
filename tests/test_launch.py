"""Managed engine lifecycle (with the fake server as the launch command), multi-node wrapper."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import fake_sglang
import pytest

from tokenmill import redaction as secrets
from tokenmill.generate import launch as eng


def _gen(*flags, model="fake/model", **launch):
    cmd = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}"]
    cmd += ["--port", "{port}", *flags]
    return {
        "model": model,
        "launch": {"command": cmd, "host": "127.0.0.1", "startup_timeout_s": 20, **launch},
    }


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_start_check_model_and_stop(tmp_path):
    e = eng.ManagedEngine(_gen(), tmp_path / "logs")
    asyncio.run(e.start())
    try:
        assert e.alive() and e.url.startswith("http://127.0.0.1:")
        assert e.model_info["model_path"] == "fake/model"
        assert e.server_info["version"] == "0.5.23-fake"
        pid = e.proc.pid
    finally:
        e.stop(grace_s=5)
    assert not _pid_alive(pid)
    log = (tmp_path / "logs" / "engine.log").read_text()
    assert "engine start #1" in log and "engine stopped" in log


def test_exit_at_start_fails_fast_with_log_tail(tmp_path):
    e = eng.ManagedEngine(_gen("--exit-at-start", "7"), tmp_path)
    t0 = time.monotonic()
    with pytest.raises(eng.EngineError, match=r"(?s)code 7.*failing at start"):
        asyncio.run(e.start())
    assert time.monotonic() - t0 < 10


def test_wrong_model_is_refused(tmp_path):
    gen = _gen()
    gen["launch"]["command"][3] = "other/model"
    e = eng.ManagedEngine(gen, tmp_path)
    with pytest.raises(eng.EngineError, match="other/model"):
        asyncio.run(e.start())
    assert e.proc is None


def test_local_model_path_compared_by_realpath(tmp_path):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    os.symlink(tmp_path / "models" / "tiny", tmp_path / "link")
    assert eng.model_matches({"model_path": str(tmp_path / "link")}, "models/tiny", tmp_path)
    assert not eng.model_matches({"model_path": "/elsewhere"}, "models/tiny", tmp_path)


def test_startup_timeout(tmp_path):
    e = eng.ManagedEngine(_gen("--startup-delay", "60", startup_timeout_s=1), tmp_path)
    with pytest.raises(eng.EngineError, match="not ready after"):
        asyncio.run(e.start())
    assert e.proc is None


def test_redaction():
    info = {
        "api_key": "K1",
        "hf_token": "x",
        "max_total_num_tokens": 5,
        "tokenizer_path": "t",
        "launch_command": "serve --api-key K1 --port 1",
        "nested": [{"db_password": "p"}],
    }
    out = secrets.redact(info, ["K1"])
    assert out["api_key"] == out["hf_token"] == out["nested"][0]["db_password"] == "<redacted>"
    assert out["max_total_num_tokens"] == 5 and out["tokenizer_path"] == "t"
    assert "K1" not in json.dumps(out)
    argv = ["serve", "--api-key", "K1", "--admin-api-key=K2", "--x=K1", "--port", "1"]
    assert secrets.redact_argv(argv, ["K1"]) == [
        "serve",
        "--api-key",
        "<redacted>",
        "--admin-api-key=<redacted>",
        "--x=<redacted>",
        "--port",
        "1",
    ]


def test_expand_nodelist(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol: the built-in parser
    assert eng.expand_nodelist("gpu[07-09,12],login1") == [
        "gpu07",
        "gpu08",
        "gpu09",
        "gpu12",
        "login1",
    ]
    assert eng.expand_nodelist("node1") == ["node1"]


def test_task_wrapper_substitutes_rank_and_head(tmp_path):
    template = [sys.executable, "-c", "import sys, json; print(json.dumps(sys.argv[1:]))"]
    template += ["--node-rank", "{node_rank}", "--dist-init-addr", "{dist_init_addr}"]
    env = dict(os.environ, SLURM_PROCID="1", SLURM_NODEID="1", SLURM_JOB_NODELIST="gpu[07-08]")
    env["PATH"] = os.path.dirname(sys.executable)  # no scontrol here
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenmill.generate.launch",
            "task",
            "--argv-json",
            json.dumps(template),
        ]
        + ["--dist-port", "5000"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert json.loads(out) == ["--node-rank", "1", "--dist-init-addr", "gpu07:5000"]


def test_multinode_launch_with_injected_prefix(tmp_path, monkeypatch):
    # A local stand-in for srun: one task (rank 0) with fake SLURM variables.
    monkeypatch.setenv(
        "TOKENMILL_LAUNCHER_PREFIX",
        json.dumps(["env", "SLURM_PROCID=0", "SLURM_NODEID=0", "SLURM_JOB_NODELIST=127.0.0.1"]),
    )
    monkeypatch.setenv("SLURM_JOB_NODELIST", "127.0.0.1")
    gen = _gen("--nnodes", "{nnodes}", "--node-rank", "{node_rank}")
    gen["launch"]["command"] += ["--dist-init-addr", "{dist_init_addr}"]
    gen["launch"]["nnodes"] = 2
    e = eng.ManagedEngine(gen, tmp_path)
    argv = e.build_argv(31000)
    assert argv[:4] == ["env", "SLURM_PROCID=0", "SLURM_NODEID=0", "SLURM_JOB_NODELIST=127.0.0.1"]
    assert argv[4:8] == [sys.executable, "-m", "tokenmill.generate.launch", "task"]
    asyncio.run(e.start())
    try:
        launched = e.server_info["launch_command"]
        port = int(e.url.rsplit(":", 1)[1])
        assert "--nnodes 2 --node-rank 0" in launched
        assert e.dist_port >= port + eng.DIST_PORT_OFFSET  # the first free block from there
        assert f"--dist-init-addr 127.0.0.1:{e.dist_port}" in launched
    finally:
        e.stop(grace_s=5)


def test_engine_srun_gets_a_clean_slurm_environment(tmp_path, monkeypatch):
    """What the rule's one-node step leaves in the environment (SLURM_JOB_NODELIST=n1, ...)
    must not reach the engine's srun; the job's identity does."""
    dump = tmp_path / "env.json"
    shim = f"import json, os, sys; json.dump(dict(os.environ), open({str(dump)!r}, 'w'));"
    shim += " os.execvp(sys.argv[1], sys.argv[1:])"
    monkeypatch.setenv("TOKENMILL_LAUNCHER_PREFIX", json.dumps([sys.executable, "-c", shim]))
    step = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_NODELIST": "127.0.0.1",
            "SLURM_STEP_ID": "0", "SLURM_NTASKS": "1", "SLURM_CPUS_PER_TASK": "2",
            "SRUN_DEBUG": "3", "SBATCH_EXPORT": "ALL", "SLURM_CONF": "/etc/slurm/x.conf",
            "SLURM_SUBMIT_DIR": "/w", "SLURM_PROCID": "0"}  # fmt: skip
    for k, v in step.items():
        monkeypatch.setenv(k, v)
    gen = _gen("--nnodes", "{nnodes}", "--node-rank", "{node_rank}")
    gen["launch"]["nnodes"] = 2
    e = eng.ManagedEngine(gen, tmp_path)
    asyncio.run(e.start())
    e.stop(grace_s=5)
    got = json.loads(dump.read_text())
    slurm = {k: v for k, v in got.items() if k.startswith(("SLURM_", "SRUN_", "SBATCH_"))}
    assert slurm == {
        "SLURM_JOB_ID": "7",
        "SLURM_CONF": "/etc/slurm/x.conf",
        "SLURM_SUBMIT_DIR": "/w",
    }
    assert got["PATH"] == os.environ["PATH"]  # everything else passes through


def test_busy_port_block_is_skipped():
    base = eng.free_port_block(42000)
    busy = socket.socket()
    busy.bind(("", base + 3))  # one port inside the block is taken (bound, as by an engine)
    try:
        assert not eng.ports_free(base)
        got = eng.free_port_block(base)
        assert got >= base + eng.DIST_PORT_SPAN, got  # the whole block skipped
        assert eng.ports_free(got)
    finally:
        busy.close()
    assert eng.ports_free(base)


def test_head_is_the_jobs_first_node_at_its_address(tmp_path, monkeypatch):
    """Inside the rule's step SLURM_JOB_NODELIST is that step's node, SLURM_NODELIST the job's;
    a node name that does not resolve is replaced by SLURM's NodeAddr."""
    assert eng.head_address({"SLURM_NODELIST": "localhost"}) == "localhost"  # resolves
    assert eng.head_address({}) == "127.0.0.1"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = show ]; then echo tm-nores-n1; echo tm-nores-n2; exit 0; fi\n'
        'echo "NodeName=$4 Arch=x86_64 NodeAddr=10.1.2.3 NodeHostName=$4 State=IDLE"\n'
    )
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    env = {"SLURM_JOB_NODELIST": "tm-nores-n2", "SLURM_NODELIST": "tm-nores-n[1-2]"}
    assert eng.head_address(env) == "10.1.2.3"
    assert eng.task_argv(
        ["{dist_init_addr}", "{node_rank}"], {**env, "SLURM_PROCID": "1"}, 5000
    ) == [
        "10.1.2.3:5000",
        "1",
    ]


def test_default_launcher_is_srun(monkeypatch):
    monkeypatch.delenv("TOKENMILL_LAUNCHER_PREFIX", raising=False)
    assert eng.launcher_prefix(2) == [
        "srun",
        "--overlap",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
