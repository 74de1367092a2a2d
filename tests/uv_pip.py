"""`uv pip install` into a test venv, configured as this machine's pip is.

The suites' cached venvs (tests/cached_venv.sh; the env-pins venv of test_standalone_envs.py)
are installed with uv: the vLLM venv in 39 s and 63 CPU-s instead of pip's 90 s and 88 (parallel
unpacking and bytecode compiling, one cache that all the venvs link from). uv does not read
pip's configuration, and on a machine like this one that configuration is what makes
`torch==2.13.0` the local CPU build instead of a multi-GB CUDA download (a wheel folder, local
indexes, a constraints file). So pip's settings are read here and handed to uv as flags.

Run as a script, prints those flags one per line (for tests/cached_venv.sh)."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

# pip's setting -> uv's flag. Each setting may hold several values (pip splits on whitespace).
FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


# Which of `pip config list`'s sections wins for `pip install`: PIP_* variables, then the
# files' [install] section, then their [global] one.
PRECEDENCE = {"global": 0, "install": 1, ":env:": 2}


def pip_settings() -> dict[str, list[str]]:
    """pip's index, wheel-folder and constraint settings as `pip install` sees them (its
    config files and PIP_* variables, via `pip config list`)."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    found = []
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        section, _, key = name.rpartition(".")
        if key in FLAGS and section in PRECEDENCE:
            found.append((PRECEDENCE[section], key, " ".join(shlex.split(value)).split()))
    return {key: values for _, key, values in sorted(found)}  # the highest rank last: it wins


def uv_args() -> list[str]:
    """pip's settings as uv flags. pip takes the best version across all indexes; so does uv
    with --index-strategy unsafe-best-match (its default stops at the first index that has
    the package)."""
    # Bytecode compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (it is on
    # these machines) nothing else would write it, and every vLLM start would compile vLLM and
    # torch from source again (50 s instead of 25).
    args = ["--index-strategy", "unsafe-best-match", "--compile-bytecode"]
    for key, values in pip_settings().items():
        for value in values:
            args += [FLAGS[key], value]
    return args


def uv() -> str:
    """The uv of the project venv (the [test] extra pins it), else the one on PATH."""
    found = Path(sys.executable).parent / "uv"
    path = str(found) if found.exists() else shutil.which("uv")
    if path is None:
        raise SystemExit("uv is not installed: pip install -e '.[test]' installs it")
    return path


def install(venv: Path, *requirements: str, timeout: float = 1200) -> None:
    """`uv pip install` the requirements into the venv; its output on failure."""
    proc = subprocess.run(
        [uv(), "pip", "install", "--python", str(venv / "bin" / "python"), *uv_args(),
         *requirements],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]


if __name__ == "__main__":
    print("\n".join([uv(), *uv_args()]))
