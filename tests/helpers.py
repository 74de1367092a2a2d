"""Helpers shared by the test modules that run the real workflow (Snakemake, the `tokenmill`
command) in a tmp copy of the repository. Fixtures built on them live in conftest.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent  # the venv's bin: snakemake, tokenmill, ruff

# What a workflow copy holds: enough for `snakemake` to run the pipeline on the sample data.
WORKFLOW_FILES = ("Snakefile", "config.yaml", "pyproject.toml")
WORKFLOW_DIRS = ("workflow", "envs", "sample", "profiles")


def tool_env(**extra: str) -> dict:
    """The environment for snakemake and its jobs: the venv's `tokenmill` first on PATH,
    offline Hugging Face."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    return {**env, **extra}


def copy_workflow(dest: Path, extra: tuple[str, ...] = ()) -> Path:
    """The workflow (Snakefile, config, package, sample data, profiles) copied into `dest`,
    plus the files or folders in `extra` (paths relative to the repository)."""
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in WORKFLOW_FILES:
        shutil.copy2(ROOT / name, dest / name)
    for name in (*WORKFLOW_DIRS, *extra):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, dest / name)
    return dest


def copy_run(src: Path, dest: Path) -> Path:
    """A finished run's folder (results, journal, .snakemake state) copied, times kept: the
    copy is as up to date for Snakemake as the original, and editing it leaves that alone."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


def snakemake(workdir: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """`snakemake --profile profiles/local --cores 2 ARGS` in `workdir`, output captured."""
    return subprocess.run(
        [str(BIN / "snakemake"), "--profile", "profiles/local", "--cores", "2", *args],
        cwd=workdir,
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def failed(proc: subprocess.CompletedProcess) -> str:
    """The ends of a failed run's output, for an assertion message."""
    return proc.stdout[-4000:] + proc.stderr[-8000:]


# Where the suites keep what they make once per machine (the test venvs, vLLM's compile cache).
TEST_CACHE = Path(os.environ.get("TOKENMILL_CACHE", Path.home() / ".cache" / "tokenmill"))


# vLLM on CPU as the suites start it (docs/engines.md, "vLLM on CPU"), in the venv of
# tests/vllm/ensure_venv.sh. No torch.compile (--enforce-eager): a start took 108 s instead of
# 163 s on a loaded 2-core machine.
VLLM_CPU_ARGS = [
    "-m", "vllm.entrypoints.openai.api_server",
    "--model", "{model}", "--host", "{host}", "--port", "{port}",
    "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
]  # fmt: skip


def vllm_cpu_env() -> dict[str, str]:
    return {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "auto",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CACHE_ROOT": str(TEST_CACHE / "vllm-compile-cache"),
    }


_VLLM_PYTHON: list[str] = []


def vllm_python() -> str:
    """The python of the vLLM venv, made on first use (tests/vllm/ensure_venv.sh): not a
    fixture, so only the tests that start vLLM pay for the install."""
    if not _VLLM_PYTHON:
        proc = subprocess.run(
            ["bash", str(ROOT / "tests" / "vllm" / "ensure_venv.sh")],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        _VLLM_PYTHON.append(proc.stdout.strip().splitlines()[-1])
    return _VLLM_PYTHON[0]
