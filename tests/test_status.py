"""`tokenmill status` during a run and after it, and the controller's progress line.

A real Snakemake run (local profile) whose managed engine is the stand-in SGLang server with
0.25 s per request, so generation lasts long enough to be asked about: while it runs, the
status names a running shard with fewer answers than planned and a rate; the controller's own
console prints the progress line; after the run every shard is done and the numbers add up to
the dataset's inputs. A run whose engine cannot start leaves a failed shard, with its cause.
"""

from __future__ import annotations

import subprocess
import time

import fake_sglang
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import BIN, copy_workflow, snakemake, tool_env

pytestmark = pytest.mark.e2e


def status(workdir, configfile: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "tokenmill"), "status", "--configfile", configfile],
        cwd=workdir, env=tool_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def rows_of(out: str) -> dict[str, list[str]]:
    """{"category/shard": [answered, planned, state, ...]} from the status table."""
    table = {}
    for line in out.splitlines()[1:]:
        if not line.strip():
            break
        cells = line.split()
        table[f"{cells[0]}/{cells[1]}"] = cells[2:]
    return table


def test_status_during_and_after_a_run_and_the_console_progress(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["categories"] = {"code": {**config["categories"]["code"], "shards": 2}}
    fake = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}"]
    config["generation"]["launch"]["command"] = [*fake, "--port", "{port}", "--latency", "0.25"]
    config["generation"]["concurrency"] = 1
    (workdir / "slow.yaml").write_text(yaml.safe_dump(config))

    cmd = [str(BIN / "snakemake"), "--profile", "profiles/local", "--cores", "1"]
    run = subprocess.Popen(
        [*cmd, "--configfile", "slow.yaml"], cwd=workdir,
        env=tool_env(TOKENMILL_PROGRESS_S="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    seen = None
    deadline = time.monotonic() + 600
    while run.poll() is None and time.monotonic() < deadline:
        now = status(workdir, "slow.yaml")
        running = {k: v for k, v in rows_of(now.stdout).items() if v[2:3] == ["running"]}
        for shard, cells in running.items():
            answered, planned = int(cells[0]), int(cells[1])
            if 0 < answered < planned:
                seen = (shard, answered, planned, now.stdout)
        if seen:
            break
        time.sleep(0.5)
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out[-4000:]
    assert seen, "no status showed a running shard part way"
    shard, answered, planned, text = seen
    assert "answers/s" in text and "prompts/s now" in text, text
    assert f"generate {answered:,} of" in text or "tokenmill: generate" in text, text
    # The controller printed progress while the generate jobs ran.
    progress = [line for line in out.splitlines() if line.startswith("tokenmill: generate ")]
    assert progress and any(" running" in line for line in progress), out[-3000:]

    after = status(workdir, "slow.yaml")
    assert after.returncode == 0, after.stdout + after.stderr
    table = rows_of(after.stdout)
    assert set(table) == {"code/000", "code/001"}
    assert all(cells[2] == "done" and cells[0] == cells[1] for cells in table.values()), table
    tokenized = sum(
        pq.read_metadata(workdir / f"results/tokenized/code/{s}.parquet").num_rows
        for s in ("000", "001")
    )
    assert f"generate {tokenized:,} of {tokenized:,} prompts answered (100%)" in after.stdout


def test_status_names_a_failed_shard_and_its_cause(tmp_path):
    workdir = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["categories"] = {"chat": {**config["categories"]["chat"], "shards": 1}}
    fake = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}"]
    config["generation"]["launch"]["command"] = [*fake, "--port", "{port}", "--exit-at-start", "3"]
    config["generation"]["launch"]["startup_timeout_s"] = 30
    (workdir / "broken.yaml").write_text(yaml.safe_dump(config))
    run = snakemake(workdir, "--configfile", "broken.yaml")
    assert run.returncode != 0

    after = status(workdir, "broken.yaml")
    assert after.returncode == 1, after.stdout + after.stderr
    assert rows_of(after.stdout)["chat/000"][2] == "failed", after.stdout
    cause = after.stdout.split("failed shards:\n", 1)[1].splitlines()[0]
    assert cause.startswith("  chat/000: ") and "exited" in cause, after.stdout
    assert "1 failed" in after.stdout.splitlines()[-1]


def test_journal_lines_are_counted_from_where_the_last_count_ended(tmp_path):
    """The controller asks every minute: an append-only journal file is read from where the
    last count ended; a file replaced under its name (compaction, migration) is recounted."""
    from tokenmill import status

    path = tmp_path / "000.host.1.2.jsonl"
    path.write_bytes(b"a\tx\n" * 1000)
    assert status._lines(path) == 1000
    with open(path, "r+b") as f:  # bytes already counted: a re-read would see 3 lines more
        f.write(b"\n\n\n\n")
    with open(path, "ab") as f:
        f.write(b"b\ty\n" * 5 + b"torn")
    assert status._lines(path) == 1005  # only the appended bytes were read
    replaced = tmp_path / "new"
    replaced.write_bytes(b"c\n" * 3)
    replaced.replace(path)  # another inode under the same name
    assert status._lines(path) == 3
    path.unlink()
    assert status._lines(path) == 0 and str(path) not in status._COUNTED
