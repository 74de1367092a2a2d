"""The controller's cure for PreemptMode=CANCEL: requeue this workflow's preempted jobs.

snakemake-executor-plugin-slurm 2.8.0 treats a job in state PREEMPTED as still active (it
expects SLURM to requeue it). Under PreemptMode=REQUEUE SLURM does; under PreemptMode=CANCEL
PREEMPTED is final and the controller would wait for that job forever (docs/cluster.md,
section 5). `scontrol requeue` brings such a job back to PENDING under the same job id
(measured on slurm 22.05: Restarts=1, eligible ~2 min later); the plugin keeps following it and
sees it complete, and the requeued generate job resumes from the journal.

The Snakefile's onstart hook starts `Watchdog` in the controller (slurm executor only, never in
jobs or dry runs). Every `interval_s` it lists the user's PENDING and PREEMPTED jobs that squeue
still knows (PREEMPTED ones are kept for MinJobAge seconds, 300 by default) whose working
directory is this workflow's (the plugin submits with `-D <workdir>`; one controller per
workdir, Snakemake's lock), and

- requeues every PREEMPTED one, however often the same job is preempted; only requeues that
  SLURM refuses count, and `max_refusals` (3) of them in a row for one job fail the run;
- fails the run when a job pends, on two checks in a row, for a reason that cannot clear by
  waiting (NEVER_CLEARS: the job asks for more than any node or the partition or its QOS or
  association allows, or for an account or QOS it may not use), naming the job, what it asked
  for and SLURM's reason.

Failing the run: the message is printed, then the controller gets SIGINT, as from Ctrl-C
(Snakemake cancels the run's SLURM jobs and exits non-zero; the journals keep what the
generate jobs had paid for). `jobs.preemption_watch: false` turns the watchdog off;
`jobs.preemption_watch_s` (15) is its interval.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path


def _say(msg: str) -> None:
    print(f"tokenmill: {msg}", file=sys.stderr, flush=True)


# SLURM's pending reasons (squeue %r) that no amount of waiting clears: the request exceeds what
# the partition, its nodes, the QOS or the association allow per job or per node, or uses an
# account/QOS the user may not. Not here, because they do clear: Resources, Priority,
# ReqNodeNotAvail (a reservation, nodes down or draining for maintenance), PartitionNodeLimit
# (also: required nodes down), NodeDown, PartitionDown, the Grp*/Max*PerUser/PerAccount limits
# (other jobs end) and holds.
NEVER_CLEARS = frozenset(
    {
        "PartitionConfig",
        "PartitionTimeLimit",
        "BadConstraints",
        "InvalidAccount",
        "InvalidQOS",
        "QOSNotAllowed",
        "AccountNotAllowed",
        "DependencyNeverSatisfied",
        "JobHoldMaxRequeue",
        "QOSMaxCpuPerJobLimit",
        "QOSMaxNodePerJobLimit",
        "QOSMaxWallDurationPerJobLimit",
        "QOSMaxGRESPerJob",
        "QOSMaxMemoryPerJob",
        "QOSMaxCpuPerNode",
        "QOSMaxGRESPerNode",
        "QOSMaxMemoryPerNode",
        "AssocMaxCpuPerJobLimit",
        "AssocMaxNodePerJobLimit",
        "AssocMaxWallDurationPerJobLimit",
        "AssocMaxGRESPerJob",
        "AssocMaxMemPerJob",
        "AssocMaxCpuPerNode",
        "AssocMaxGRESPerNode",
        "AssocMaxMemPerNode",
    }
)

# squeue fields: id, state, reason, CPUs, memory, GRES/TRES per node, nodes, time limit,
# partition, name; the working directory last (it may hold the separator).
# %k: the comment the SLURM plugin gives each job, "rule_<rule>_wildcards_<values>"
SQUEUE_FORMAT = "%i|%T|%r|%C|%m|%b|%D|%l|%P|%j|%k|%Z"


class RunCannotFinish(RuntimeError):
    """A job of this run will never finish by waiting: the run must fail."""


def queued_jobs(workdir: str | Path, user: str | None = None) -> list[dict]:
    """`user`'s PENDING and PREEMPTED jobs that squeue lists with working directory `workdir`."""
    user = user or getpass.getuser()
    proc = subprocess.run(
        ["squeue", "-h", "--states=PENDING,PREEMPTED", "-u", user, "-o", SQUEUE_FORMAT],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        raise OSError(proc.stderr.strip() or f"squeue exited {proc.returncode}")
    want = os.path.realpath(workdir)
    names = ("id", "state", "reason", "cpus", "mem", "gres", "nodes", "time", "partition", "name")
    names += ("comment",)
    jobs = []
    for line in proc.stdout.splitlines():
        fields = line.split("|", len(names))
        if len(fields) != len(names) + 1 or not fields[0].strip():
            continue
        if os.path.realpath(fields[-1].strip()) == want:
            jobs.append({k: v.strip() for k, v in zip(names, fields, strict=False)})
    return jobs


def preempted_jobs(workdir: str | Path, user: str | None = None) -> list[str]:
    """Ids of `user`'s jobs squeue shows as PREEMPTED with working directory `workdir`."""
    return [j["id"] for j in queued_jobs(workdir, user) if j["state"] == "PREEMPTED"]


def requeue(job: str) -> tuple[bool, str]:
    proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def describe(job: dict) -> str:
    """What the job asked SLURM for, in sbatch's words."""
    asked = [f"{job['cpus']} CPUs", f"--mem={job['mem']}", f"{job['nodes']} node(s)"]
    if job.get("gres") and job["gres"] not in ("(null)", "N/A"):
        asked.append(job["gres"])
    asked += [f"time limit {job['time']}", f"partition {job['partition']}"]
    return ", ".join(asked)


def which(job: dict) -> str:
    """The job's rule and wildcards (from the plugin's comment) and its SLURM name."""
    comment = job.get("comment", "")
    if comment.startswith("rule_"):
        rule, _, wildcards = comment[len("rule_") :].partition("_wildcards_")
        what = f"rule {rule}" + (f", wildcards {wildcards}" if wildcards else "")
        return f"{what}; {job['name']}"
    return job["name"]


def interrupt_controller(message: str) -> None:
    """Fail the run: SIGINT to this (the controller's) process, as from Ctrl-C."""
    os.kill(os.getpid(), signal.SIGINT)


class Watchdog(threading.Thread):
    def __init__(self, workdir: str | Path, interval_s: float = 30.0, max_refusals: int = 3,
                 on_fatal=interrupt_controller):  # fmt: skip
        super().__init__(name="tokenmill-preemption-watchdog", daemon=True)
        self.workdir = str(workdir)
        self.interval_s = interval_s
        self.max_refusals = max_refusals
        self.on_fatal = on_fatal
        self.requeued: dict[str, int] = {}  # job id -> times requeued by us
        self.refused: dict[str, int] = {}  # job id -> requeues SLURM refused in a row
        self.stuck: dict[str, str] = {}  # job id -> never-clearing reason seen last check
        self._halt = threading.Event()

    def check_once(self) -> list[str]:
        """Requeue the preempted jobs (their ids are returned); RunCannotFinish when a job
        cannot run."""
        done = []
        stuck = {}
        for job in queued_jobs(self.workdir):
            jid = job["id"]
            if job["state"] == "PENDING":
                if job["reason"] in NEVER_CLEARS:
                    if self.stuck.get(jid) == job["reason"]:
                        raise RunCannotFinish(
                            f"SLURM job {jid} ({which(job)}) can never start: it pends with "
                            f"reason {job['reason']}, which waiting does not clear. It asked "
                            f"for {describe(job)}. Lower the request (profile `cores`, "
                            "`generation.resources`, a category's `resources`) or fix the "
                            "site values (partition, account, qos) in your profile."
                        )
                    stuck[jid] = job["reason"]
                continue
            ok, msg = requeue(jid)
            if ok:
                self.refused.pop(jid, None)
                self.requeued[jid] = self.requeued.get(jid, 0) + 1
                done.append(jid)
                _say(
                    f"SLURM job {jid} was preempted and cancelled (PreemptMode=CANCEL); "
                    f"requeued it with `scontrol requeue` (same job id, requeue "
                    f"#{self.requeued[jid]}; it resumes from the journal once SLURM starts it "
                    "again)"
                )
                continue
            self.refused[jid] = self.refused.get(jid, 0) + 1
            _say(
                f"could not requeue preempted SLURM job {jid}: {msg} "
                f"(refusal {self.refused[jid]} of {self.max_refusals})"
            )
            if self.refused[jid] >= self.max_refusals:
                raise RunCannotFinish(
                    f"SLURM job {jid} ({which(job)}) was preempted and cancelled, and SLURM "
                    f"refused to requeue it {self.refused[jid]} times in a row (last: {msg}). "
                    "The controller would wait for it forever. Check the job was submitted "
                    "requeueable (profile `slurm-requeue: true`, JobRequeue in slurm.conf)."
                )
        self.stuck = stuck
        return done

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            try:
                self.check_once()
            except (OSError, subprocess.SubprocessError) as exc:
                _say(f"preemption watchdog: {exc}")
            except RunCannotFinish as exc:
                _say(f"FAILING THE RUN: {exc}")
                self._halt.set()
                self.on_fatal(str(exc))

    def stop(self) -> None:
        self._halt.set()


def start_for_workflow(workflow, jobs, workdir: str | Path = ".") -> Watchdog | None:
    """Start the watchdog when the controller submits to SLURM (called from onstart), unless
    jobs.preemption_watch is off. `jobs`: settings.JobsSettings."""
    plugin = getattr(workflow, "executor_plugin", None)
    if "slurm" not in (getattr(plugin, "cli_prefix", None), getattr(plugin, "name", None)):
        return None
    if not jobs.preemption_watch:
        return None
    if not (shutil.which("squeue") and shutil.which("scontrol")):
        return None
    # 15 s: a job that can never start fails the run within a minute (two checks in a row)
    interval = float(jobs.preemption_watch_s)
    dog = Watchdog(Path(workdir).resolve(), interval)
    dog.start()
    _say(
        f"preemption watchdog on (every {interval:.0f} s): requeues jobs cancelled by "
        "preemption, fails the run on a job that can never start"
    )
    return dog
