"""The project's format and lint gates, run as part of the test suite (and so by CI)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "cmd",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["snakefmt", "--check", "Snakefile", "workflow/rules"],
    ],
    ids=["ruff-check", "ruff-format", "snakefmt"],
)
def test_code_is_formatted_and_lint_free(cmd):
    proc = subprocess.run([str(BIN / cmd[0]), *cmd[1:]], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# The rules have no conda/container directive on purpose (docs/cluster.md, "Software on the
# nodes"): the one lint accepted. Any other lint fails the test.
ACCEPTED_LINTS = {"Specify a conda environment or container for each rule."}


def test_snakemake_lint_is_clean():
    proc = subprocess.run(
        [str(BIN / "snakemake"), "--lint", "--cores", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    out = proc.stdout + proc.stderr
    if proc.returncode == 0:
        assert "Congratulations" in out, out
        return
    titles = {line.strip()[2:-1] for line in out.splitlines() if line.startswith("    * ")}
    assert titles and titles <= ACCEPTED_LINTS, out
    blocks = [line for line in out.splitlines() if line.startswith("Lints for ")]
    assert all(b.startswith("Lints for rule ") for b in blocks), out
