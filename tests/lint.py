"""The project's format and lint gates, outside pytest: `make lint` (the first step of `make check`
and `make test`) runs this. Each check runs even when one before it failed; the exit status is 1
when any failed, and each failure prints its command's output.

- `ruff check .` and `ruff format --check .`;
- `snakefmt --check Snakefile workflow/rules`;
- `snakemake --lint`: clean; every rule has its group's conda environment (envs/,
  docs/cluster.md, "Software on the nodes"), and any lint fails.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# No lint is accepted (the conda environments of envs/ answer the one that used to be).
ACCEPTED_LINTS: set[str] = set()


def snakemake_lint_problem(returncode: int, out: str) -> str | None:
    """None when the `snakemake --lint` output is clean or holds only the accepted lint."""
    if returncode == 0:
        return None if "Congratulations" in out else "no 'Congratulations' in a clean lint"
    titles = {line.strip()[2:-1] for line in out.splitlines() if line.startswith("    * ")}
    if not titles or not titles <= ACCEPTED_LINTS:
        return f"lints besides the accepted one: {sorted(titles - ACCEPTED_LINTS) or 'none parsed'}"
    blocks = [line for line in out.splitlines() if line.startswith("Lints for ")]
    if not all(b.startswith("Lints for rule ") for b in blocks):
        return "a lint outside a rule (Snakefile-level)"
    return None


CHECKS = [
    ("ruff check", ["ruff", "check", "."], None),
    ("ruff format", ["ruff", "format", "--check", "."], None),
    ("snakefmt", ["snakefmt", "--check", "Snakefile", "workflow/rules"], None),
    ("snakemake --lint", ["snakemake", "--lint", "--cores", "1"], snakemake_lint_problem),
]


def main() -> int:
    failed = []
    for name, cmd, judge in CHECKS:
        t0 = time.monotonic()
        proc = subprocess.run(
            [str(BIN / cmd[0]), *cmd[1:]], cwd=ROOT, capture_output=True, text=True
        )
        out = proc.stdout + proc.stderr
        problem = (
            judge(proc.returncode, out)
            if judge
            else (None if proc.returncode == 0 else f"exit status {proc.returncode}")
        )
        print(
            f"lint: {name}: {'ok' if problem is None else 'FAILED'} ({time.monotonic() - t0:.1f} s)"
        )
        if problem is not None:
            print(out.rstrip(), f"\nlint: {name}: {problem}", sep="\n", file=sys.stderr)
            failed.append(name)
    if failed:
        print(f"lint: failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
