"""The controller's preemption watchdog (tokenmill/generate/preemption.py) with stand-in squeue
and scontrol: it requeues only this workflow's PREEMPTED jobs, says when SLURM refuses, gives up
on a job after three refusals, and starts only under the slurm executor. The real thing runs in
tests/test_slurm_multinode.py (PreemptMode=CANCEL on the two-node cluster)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tokenmill.generate import preemption


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """squeue prints the lines of `queue`; scontrol appends its arguments to `calls` and fails
    for job ids listed in `refuse`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    files = {name: tmp_path / name for name in ("queue", "calls", "refuse")}
    for f in files.values():
        f.write_text("")
    (bin_dir / "squeue").write_text(
        f'#!/bin/sh\necho "$*" >> {files["calls"]}\ncat {files["queue"]}\n'
    )
    (bin_dir / "scontrol").write_text(
        "#!/bin/sh\n"
        f'echo "scontrol $*" >> {files["calls"]}\n'
        f'if grep -qx "$2" {files["refuse"]}; then\n'
        '  echo "Requested operation is presently disabled for job $2" >&2; exit 1; fi\n'
    )
    for name in ("squeue", "scontrol"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return files


def test_requeues_only_this_workflows_preempted_jobs(slurm, tmp_path, capsys):
    wf = tmp_path / "wf"
    wf.mkdir()
    slurm["queue"].write_text(f"11|{wf}\n12|/elsewhere\n13|{wf}/\n")
    dog = preemption.Watchdog(wf)
    assert dog.check_once() == ["11", "13"]
    calls = slurm["calls"].read_text()
    assert "--states=PREEMPTED" in calls and "-o %i|%Z" in calls
    assert "scontrol requeue 11" in calls and "scontrol requeue 13" in calls
    assert "requeue 12" not in calls
    assert (
        "SLURM job 11 was preempted and cancelled (PreemptMode=CANCEL)" in capsys.readouterr().err
    )


def test_a_refused_requeue_is_reported_and_not_retried_forever(slurm, tmp_path, capsys):
    slurm["queue"].write_text(f"21|{tmp_path}\n")
    slurm["refuse"].write_text("21\n")
    dog = preemption.Watchdog(tmp_path)
    for _ in range(5):
        assert dog.check_once() == []
    assert slurm["calls"].read_text().count("scontrol requeue 21") == 3
    assert (
        "could not requeue preempted SLURM job 21: Requested operation is presently disabled"
        in (capsys.readouterr().err)
    )


def test_starts_only_for_the_slurm_executor(slurm, tmp_path, monkeypatch):
    local = SimpleNamespace(executor_plugin=SimpleNamespace(name="local", cli_prefix="local"))
    assert preemption.start_for_workflow(local, tmp_path) is None
    dry = SimpleNamespace(executor_plugin=None)
    assert preemption.start_for_workflow(dry, tmp_path) is None
    on_slurm = SimpleNamespace(executor_plugin=SimpleNamespace(name="slurm", cli_prefix="slurm"))
    monkeypatch.setenv("TOKENMILL_PREEMPT_WATCH", "0")
    assert preemption.start_for_workflow(on_slurm, tmp_path) is None
    monkeypatch.setenv("TOKENMILL_PREEMPT_WATCH", "1")
    monkeypatch.setenv("TOKENMILL_PREEMPT_WATCH_S", "3600")
    dog = preemption.start_for_workflow(on_slurm, tmp_path)
    try:
        assert dog is not None and dog.is_alive() and dog.daemon
    finally:
        dog.stop()
        dog.join(timeout=5)
    assert not dog.is_alive()
