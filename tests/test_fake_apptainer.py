"""tests/slurm/fake_apptainer: apptainer's argument shape, bind checks, and a managed engine
launched through it (generation.launch.command = ["apptainer", "exec", "--nv", "--bind", ...])."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import fake_sglang
import pytest

from tokenmill.engines import launch as eng

FAKE = Path(__file__).resolve().parent / "slurm" / "fake_apptainer"


@pytest.fixture
def apptainer(tmp_path, monkeypatch):
    """`apptainer` on PATH (the fake), an empty image and a model folder; cwd = tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").symlink_to(FAKE)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_APPTAINER_LOG", str(tmp_path / "apptainer.jsonl"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sglang.sif").write_bytes(b"")
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    return tmp_path


def needs_bwrap() -> None:
    """Skip without bubblewrap (the fake binds paths such as /model through it); `make test`
    installs it (as root), and CI must not pass a test by skipping it. `make check` on a fresh
    machine with nothing from apt stays green."""
    if shutil.which("bwrap"):
        return
    if os.environ.get("CI") == "true":
        pytest.fail("bubblewrap (bwrap) is not installed under CI=true: make test installs it")
    pytest.skip("bubblewrap not installed (apt-get install bubblewrap)")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["apptainer", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("runner", ["bwrap", "direct"])
def test_binds_are_seen_at_their_destination(apptainer, monkeypatch, runner):
    if runner == "bwrap":
        needs_bwrap()
    if runner == "direct":
        monkeypatch.setenv("FAKE_APPTAINER_NO_BWRAP", "1")
    bind = f"{apptainer / 'models/tiny'}:/model:ro"
    proc = run("exec", "--nv", "--bind", bind, "sglang.sif", "cat", "/model/config.json")
    assert proc.returncode == 0 and proc.stdout == "{}", proc.stderr
    rec = json.loads((apptainer / "apptainer.jsonl").read_text().splitlines()[-1])
    assert rec["runner"] == runner and rec["nv"] and rec["binds"][0][1:] == ["/model", "ro"]
    assert not Path("/model").exists()  # nothing created on the host


def test_exit_code_and_environment_pass_through(apptainer, monkeypatch):
    monkeypatch.setenv("TOKENMILL_X", "1")
    proc = run("exec", "sglang.sif", "sh", "-c", 'echo "$TOKENMILL_X"; exit 3')
    assert (proc.returncode, proc.stdout) == (3, "1\n")
    proc = run(
        "exec", "--cleanenv", "--env", "Y=2", "sglang.sif", "sh", "-c", 'echo "$TOKENMILL_X$Y"'
    )
    assert proc.stdout == "2\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["exec", "--bind", "/no/such/dir:/model", "sglang.sif", "true"],
            "mount source /no/such/dir doesn't exist",
        ),
        (["exec", "missing.sif", "true"], "could not open image"),
        (["exec", "--gpus", "sglang.sif", "true"], "unknown flag: --gpus"),
        (["exec", "sglang.sif"], "exec needs a command"),
    ],
)
def test_mistakes_fail_like_apptainer(apptainer, args, message):
    proc = run(*args)
    assert proc.returncode == 255 and message in proc.stderr, proc.stderr


def _gen(model_arg: str, *extra: str) -> dict:
    cmd = ["apptainer", "exec", "--nv", "--bind", "{model}:/model", "sglang.sif"]
    cmd += [sys.executable, fake_sglang.FAKE, "--model-path", model_arg, *extra]
    cmd += ["--host", "{host}", "--port", "{port}"]
    return {
        "model": "models/tiny",
        "launch": {"command": cmd, "host": "127.0.0.1", "startup_timeout_s": 20},
    }


def test_managed_engine_through_apptainer(apptainer):
    """The bind keeps the model's host path out of the container: the engine reports /model,
    so tokenmill's served-model check needs --served-model-name (or a bind to the same path)."""
    needs_bwrap()
    e = eng.ManagedEngine(_gen("/model"), apptainer / "logs", basedir=apptainer)
    with pytest.raises(eng.EngineError, match="/model"):
        asyncio.run(e.start())
    e = eng.ManagedEngine(
        _gen("/model", "--served-model-name", "{model}"), apptainer / "logs", basedir=apptainer
    )
    asyncio.run(e.start())
    try:
        assert e.alive() and e.model_info["model_path"] == "/model"
        pid = e.proc.pid
    finally:
        e.stop(grace_s=5)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


@pytest.mark.parametrize("runtime", ["apptainer", "singularity"])
def test_generate_stage_with_the_engine_in_a_container(apptainer, runtime):
    """`tokenmill generate` with the docs' container launch command (docs/cluster.md, section
    10), the fake standing in for apptainer/singularity: --nv, the model bound read-only at
    /model, --served-model-name so the model check passes; every prompt exactly once, the
    journal written by tokenmill on the host (no bind needed), the engine gone at the end."""
    needs_bwrap()
    from test_generate import Run, _alive, _complete

    (apptainer / "bin" / "singularity").symlink_to(FAKE)
    r = Run(apptainer, n=12)
    inner = r.gen["launch"]["command"]  # {python} fake_sglang.py --model-path {model} ...
    model_at = inner.index("--model-path") + 1
    inner[model_at] = "/model"
    r.gen["model"] = "models/tiny"
    r.gen["launch"]["command"] = [
        runtime, "exec", "--nv", "--bind", "{model}:/model:ro", "sglang.sif",
        *inner, "--served-model-name", "{model}",
    ]  # fmt: skip
    proc = subprocess.run(
        [*r.argv(), "--basedir", str(apptainer)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=apptainer,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    g, _ = _complete(r, 12)
    assert r.requests() == 12 and r.journaled() == 12
    meta = r.meta()
    assert meta["model_info"]["model_path"] == "/model"
    bind = f"{apptainer / 'models/tiny'}:/model:ro"
    assert meta["engine_argv"][:6] == [runtime, "exec", "--nv", "--bind", bind, "sglang.sif"]
    calls = [json.loads(x) for x in (apptainer / "apptainer.jsonl").read_text().splitlines()]
    assert calls[-1]["nv"] and calls[-1]["binds"][0][1:] == ["/model", "ro"], calls[-1]
    assert calls[-1]["runner"] == ("bwrap" if shutil.which("bwrap") else "direct")
    assert not any(_alive(pid) for pid in r.engine_pids())
