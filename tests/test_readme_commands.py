"""The README's own-data commands work as written, from a fresh shell after `make demo`.

The commands are read from README.md ("Running it on your data": the first ```bash block is
the local profile's, the second the SLURM profile's), so the test fails when the README changes
them into something that does not run. Each line runs in `bash -c` with a clean environment
(`env -i HOME=... PATH=/usr/bin:/bin`: no activated venv, no PYTHONPATH, no HF_HUB_OFFLINE)
in a copy of the workflow whose `.venv` is the test session's venv, as `make demo` leaves it.

Local: the copy holds the session's demo run's journal (paid-for samples; `make demo` leaves
it too) but no results, so every rule's command runs (prepare, tokenize, generate from the
journal, merge, export, counts, stats, card, provenance) and then the report. SLURM (marked
`slurm`: the lead's CI runs it, on the test cluster of tests/slurm/cluster.sh): the same with
the SLURM command, after filling the profile's SITE values with the test cluster's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from helpers import BIN, ROOT, copy_workflow
from test_slurm import cluster  # noqa: F401  (the SLURM test's cluster fixture)

SECTION = "## Running it on your data"


def readme_blocks() -> list[list[str]]:
    """The ```bash blocks of the README's own-data section, as lists of command lines."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"\n{SECTION}\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^[ \t]*```bash\n(.*?)^[ \t]*```", section, flags=re.S | re.M)
    return [[line.strip() for line in b.splitlines() if line.strip()] for b in blocks]


def test_the_readme_has_the_commands():
    local, slurm = readme_blocks()[:2]
    assert any("--profile profiles/local" in c and "--configfile my.yaml" in c for c in local)
    assert any("--profile profiles/slurm" in c for c in slurm)


def fresh_checkout(dest: Path, demo_workdir: Path | None) -> Path:
    """The workflow as a clone holds it after `make demo`: .venv (the session's venv) and,
    from the demo run, the journal; no results, no Snakemake state."""
    work = copy_workflow(dest)
    (work / ".venv").symlink_to(BIN.parent, target_is_directory=True)
    if demo_workdir is not None:
        shutil.copytree(demo_workdir / "journal", work / "journal")
    return work


def run_fresh_shell(work: Path, line: str, timeout: int) -> subprocess.CompletedProcess:
    home = work.parent / "home"
    home.mkdir(exist_ok=True)
    return subprocess.run(
        ["env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin", "bash", "-c", line],
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.e2e
@pytest.mark.slow
def test_local_commands_run_verbatim_in_a_fresh_shell(demo_workdir, tmp_path):
    local = readme_blocks()[0]
    work = fresh_checkout(tmp_path / "clone", demo_workdir)
    for line in local:
        proc = run_fresh_shell(work, line, timeout=1200)
        assert proc.returncode == 0, (line, proc.stdout[-3000:], proc.stderr[-6000:])
    results = work / "results"
    for name in ("dataset/provenance.json", "provenance.json", "stats/summary.md", "report.html"):
        assert (results / name).is_file(), name
    # Every rule ran here (nothing was left from the demo but the journal), and the data are
    # the demo's: the same training shards, byte for byte.
    for shard in sorted((demo_workdir / "results/dataset").glob("*/*.parquet")):
        rel = shard.relative_to(demo_workdir / "results")
        assert (results / rel).read_bytes() == shard.read_bytes(), rel


@pytest.mark.slurm
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.usefixtures("cluster")
@pytest.mark.timeout(1800)
def test_slurm_command_runs_verbatim_in_a_fresh_shell(tmp_path):
    slurm = readme_blocks()[1]
    work = fresh_checkout(tmp_path / "clone", None)
    # What the README asks first: the profile's SITE values, here the test cluster's.
    profile = work / "profiles/slurm/config.yaml"
    values = yaml.safe_load(profile.read_text())
    values.update(yaml.safe_load((ROOT / "tests/slurm/test-overrides/config.yaml").read_text()))
    profile.write_text(yaml.safe_dump(values))
    # "then edit my.yaml": one category, as a user starts (every job is a SLURM job here, and
    # the whole demo on SLURM is tests/test_slurm.py's pipeline run).
    config = yaml.safe_load((work / "config.yaml").read_text())
    config["categories"] = {"code": config["categories"]["code"]}
    (work / "my.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    for line in slurm:
        if line.startswith("tmux"):
            continue  # the README's advice for a login node, not part of the run
        proc = run_fresh_shell(work, line, timeout=1800)
        assert proc.returncode == 0, (line, proc.stdout[-3000:], proc.stderr[-6000:])
    assert (work / "results/dataset/provenance.json").is_file()
