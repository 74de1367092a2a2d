"""A deterministic failure is paid once (tokenmill/jobs/harness.py, the identity from
tokenmill/generate/failure.py): a job that failed fast (every request answered with the same
500) records it in the shard's harness folder; the next attempt with the same config exits at
once, before any engine starts or request is sent, naming the first attempt's message. A
changed config (operational keys too) or deleting the record retries; a transient failure is
never recorded; a successful run deletes the record. Every attempt, the refused ones too, is in
the shard's attempts record with its status and cause."""

from __future__ import annotations

import json
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
