"""The controller's preemption watchdog (tokenmill/jobs/preemption.py) with stand-in squeue
and scontrol: it requeues only this workflow's PREEMPTED jobs however often one is preempted,
says when SLURM refuses and fails the run after three refusals in a row, fails the run on a job
that pends for a reason that never clears (squeue output samples), and starts only under the
slurm executor. The real thing runs in
tests/test_slurm_multinode.py (PreemptMode=CANCEL on the two-node cluster)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from tokenmill.jobs import preemption


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


def line(job, workdir, state="PREEMPTED", reason="None", cpus=8, mem="8000M", gres="N/A",
         comment="rule_tokenize_prompts_wildcards_chat"):  # fmt: skip
    """One line of squeue -o preemption.SQUEUE_FORMAT, as squeue 22.05 prints it."""
    fields = [job, state, reason, cpus, mem, gres, 1, "1:00:00", "debug", "tokenmill_x", comment]
    return "|".join(map(str, [*fields, workdir])) + "\n"


def test_requeues_only_this_workflows_preempted_jobs(slurm, tmp_path, capsys):
    wf = tmp_path / "wf"
    wf.mkdir()
    slurm["queue"].write_text(line(11, wf) + line(12, "/elsewhere") + line(13, f"{wf}/"))
    dog = preemption.Watchdog(wf)
    assert dog.check_once() == ["11", "13"]
    calls = slurm["calls"].read_text()
    assert "--states=PENDING,PREEMPTED" in calls and f"-o {preemption.SQUEUE_FORMAT}" in calls
    assert "scontrol requeue 11" in calls and "scontrol requeue 13" in calls
    assert "requeue 12" not in calls
    assert (
        "SLURM job 11 was preempted and cancelled (PreemptMode=CANCEL)" in capsys.readouterr().err
    )


def test_a_refused_requeue_is_reported_and_not_retried_forever(slurm, tmp_path, capsys):
    """Refusals count; the third in a row fails the run (RunCannotFinish; run() then calls
    on_fatal, which interrupts the controller) instead of a silent wait."""
    slurm["queue"].write_text(line(21, tmp_path))
    slurm["refuse"].write_text("21\n")
    dog = preemption.Watchdog(tmp_path)
    for _ in range(2):
        assert dog.check_once() == []
    with pytest.raises(preemption.RunCannotFinish, match="refused to requeue it 3 times"):
        dog.check_once()
    assert slurm["calls"].read_text().count("scontrol requeue 21") == 3
    assert (
        "could not requeue preempted SLURM job 21: Requested operation is presently disabled"
        in (capsys.readouterr().err)
    )


def test_the_same_job_preempted_five_times_is_requeued_five_times(slurm, tmp_path, capsys):
    """Successful requeues never count toward the refusal limit (the 4th preemption used to
    hang the run); a refusal between successes does not add up either."""
    slurm["queue"].write_text(line(31, tmp_path))
    dog = preemption.Watchdog(tmp_path)
    for _ in range(5):
        assert dog.check_once() == ["31"]
        slurm["queue"].write_text(line(31, tmp_path, state="PENDING", reason="BeginTime"))
        assert dog.check_once() == []  # requeued, pending again: nothing to do
        slurm["queue"].write_text(line(31, tmp_path))  # preempted once more
    assert slurm["calls"].read_text().count("scontrol requeue 31") == 5
    assert dog.requeued == {"31": 5}
    slurm["refuse"].write_text("31\n")
    assert dog.check_once() == [] and dog.check_once() == []  # 2 refusals
    slurm["refuse"].write_text("")
    assert dog.check_once() == ["31"]  # accepted: the count starts over
    slurm["refuse"].write_text("31\n")
    assert dog.check_once() == [] and dog.check_once() == []  # not fatal: 2 in a row
    assert "requeue #6" in capsys.readouterr().err


def test_a_job_that_can_never_start_fails_the_run_naming_it(slurm, tmp_path):
    """PartitionConfig (8 CPUs asked of 2-CPU nodes) on two checks in a row fails the run,
    naming the job, its request and the reason; reasons that clear never do."""
    queue = (
        line(41, tmp_path, state="PENDING", reason="PartitionConfig", cpus=8)
        + line(42, tmp_path, state="PENDING", reason="Resources")
        + line(43, tmp_path, state="PENDING", reason="ReqNodeNotAvail,_UnavailableNodes:n1")
        + line(44, "/elsewhere", state="PENDING", reason="BadConstraints")
    )
    slurm["queue"].write_text(queue)
    fatal = []
    dog = preemption.Watchdog(tmp_path, on_fatal=fatal.append)
    assert dog.check_once() == []  # first sighting: could be a moment of reconfiguration
    with pytest.raises(preemption.RunCannotFinish) as exc:
        dog.check_once()
    msg = str(exc.value)
    assert "SLURM job 41 (rule tokenize_prompts, wildcards chat; tokenmill_x)" in msg, msg
    assert "reason PartitionConfig" in msg, msg
    assert "8 CPUs, --mem=8000M, 1 node(s), time limit 1:00:00, partition debug" in msg
    assert "42" not in msg and "43" not in msg
    slurm["queue"].write_text(queue.replace("PartitionConfig", "Priority"))
    dog = preemption.Watchdog(tmp_path, on_fatal=fatal.append)
    for _ in range(3):
        assert dog.check_once() == []
    # run(): the fatal message goes to on_fatal (the controller's SIGINT by default), once.
    slurm["queue"].write_text(line(45, tmp_path, state="PENDING", reason="QOSMaxGRESPerJob"))
    dog = preemption.Watchdog(tmp_path, interval_s=0.05, on_fatal=fatal.append)
    dog.start()
    dog.join(timeout=10)
    assert not dog.is_alive()
    assert len(fatal) == 1 and "SLURM job 45" in fatal[0] and "QOSMaxGRESPerJob" in fatal[0]


def test_starts_only_for_the_slurm_executor(slurm, tmp_path, monkeypatch):
    from tokenmill.settings import load_section

    hourly = load_section({"preemption_watch_s": 3600}, "jobs")
    local = SimpleNamespace(executor_plugin=SimpleNamespace(name="local", cli_prefix="local"))
    assert preemption.start_for_workflow(local, hourly, tmp_path) is None
    dry = SimpleNamespace(executor_plugin=None)
    assert preemption.start_for_workflow(dry, hourly, tmp_path) is None
    on_slurm = SimpleNamespace(executor_plugin=SimpleNamespace(name="slurm", cli_prefix="slurm"))
    off = load_section({"preemption_watch": False}, "jobs")
    assert preemption.start_for_workflow(on_slurm, off, tmp_path) is None
    dog = preemption.start_for_workflow(on_slurm, hourly, tmp_path)
    try:
        assert dog is not None and dog.is_alive() and dog.daemon
    finally:
        dog.stop()
        dog.join(timeout=5)
    assert not dog.is_alive()
