"""One process per shard and GPU stage: a lock file in the job's harness folder.

A controller that is restarted while its jobs still run (an SSH drop, a killed login node)
submits the running shards again (`rerun-incomplete`). Both jobs would pay for the same
samples. So a GPU job (generate, hidden_states; jobs/harness.py) first takes
`{journal_dir}/_jobs/{stage}/{category}/{shard}/lock.json` (layout.Layout.shard_lock), a JSON
record of who holds it: host, pid (and the pid's start time, against pid reuse), SLURM job id.

The holder is alive when it is on this host and its process still runs, or, on another host,
when its SLURM job is still running per `squeue -j`. A live holder makes the newcomer wait for
it (a log line names it; jobs.lock_wait_s, default 3600 s, checked every jobs.lock_poll_s,
default 10 s): once the holder is gone the newcomer takes the lock and finds the holder's
samples in the journal (a holder that finished the shard leaves it nothing to request). Still
held after the wait: it fails with a message that names the holder (the scheduler's next
attempt waits again). A dead holder's lock (SIGKILL, node crash) is taken over. A requeued
SLURM job finds its own job id in the lock and takes it over. Check-and-take runs under
flock(2) on `.shard-locks` beside the lock, so two newcomers cannot both take a stale lock (on
NFS this needs working locks: lockd for v3, built in for v4).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

log = logging.getLogger(__name__)

# squeue states of a job that may still be generating (everything else has ended or waits).
LIVE_STATES = {
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
    "RESIZING",
}


class ShardLocked(RuntimeError):
    """Another live process is generating this shard."""


def _pid_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else fields[19]


def _boot_id() -> str | None:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return None


def me() -> dict:
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "pid": pid,
        "pid_start": _pid_start(pid),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def squeue_state(job_id: str) -> str | None:
    """The job's state per squeue: "" when SLURM no longer lists it, None when unknown."""
    if not shutil.which("squeue"):
        return None
    try:
        proc = subprocess.run(
            ["squeue", "-h", "-j", str(job_id), "-o", "%T"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (subprocess.SubprocessError, OSError):
        return None
    if proc.returncode != 0:
        # An id that has left slurmctld's memory is an error, not an empty answer.
        return "" if "Invalid job id" in proc.stderr else None
    return proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""


def holder_alive(holder: dict, mine: dict) -> tuple[bool, str]:
    """(alive, why) for the process recorded in a lock."""
    job = holder.get("slurm_job_id")
    if job and job == mine.get("slurm_job_id"):
        return False, f"SLURM job {job} is this job (requeued or restarted)"
    same_boot = holder.get("boot_id") == mine.get("boot_id")
    if holder.get("host") == mine["host"] and same_boot:
        start = _pid_start(int(holder.get("pid", 0))) if holder.get("pid") else None
        if start is not None and start == holder.get("pid_start"):
            return True, f"pid {holder['pid']} on this host ({mine['host']}) is running"
        return False, f"pid {holder.get('pid')} on this host is gone"
    if job:
        state = squeue_state(job)
        if state is None:
            return True, f"SLURM job {job} on {holder.get('host')}: squeue cannot tell its state"
        if state in LIVE_STATES:
            return True, f"SLURM job {job} on {holder.get('host')} is {state}"
        return False, f"SLURM job {job} is {state or 'no longer known to SLURM'}"
    return True, (
        f"pid {holder.get('pid')} on {holder.get('host')} (another host, no SLURM job: cannot "
        "check it from here)"
    )


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # torn or unreadable: nobody can prove it is alive


def acquire(path, what: str, wait_s: float, poll_s: float) -> Path:
    """Take the lock at `path` (of shard `what`, "category/shard"), waiting up to `wait_s`
    (jobs.lock_wait_s) for a live holder; ShardLocked when it still holds it then."""
    path = Path(path)
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            return _try_acquire(path, what)
        except ShardLocked as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                if told:
                    waited = f" Waited {wait_s:.0f} s (jobs.lock_wait_s)."
                    raise ShardLocked(f"{exc}{waited}") from None
                raise
            if not told:
                log.warning(
                    "%s Waiting up to %.0f s (jobs.lock_wait_s) for it to end; this job "
                    "then resumes from the journal.", str(exc).split(" Not starting")[0], wait_s
                )  # fmt: skip
                told = True
            time.sleep(max(0.05, min(poll_s, left)))


def _try_acquire(path: Path, what: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    mine = me()
    with open(path.parent / ".shard-locks", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            holder = _read(path)
            if holder is not None:
                alive, why = holder_alive(holder, mine) if holder else (False, "unreadable")
                if alive:
                    raise ShardLocked(
                        f"shard {what} is being worked on by another process: "
                        f"{why} (lock {path}, held since {holder.get('since')}). Not starting "
                        "a second engine. If that process is really gone, delete the lock."
                    )
                log.warning("taking over the stale lock %s: %s", path, why)
            tmp = path.with_name(f".{path.name}.{mine['pid']}.tmp")
            tmp.write_text(json.dumps(mine, sort_keys=True) + "\n")
            os.replace(tmp, path)
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)
    return path


def release(path: Path) -> None:
    """Remove the lock if it is still ours (never someone else's)."""
    holder = _read(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def hold(path, what: str, wait_s: float, poll_s: float):
    path = acquire(path, what, wait_s, poll_s)
    try:
        yield path
    finally:
        release(path)
