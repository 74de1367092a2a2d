"""One generate process per shard (tokenmill/jobs/lock.py): a second `tokenmill
generate` on a shard that a live process is generating refuses at once (no engine, no request);
after that process is SIGKILLed its stale lock is taken over and the shard completes exactly once.
Locks held by SLURM jobs on other hosts are judged by `squeue -j` (a stand-in squeue here).
A newcomer waits for a live holder up to jobs.lock_wait_s (0 here, except in the test of the
wait), then resumes from the holder's journal."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
from test_generate import Run, _alive, _complete, _wait_for

from tokenmill.jobs import lock as shard_lock
from tokenmill.layout import Layout

NO_WAIT = {"lock_wait_s": 0}


def lock_path(journal_dir, category="chat", shard="003"):
    return Layout("results", str(journal_dir)).shard_lock("generate", category, shard)


def acquire(journal_dir, wait_s=0.0, poll_s=0.1):
    return shard_lock.acquire(lock_path(journal_dir, "chat", "001"), "chat/001", wait_s, poll_s)


def test_second_process_refuses_while_the_first_runs_then_takes_over_after_sigkill(tmp_path):
    hold = tmp_path / "hold"
    hold.write_text("5")  # 5 answered, then held: the first process stays mid-shard
    r = Run(tmp_path, "--latency", "0.02", "--hold-file", str(hold), n=30, jobs=NO_WAIT)
    first = r.start()
    _wait_for(lambda: r.journaled() >= 5)
    lock = Path(lock_path(tmp_path / "journal"))
    holder = json.loads(lock.read_text())
    assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()

    t0 = time.monotonic()
    out = r.run(expect_rc=1)
    assert time.monotonic() - t0 < 30
    assert "shard chat/003 is being worked on by another process" in out, out
    assert f"pid {first.pid} on this host" in out, out
    engine_log = (tmp_path / "logs" / "engine.log").read_text()
    assert engine_log.count("engine start #") == 1  # the second one started no engine
    assert first.poll() is None  # and left the first alone

    first.kill()
    first.wait(timeout=10)
    _wait_for(lambda: not _alive(r.engine_pids()[0]), timeout=10)
    assert lock.exists()  # SIGKILL: nobody removed it
    done, before = r.journaled(), r.requests()
    hold.unlink()
    out = r.run()
    assert "taking over the stale lock" in out and f"pid {first.pid} on this host is gone" in out
    assert r.requests() - before == 30 - done  # only the missing samples
    _complete(r, 30)
    assert not lock.exists()  # released at the end


@pytest.fixture
def fake_squeue(tmp_path, monkeypatch):
    """`squeue -h -j ID -o %T` answering from a file of `ID STATE` lines (absent: invalid id)."""
    states = tmp_path / "states"
    states.write_text("")
    script = tmp_path / "bin" / "squeue"
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        f'line=$(grep "^$3 " {states})\n'
        'if [ -z "$line" ]; then echo "slurm_load_jobs error: Invalid job id specified" >&2;'
        " exit 1; fi\n"
        'echo "${line#* }"\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    return states


def _foreign_lock(tmp_path, job: str | None) -> None:
    lock = Path(lock_path(tmp_path / "j", "chat", "001"))
    lock.parent.mkdir(parents=True)
    holder = {"host": "gpu-node-17", "pid": 4242, "slurm_job_id": job, "since": "then"}
    lock.write_text(json.dumps(holder))


def test_lock_of_a_running_slurm_job_elsewhere_is_respected(tmp_path, fake_squeue, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _foreign_lock(tmp_path, "981")
    fake_squeue.write_text("981 RUNNING\n")
    with pytest.raises(shard_lock.ShardLocked, match="SLURM job 981 on gpu-node-17 is RUNNING"):
        acquire(tmp_path / "j")
    fake_squeue.write_text("981 PENDING\n")  # requeued, not running: its lock is stale
    path = acquire(tmp_path / "j")
    assert json.loads(path.read_text())["pid"] == os.getpid()


def test_lock_of_an_ended_slurm_job_or_our_own_is_taken_over(tmp_path, fake_squeue, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _foreign_lock(tmp_path, "982")  # squeue: Invalid job id (ended long ago)
    shard_lock.release(acquire(tmp_path / "j"))
    (tmp_path / "j").rename(tmp_path / "old")
    _foreign_lock(tmp_path, "983")
    fake_squeue.write_text("983 RUNNING\n")
    monkeypatch.setenv("SLURM_JOB_ID", "983")  # we are that job, restarted after a requeue
    path = acquire(tmp_path / "j")
    assert json.loads(path.read_text())["slurm_job_id"] == "983"


def test_lock_without_a_way_to_check_is_respected(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _foreign_lock(tmp_path, None)  # another host, no SLURM job: nothing can prove it dead
    with pytest.raises(shard_lock.ShardLocked, match="cannot check it from here"):
        acquire(tmp_path / "j")


def test_newcomer_waits_for_a_live_holder_then_completes_from_its_journal(tmp_path, monkeypatch):
    """A restarted controller's job on a shard an orphaned job still generates: it waits (a
    log line names the holder), starts no engine, and once the holder has finished writes the
    shard from the journal with 0 requests of its own."""
    hold = tmp_path / "hold"
    hold.write_text("5")
    r = Run(tmp_path, "--latency", "0.02", "--hold-file", str(hold), n=30,
            jobs={"lock_wait_s": 120, "lock_poll_s": 0.2})  # fmt: skip
    first = r.start()
    _wait_for(lambda: r.journaled() >= 5)
    second = r.start()
    # Release the holder only once the newcomer says it waits (its imports alone can take
    # seconds on a loaded machine; released earlier, it would find the shard already done).
    lines: list[str] = []
    waiting = threading.Event()

    def read_second() -> None:
        for line in second.stdout:
            lines.append(line)
            if "Waiting up to 120 s" in line:
                waiting.set()

    reader = threading.Thread(target=read_second, daemon=True)
    reader.start()
    assert waiting.wait(120), "".join(lines)
    assert second.poll() is None  # waiting, not failed
    hold.unlink()  # the holder goes on and finishes the shard
    first_out, _ = first.communicate(timeout=90)
    assert first.returncode == 0, first_out
    requests = r.requests()
    assert requests == 30
    second.wait(timeout=60)
    reader.join(timeout=10)
    out = "".join(lines)
    assert second.returncode == 0, out
    assert "is being worked on by another process" in out and "Waiting up to 120 s" in out, out
    assert f"pid {first.pid} on this host" in out
    assert r.requests() == requests  # the newcomer asked for nothing
    engine_log = (tmp_path / "logs" / "engine.log").read_text()
    assert engine_log.count("engine start #") == 1
    _complete(r, 30)


def test_wait_for_a_live_holder_is_bounded(tmp_path, fake_squeue, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    _foreign_lock(tmp_path, "984")
    fake_squeue.write_text("984 RUNNING\n")
    t0 = time.monotonic()
    with pytest.raises(shard_lock.ShardLocked, match=r"SLURM job 984 .* Waited 1 s"):
        acquire(tmp_path / "j", wait_s=1.0, poll_s=0.1)
    assert 1.0 <= time.monotonic() - t0 < 10
