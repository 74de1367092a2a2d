"""The GPU-job harness: what every job that runs an engine on one shard (generate,
hidden_states) does around its own work, in one place.

    spec = JobSpec(stage, category, shard, layout, log, gpus, settings.jobs, identity)
    with GpuJob(spec) as job:     # 1. the shard's lock (waits for a live holder: lock.py)
                                  # 2. refuses an attempt that a recorded deterministic failure
                                  #    says would fail the same way (Refused, before any engine)
                                  # 3. closes a previous attempt killed without a word, from its
                                  #    last heartbeat ("killed")
                                  # 4. this attempt's record, and its heartbeat every heartbeat_s
        ...the stage's work...    #    (SIGTERM/SIGINT: the stage stops and calls job.interrupted)
        attempts = job.succeeded()   # this attempt "ok"; every attempt since the shard's last
                                     # success: the job record's `attempts`, its GPU-hours
    # leaving with an error: the attempt "failed" with its cause in one line (a deterministic
    # one also in failure.json: the next attempt with the same identity is refused); after a
    # signal: "interrupted"; then the lock is released.

Where (layout.Layout): {journal}/_jobs/{stage}/{category}/{shard}/ holds lock.json, attempts.jsonl
(contracts.Attempt lines, appended; the last line of an attempt id wins), alive.json (the running
attempt's last heartbeat, an Attempt) and failure.json (contracts.FailureRecord). The journal is
outside Snakemake's outputs: a failed job's records survive it, and the run's closing summary and
`tokenmill status` read them.

GPU-hours: an attempt's wall time (process start to its end, or to its last heartbeat when it
was killed) x the GPUs it held (`held`: SLURM's allocation, else the configured resources;
None for external servers). Failed, interrupted, refused and killed attempts count: they were
paid for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from tokenmill import contracts, layout
from tokenmill.contracts import Attempt, FailureRecord, Held, SlurmJob
from tokenmill.jobs import lock

log = logging.getLogger("tokenmill.jobs")

KILLED_CAUSE = (
    "ended without a word: killed (SIGKILL, out of memory, a lost node, or a time limit past "
    "its grace period)"
)


class Refused(RuntimeError):
    """An earlier attempt failed with this very config for a reason a retry cannot change."""


class Interrupted(BaseException):
    """SIGTERM or SIGINT reached a job whose work is synchronous (GpuJob.catch_signals)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass(frozen=True)
class JobSpec:
    stage: str
    category: str
    shard: str
    layout: layout.Layout
    log: str  # the job's log, every attempt appended (layout.job_log)
    gpus: int | None  # what the job holds (held(...).gpus)
    settings: object  # settings.JobsSettings: lock wait and poll, heartbeat
    identity: dict | None = None  # what a deterministic failure holds for (None: never recorded)
    deterministic: tuple[type[BaseException], ...] = ()
    # A failure every shard shares (recorded run-wide: the stage's other jobs stop on it) and
    # what it holds for (the config without the shard).
    run_identity: dict | None = None
    systemic: tuple[type[BaseException], ...] = ()


def shared_failure(path, identity: dict, own_shard: tuple[str, str]) -> str | None:
    """The one-line cause of the run-wide failure recorded at `path` for this identity by
    another shard than `own_shard` (category, shard), or None. A shard's own failure is its
    own record's business (failure.json: deleting it lets that shard try again)."""
    try:
        rec = FailureRecord.read(path)
    except contracts.RecordError:
        return None
    if rec.identity != identity or (rec.category, rec.shard) == tuple(own_shard):
        return None
    first = next((line for line in rec.message.splitlines() if line.strip()), "")
    return (
        f"the generate job of {rec.category}/{rec.shard} ({rec.time}) failed for a reason every "
        f"shard shares with this config: {first[:300]}"
    )


