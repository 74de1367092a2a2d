"""The controller's cure for PreemptMode=CANCEL: requeue this workflow's preempted jobs.

snakemake-executor-plugin-slurm 2.8.0 treats a job in state PREEMPTED as still active (it
expects SLURM to requeue it). Under PreemptMode=REQUEUE SLURM does; under PreemptMode=CANCEL
PREEMPTED is final and the controller would wait for that job forever (docs/cluster.md,
section 5). `scontrol requeue` brings such a job back to PENDING under the same job id
(measured on slurm 22.05: Restarts=1, eligible ~2 min later); the plugin keeps following it and
sees it complete, and the requeued generate job resumes from the journal.

The Snakefile's onstart hook starts `Watchdog` in the controller (slurm executor only, never in
jobs or dry runs). Every `interval_s` it lists the user's jobs in state PREEMPTED that squeue
still knows (`--states=PREEMPTED`, kept for MinJobAge seconds, 300 by default) whose working
directory is this workflow's (the plugin submits with `-D <workdir>`; one controller per
workdir, Snakemake's lock), and requeues each once. TOKENMILL_PREEMPT_WATCH=0 turns it off.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path


def _say(msg: str) -> None:
    print(f"tokenmill: {msg}", file=sys.stderr, flush=True)


def preempted_jobs(workdir: str | Path, user: str | None = None) -> list[str]:
    """Ids of `user`'s jobs squeue shows as PREEMPTED with working directory `workdir`."""
    user = user or getpass.getuser()
    proc = subprocess.run(
        ["squeue", "-h", "--states=PREEMPTED", "-u", user, "-o", "%i|%Z"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise OSError(proc.stderr.strip() or f"squeue exited {proc.returncode}")
    want = os.path.realpath(workdir)
    jobs = []
    for line in proc.stdout.splitlines():
        job, _, wd = line.partition("|")
        if job.strip() and os.path.realpath(wd.strip()) == want:
            jobs.append(job.strip())
    return jobs


def requeue(job: str) -> tuple[bool, str]:
    proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


class Watchdog(threading.Thread):
    def __init__(self, workdir: str | Path, interval_s: float = 30.0):
        super().__init__(name="tokenmill-preemption-watchdog", daemon=True)
        self.workdir = str(workdir)
        self.interval_s = interval_s
        self.requeued: dict[str, int] = {}  # job id -> times requeued by us
        self._halt = threading.Event()

    def check_once(self) -> list[str]:
        done = []
        for job in preempted_jobs(self.workdir):
            if self.requeued.get(job, 0) >= 3:  # SLURM keeps refusing: say so, do not spin
                continue
            ok, msg = requeue(job)
            self.requeued[job] = self.requeued.get(job, 0) + 1
            if ok:
                done.append(job)
                _say(
                    f"SLURM job {job} was preempted and cancelled (PreemptMode=CANCEL); "
                    "requeued it with `scontrol requeue` (same job id; it resumes from the "
                    "journal once SLURM starts it again)"
                )
            else:
                _say(f"could not requeue preempted SLURM job {job}: {msg}")
        return done

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                self.check_once()
            except (OSError, subprocess.SubprocessError) as exc:
                _say(f"preemption watchdog: {exc}")

    def stop(self) -> None:
        self._halt.set()


def start_for_workflow(workflow, workdir: str | Path = ".") -> Watchdog | None:
    """Start the watchdog when the controller submits to SLURM (called from onstart)."""
    plugin = getattr(workflow, "executor_plugin", None)
    if "slurm" not in (getattr(plugin, "cli_prefix", None), getattr(plugin, "name", None)):
        return None
    if os.environ.get("TOKENMILL_PREEMPT_WATCH", "1") == "0":
        return None
    if not (shutil.which("squeue") and shutil.which("scontrol")):
        return None
    interval = float(os.environ.get("TOKENMILL_PREEMPT_WATCH_S", "30"))
    dog = Watchdog(Path(workdir).resolve(), interval)
    dog.start()
    _say(f"preemption watchdog on (every {interval:.0f} s): requeues jobs cancelled by preemption")
    return dog
