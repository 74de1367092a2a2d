"""A deterministic failure is paid once (tokenmill/jobs/harness.py, the identity from
tokenmill/generate/failure.py): a job that failed fast (every request answered with the same
500) records it in the shard's harness folder; the next attempt with the same config exits at
once, before any engine starts or request is sent, naming the first attempt's message. A
changed config (operational keys too) or deleting the record retries; a transient failure is
never recorded; a successful run deletes the record. Every attempt, the refused ones too, is in
the shard's attempts record with its status and cause."""

from __future__ import annotations

import json
import os
from pathlib import Path

from test_generate import Run, _complete

from tokenmill.jobs.harness import read_attempts
from tokenmill.layout import Layout


def failure_path(journal_dir, category, shard) -> Path:
    return Path(Layout("results", str(journal_dir)).failure_record("generate", category, shard))


def attempts(journal_dir) -> list:
    return read_attempts(Layout("results", str(journal_dir)).attempts("generate", "chat", "003"))


def _engine_starts(r: Run) -> int:
    log = r.tmp / "logs" / "engine.log"
    return log.read_text().count("engine start #") if log.exists() else 0


def test_a_fail_fast_is_not_paid_twice_until_the_config_changes(tmp_path):
    r = Run(tmp_path, "--fail-500", "100000", n=40, concurrency=8)
    out = r.run(expect_rc=1)
    assert "all failed with the same answer, HTTP 500" in out
    first = r.requests()
    assert 0 < first <= 8 + 3
    rec = failure_path(r.journal_dir, "chat", "003")
    body = json.loads(rec.read_text())
    assert "HTTP 500" in body["message"] and body["identity"]["generation_fingerprint"]
    assert _engine_starts(r) == 1
    (first_attempt,) = attempts(r.journal_dir)
    assert (first_attempt.status, first_attempt.deterministic) == ("failed", True)
    assert "all failed with the same answer, HTTP 500" in first_attempt.cause

    for _ in range(2):  # the scheduler's retries: no engine, no request
        out = r.run(expect_rc=1)
        assert "an earlier attempt" in out and "not starting an engine" in out, out
        assert "HTTP 500: 'Internal Server Error'" in out and str(rec) in out
    assert r.requests() == first and _engine_starts(r) == 1
    refused = attempts(r.journal_dir)[1:]
    assert [a.status for a in refused] == ["refused", "refused"]
    assert all("an earlier attempt" in a.cause and "HTTP 500" in a.cause for a in refused)

    r.gen["concurrency"] = 4  # an operational change: tried again (and fails fast again)
    r.run(expect_rc=1)
    assert r.requests() > first and _engine_starts(r) == 2
    second = r.requests()
    rec.unlink()  # deleting the record: tried again
    r.run(expect_rc=1)
    assert r.requests() > second and rec.exists()

    # The server fixed (its launch command changed, so the fingerprint too): generates, and a
    # successful run deletes the record.
    r.gen["launch"]["command"] = [a for a in r.gen["launch"]["command"] if a != "100000"]
    r.gen["launch"]["command"].remove("--fail-500")
    r.run()
    assert not rec.exists()
    _complete(r, 40)


def test_a_transient_failure_is_not_recorded(tmp_path):
    """An engine that exits at start (it may be the node) and an unreachable engine are
    retried by the scheduler as before."""
    r = Run(tmp_path, "--exit-at-start", "3", n=4)
    r.run(expect_rc=1)
    r.run(expect_rc=1)
    assert _engine_starts(r) == 2
    assert not failure_path(r.journal_dir, "chat", "003").exists()


def test_slurm_job_reads_what_the_jobstep_executor_drops_from_scontrol(tmp_path, monkeypatch):
    """Inside a Snakemake SLURM job only SLURM_JOB_ID is left of SLURM_*: the restart count and
    the nodelist come from `scontrol show job -o` (here a stand-in on PATH); outside SLURM
    nothing is asked; with the variables set, they win."""
    from tokenmill.jobs import harness

    fake = tmp_path / "scontrol"
    fake.write_text(
        '#!/bin/sh\necho "JobId=$4 JobName=x Restarts=2 BatchFlag=1 NodeList=node[1-2] '
        'BatchHost=node1"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    job = harness.slurm_job({"SLURM_JOB_ID": "41"})
    assert (job.job_id, job.restart_count, job.nodelist) == ("41", 2, "node[1-2]")
    set_ = harness.slurm_job(
        {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "5", "SLURM_JOB_NODELIST": "n9"}
    )
    assert (set_.restart_count, set_.nodelist) == (5, "n9")
    outside = harness.slurm_job({})
    assert (outside.job_id, outside.restart_count, outside.nodelist) == (None, 0, None)
    fake.unlink()  # no scontrol at all: what the environment says
    assert harness.slurm_job({"SLURM_JOB_ID": "41"}).restart_count == 0