def slurm_job(env=None) -> SlurmJob:
    """The SLURM job this process runs in. Snakemake's jobstep executor drops every SLURM_*
    variable but the job id before it runs the job (snakemake-executor-plugin-slurm-jobstep,
    `keep_slurm`), so a requeued job read SLURM_RESTART_COUNT as absent (restart 0) and its
    nodelist as null: those come from `scontrol show job -o` when the environment lacks them."""
    env = os.environ if env is None else env
    job = SlurmJob.from_environ(env)
    if job.job_id is None or ("SLURM_RESTART_COUNT" in env and job.nodelist is not None):
        return job
    try:
        line = subprocess.run(
            ["scontrol", "show", "job", "-o", job.job_id],
            capture_output=True, text=True, timeout=10,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return job
    restarts = re.search(r"\bRestarts=(\d+)", line)
    nodes = re.search(r"\bNodeList=(\S+)", line)
    return job.replace(
        restart_count=int(restarts[1]) if restarts else job.restart_count,
        nodelist=job.nodelist or (nodes[1] if nodes and nodes[1] != "(null)" else None),
    )


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def one_line(exc: BaseException) -> str:
    """An exception's message as one line: its first line, at most 500 characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 500 else text[:497] + "..."


def process_age_s() -> float:
    """Seconds since this process started (imports included), from /proc; 0 elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def held(managed: bool, gpus_per_node: int, nnodes: int, source: str, engine_version=None,
         environ=None) -> Held:  # fmt: skip
    """What a job holds, for its cost.

    - external servers (managed False): their GPUs are not the job's: every count null;
    - inside a SLURM allocation: SLURM_JOB_NUM_NODES and SLURM_GPUS_ON_NODE (else
      SLURM_GPUS_PER_NODE, else the devices in CUDA_VISIBLE_DEVICES; none of them: 0);
    - elsewhere: `gpus_per_node` x `nnodes` as configured (`source` says where from).
    """
    env = os.environ if environ is None else environ
    if not managed:
        return Held(None, None, None, engine_version, "external servers")
    if env.get("SLURM_JOB_ID"):
        nodes = _int(env.get("SLURM_JOB_NUM_NODES")) or 1
        per_node, where = _int(env.get("SLURM_GPUS_ON_NODE")), "SLURM_GPUS_ON_NODE"
        if per_node is None:
            per_node, where = _int(env.get("SLURM_GPUS_PER_NODE")), "SLURM_GPUS_PER_NODE"
        if per_node is None and env.get("CUDA_VISIBLE_DEVICES") is not None:
            visible = [d for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
            per_node, where = len(visible), "CUDA_VISIBLE_DEVICES"
        if per_node is None:
            per_node, where = 0, "no GPUs in the allocation"
        return Held(per_node, nodes, per_node * nodes, engine_version,
                    f"SLURM allocation: SLURM_JOB_NUM_NODES, {where}")  # fmt: skip
    return Held(gpus_per_node, nnodes, gpus_per_node * nnodes, engine_version, source)


def _int(value) -> int | None:
    """The leading integer of a SLURM count ("4", "4(x2)", "gpu:4" -> 4), None if none."""
    if value is None:
        return None
    text = str(value).split("(")[0].rsplit(":", 1)[-1].strip()
    return int(text) if text.isdigit() else None


# ------------------------------------------------------------------------------- records


def read_attempts(path) -> list[Attempt]:
    """Every attempt of a job, in the order they started (the last line of each id wins; a line
    torn by a kill is skipped)."""
    latest: dict[str, Attempt] = {}
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        try:
            a = Attempt.from_json(json.loads(line), str(path))
        except (ValueError, contracts.RecordError):
            continue
        latest.pop(a.id, None)
        latest[a.id] = a
    return sorted(latest.values(), key=lambda a: a.started)


def since_last_success(attempts: list[Attempt]) -> list[Attempt]:
    """The attempts after the last one that succeeded (all of them when none did)."""
    last_ok = max((i for i, a in enumerate(attempts) if a.status == "ok"), default=-1)
    return attempts[last_ok + 1 :]


def append_attempt(path: Path, attempt: Attempt) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (contracts.canonical_json(attempt.to_json()) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, line)  # one write: a kill leaves the line whole or absent
        os.fsync(fd)
    finally:
        os.close(fd)


class GpuJob:
    """One attempt of one shard's GPU job (see the module docstring)."""

    def __init__(self, spec: JobSpec, environ=None):
        self.spec = spec
        env = os.environ if environ is None else environ
        lay, st = spec.layout, spec.stage
        self.attempts_path = Path(lay.attempts(st, spec.category, spec.shard))
        self.alive_path = self.attempts_path.with_name("alive.json")
        self.failure_path = Path(lay.failure_record(st, spec.category, spec.shard))
        self.run_failure_path = Path(lay.run_failure_record(st))
        self.lock_path = Path(lay.shard_lock(st, spec.category, spec.shard))
        self.t0 = time.monotonic() - process_age_s()
        started = datetime.now(UTC).timestamp() - (time.monotonic() - self.t0)
        self.attempt = Attempt(
            stage=st, category=spec.category, shard=spec.shard,
            id=f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}",
            host=socket.gethostname(), pid=os.getpid(), slurm=slurm_job(env),
            started=datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
            ended=None, status="running", cause=None, deterministic=False, gpus=spec.gpus,
            wall_s=0.0, log=spec.log,
        )  # fmt: skip
        self.signum: int | None = None
        self._held_lock: Path | None = None
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._done = False

    # --------------------------------------------------------------------------- entering
    def __enter__(self) -> GpuJob:
        s = self.spec
        self._held_lock = lock.acquire(
            self.lock_path, f"{s.category}/{s.shard}", s.settings.lock_wait_s,
            s.settings.lock_poll_s,
        )  # fmt: skip
        try:
            self._close_killed()
            earlier = self._recorded_failure()
            if earlier is not None:
                cause = (
                    f"an earlier attempt ({earlier.time}, SLURM job {earlier.slurm_job_id or '-'})"
                    f" failed with this same config for a reason a retry cannot change: "
                    f"{one_line(RuntimeError(earlier.message))}"
                )
                self._end("refused", cause, deterministic=True)
                raise Refused(
                    f"{cause}; not starting an engine. Change the config, or delete "
                    f"{self.failure_path} to try again. Its message:\n{earlier.message}"
                )
            shared = self.shared_failure()
            if shared is not None:
                self._end("refused", shared, deterministic=True)
                raise Refused(
                    f"{shared}; not starting an engine. Change the config, or delete "
                    f"{self.run_failure_path} to try again"
                )
            append_attempt(self.attempts_path, self.attempt)
            self._beat = threading.Thread(target=self._heartbeat, daemon=True)
            self._beat.start()
        except BaseException:
            self._release()
            raise
        return self

    def _close_killed(self) -> None:
        """A previous attempt still "running" (we hold the lock, so its process is gone) ended
        without a word: close it at its last heartbeat."""
        earlier = read_attempts(self.attempts_path)
        if not earlier or earlier[-1].status != "running":
            return
        last = earlier[-1]
        with contextlib.suppress(OSError, ValueError, contracts.RecordError):
            alive = Attempt.read(self.alive_path)
            if alive.id == last.id:
                last = alive
        ended = datetime.fromisoformat(last.started) + timedelta(seconds=last.wall_s)
        append_attempt(self.attempts_path, last.replace(
            status="killed", cause=KILLED_CAUSE, ended=ended.isoformat(timespec="seconds")
        ))  # fmt: skip

    def _recorded_failure(self) -> FailureRecord | None:
        if self.spec.identity is None:
            return None
        try:
            rec = FailureRecord.read(self.failure_path)
        except contracts.RecordError:
            return None
        return rec if rec.identity == self.spec.identity else None

    def shared_failure(self) -> str | None:
        """Another job's failure that every shard shares with this config (run-wide record)."""
        if self.spec.run_identity is None:
            return None
        own = (self.spec.category, self.spec.shard)
        return shared_failure(self.run_failure_path, self.spec.run_identity, own)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.spec.settings.heartbeat_s):
            with contextlib.suppress(OSError):
                self._snapshot(status="running").write(self.alive_path)

    # ------------------------------------------------------------------------------ during
    def wall_s(self) -> float:
        return round(time.monotonic() - self.t0, 3)

    def _snapshot(self, **changes) -> Attempt:
        return self.attempt.replace(wall_s=self.wall_s(), **changes)

    def interrupted(self, signum: int) -> None:
        """The stage's work was stopped by this signal (its own handler caught it)."""
        self.signum = self.signum or signum

    @contextlib.contextmanager
    def catch_signals(self):
        """SIGTERM and SIGINT raise Interrupted in synchronous work (generate's asyncio loop
        installs its own handlers and calls `interrupted`)."""

        def on_signal(signum, _frame):
            self.interrupted(signum)
            raise Interrupted(signum)

        old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def succeeded(self) -> list[Attempt]:
        """This attempt is "ok": every attempt since the shard's last success, this one last
        (the job record's `attempts`). A recorded deterministic failure is cleared."""
        final = self._snapshot(status="ok", ended=now_iso())
        earlier = [a for a in read_attempts(self.attempts_path) if a.id != final.id]
        append_attempt(self.attempts_path, final)
        self.attempt, self._done = final, True
        if self.failure_path.exists():
            self.failure_path.unlink(missing_ok=True)
        # a shard that succeeds with this config disproves a failure "every shard shares"
        if self.spec.run_identity is not None and self.run_failure_path.exists():
            with contextlib.suppress(OSError, contracts.RecordError):
                if FailureRecord.read(self.run_failure_path).identity == self.spec.run_identity:
                    self.run_failure_path.unlink(missing_ok=True)
        return [*since_last_success(earlier), final]

    # ---------------------------------------------------------------------------- leaving
    def __exit__(self, exc_type, exc, tb):
        try:
            if exc is None and self.signum is None:
                if not self._done:
                    self.succeeded()
            elif self.signum is not None or isinstance(exc, Interrupted | KeyboardInterrupt):
                sig = self.signum or getattr(exc, "signum", signal.SIGINT)
                self._end("interrupted", f"received {signal.Signals(sig).name} (a preemption, a "
                          "time limit, scancel or Ctrl-C): the next attempt resumes")  # fmt: skip
            else:
                deterministic = isinstance(exc, self.spec.deterministic)
                self._end("failed", one_line(exc), deterministic=deterministic)
                if deterministic and self.spec.identity is not None:
                    self._record_failure(exc, self.spec.identity, self.failure_path)
                if isinstance(exc, self.spec.systemic) and self.spec.run_identity is not None:
                    self._record_failure(exc, self.spec.run_identity, self.run_failure_path)
        finally:
            self._release()
        return False

    def _record_failure(self, exc: BaseException, identity: dict, path: Path) -> None:
        FailureRecord(
            stage=self.spec.stage, category=self.spec.category, shard=self.spec.shard,
            identity=identity, message=str(exc), time=now_iso(), attempt=self.attempt.id,
            slurm_job_id=self.attempt.slurm.job_id,
        ).write(path)  # fmt: skip

    def _end(self, status: str, cause: str, deterministic: bool = False) -> None:
        self.attempt = self._snapshot(
            status=status, cause=cause, deterministic=deterministic, ended=now_iso()
        )
        append_attempt(self.attempts_path, self.attempt)
        self._done = True

    def _release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        with contextlib.suppress(OSError):
            self.alive_path.unlink(missing_ok=True)
        if self._held_lock is not None:
            lock.release(self._held_lock)
            self._held_lock = None
