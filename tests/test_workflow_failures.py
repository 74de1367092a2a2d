"""End to end: a config mistake that every request pays for fails the real Snakemake run loudly.

The reference engine (managed) gets `max_new_tokens` larger than its context: every request is
a 400 that blames the prompt ("Requested token count exceeds the model's maximum context
length"). Before, each became a permanent engine_rejected row and the run was green with empty
shards. Now the generate job fails with the counts and the first messages, journals none of
those rejections, the profile's retries are refused (nothing is sent twice), and the corrected
config gives a green run with rows.

With the stand-in SGLang server (tests/fake_sglang.py) as the managed engine, the local
profile's `retries: 2` is the only retry count: an engine that fails at start runs generate
3 times (3 engine starts), a config every request refuses is paid once (the retries exit at
once), and generate.log keeps every attempt's lines under a header each.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import fake_sglang
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import BIN, copy_workflow, snakemake

from tokenmill.settings import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_all_400_config_fails_loudly_and_caches_nothing(tmp_path):
    workdir = copy_workflow(tmp_path)
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["categories"] = {"chat": {**config["categories"]["chat"], "shards": 1}}
    config["generation"]["sampling"]["max_new_tokens"] = 5000  # the demo model's context: 4096
    (workdir / "bad.yaml").write_text(yaml.safe_dump(config))

    bad = snakemake(workdir, "--configfile", "bad.yaml")
    assert bad.returncode != 0, bad.stdout[-3000:]
    said = bad.stdout + bad.stderr
    assert "Error in rule generate_shard" in said, said[-4000:]
    log = (workdir / "results/logs/generate/chat/000/generate.log").read_text()
    assert "prompts refused by the engine" in log and "max_fraction" in log, log[-3000:]
    assert "exceeds the model's maximum context length" in log
    assert not (workdir / "results/generated/chat/000.parquet").exists()
    journal = workdir / "journal/chat"  # journal_dir: journal (it read an empty folder)
    statuses = [
        json.loads(line.rsplit("\t", 1)[0])["status"]
        for f in journal.glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert "rejected" not in statuses  # nothing cached as a permanent rejection
    # a deterministic failure: the profile's two retries are refused before an engine starts
    assert log.count("=== tokenmill generate attempt:") == 3
    assert log.count("an earlier attempt") == 2, log[-3000:]

    config["generation"]["sampling"]["max_new_tokens"] = 16
    # 16 tokens cut most of chat's answers, which merge's rejection guard stops (tested in
    # test_guards.py); this test is about the refused requests, so that guard is off here
    config["reject_limits"] = {"merge": {"max_fraction": 1.0}}
    (workdir / "fixed.yaml").write_text(yaml.safe_dump(config))
    good = snakemake(workdir, "--configfile", "fixed.yaml")
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-5000:]
    rows = pq.read_table(workdir / "results/dataset/chat/000.parquet").num_rows
    assert rows > 0


def test_profile_retries_are_the_only_count_and_a_fail_fast_is_paid_once(tmp_path):
    workdir = copy_workflow(tmp_path)
    profile = yaml.safe_load((workdir / "profiles/local/config.yaml").read_text())
    assert profile["retries"] == 2
    counter = tmp_path / "requests.jsonl"
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["categories"] = {"chat": {**config["categories"]["chat"], "shards": 1}}
    fake = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}"]
    fake += ["--port", "{port}", "--counter-file", str(counter)]
    gen = config["generation"]
    gen["launch"]["command"] = [*fake, "--exit-at-start", "3"]
    gen["launch"]["startup_timeout_s"] = 30
    gen["retry"] = {"backoff_initial_s": 0.05, "backoff_max_s": 0.1}
    (workdir / "starts.yaml").write_text(yaml.safe_dump(config))
    logs = workdir / "results/logs/generate/chat/000"

    # An engine that fails at start is transient for all the job knows: 1 + retries runs.
    run = snakemake(workdir, "--configfile", "starts.yaml")
    assert run.returncode != 0, run.stdout[-3000:]
    history = (logs / "generate.log").read_text()
    assert history.count("=== tokenmill generate attempt:") == 3, history[-4000:]
    assert (logs / "engine.log").read_text().count("engine start #") == 3
    assert counter.exists() is False
    # the run's last ten lines say which job failed, why, and where its log is
    last = "\n".join((run.stdout + run.stderr).strip().splitlines()[-10:])
    assert "  generate chat/000: " in last and "exited" in last, last
    assert "(log results/logs/generate/chat/000/generate.log)" in last, last
    # the runtime asked for grows with the attempt (generation.resources.runtime_min x attempt)
    runtimes = re.findall(r"runtime (\d+) min", history)
    assert len(set(runtimes)) == 3 and runtimes == sorted(runtimes, key=int), runtimes

    # Every request answered with the same 500: the first attempt fails fast, the scheduler's
    # two retries exit at once, naming it; one attempt's worth of requests in all.
    gen["launch"]["command"] = [*fake, "--fail-500", "1000000"]
    (workdir / "refused.yaml").write_text(yaml.safe_dump(config))
    run = snakemake(workdir, "--configfile", "refused.yaml")
    assert run.returncode != 0, run.stdout[-3000:]
    history = (logs / "generate.log").read_text()
    assert history.count("=== tokenmill generate attempt:") == 6, history[-4000:]
    first = re.findall(r"generate failed: none of the first (\d+) requests of this job", history)
    assert len(first) == 1, history[-4000:]
    assert history.count("an earlier attempt") == 2
    last = "\n".join((run.stdout + run.stderr).strip().splitlines()[-10:])
    assert "  generate chat/000: " in last and "an earlier attempt" in last, last
    # One engine start for the three attempts: every request went to the first attempt's
    # engine, at most what it had in flight (generation.concurrency 32) when it stopped. It was
    # 96 for the 3 attempts before.
    assert (logs / "engine.log").read_text().count("engine start #") == 3 + 1
    requests = fake_sglang.count_requests(counter)
    # the message counts the requests sent; the server logs those it answered (the ones in
    # flight when the job stopped may never reach its log): at most one attempt's worth
    settings = Settings.from_config(config).generation  # the schema's defaults filled in
    assert int(first[0]) <= settings.concurrency + settings.retry.fail_fast_after
    assert settings.retry.fail_fast_after <= requests <= int(first[0])
    # The first phase's lines are still there: no attempt erased an earlier one's log.
    assert history.count("generate failed:") == 3 + 1 + 2, history[-4000:]
    # Snakemake's own log of the job: the last attempt only.
    attempt = (logs / "attempt.log").read_text()
    assert "an earlier attempt" in attempt and "tokenmill generate attempt:" not in attempt


def test_a_category_over_its_refusal_share_is_judged_once_and_pays_each_prompt_once(tmp_path):
    """Issue 28: a fifth of `code`'s prompts refused by the engine (every time), limit 5 %. No
    shard alone is proof (4 of 20 can be chance at 5 %), so both generate jobs finish; the
    category's verdict fails the run in one line at its end. Each prompt was sent once and each
    shard started one engine; running again sends nothing and says the same; a raised limit
    gives a green run without a request."""
    workdir = copy_workflow(tmp_path)
    counter = tmp_path / "requests.jsonl"
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["categories"] = {"code": {**config["categories"]["code"], "shards": 2}}
    fake = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}"]
    fake += ["--port", "{port}", "--counter-file", str(counter), "--reject-share", "0.3"]
    gen = config["generation"]
    gen["launch"]["command"] = fake
    gen["reject_limit"] = {"max_fraction": 0.05, "min_count": 1}
    (workdir / "share.yaml").write_text(yaml.safe_dump(config))

    run = snakemake(workdir, "--configfile", "share.yaml")
    assert run.returncode != 0, run.stdout[-3000:]
    last = "\n".join((run.stdout + run.stderr).strip().splitlines()[-10:])
    verdict = re.search(r"category 'code', stage generate: (\d+) of (\d+) rejected .* over its "
                        r"2 shards", last)  # fmt: skip
    assert verdict, last
    refused, prompts = int(verdict[1]), int(verdict[2])
    assert refused / prompts > 0.05 and "  verdict code: " in last, last
    tokenized = sum(
        pq.ParquetFile(f).metadata.num_rows
        for f in (workdir / "results/tokenized/code").glob("*.parquet")
    )
    assert prompts == tokenized
    assert fake_sglang.count_requests(counter) == tokenized  # every prompt once
    for shard in ("000", "001"):
        logs = workdir / f"results/logs/generate/code/{shard}"
        assert (logs / "generate.log").read_text().count("=== tokenmill generate attempt:") == 1
        assert (logs / "engine.log").read_text().count("engine start #") == 1
        assert (workdir / f"results/dataset/code/{shard}.parquet").exists()  # kept, paid for
    assert not (workdir / "results/rejected/verdict/code.json").exists()
    assert not (workdir / "results/dataset/README.md").exists()  # nothing publishes it

    again = snakemake(workdir, "--configfile", "share.yaml")
    assert again.returncode != 0 and verdict[0] in again.stdout + again.stderr
    assert fake_sglang.count_requests(counter) == tokenized
    gen["reject_limit"] = {"max_fraction": 0.5, "min_count": 1}
    (workdir / "share.yaml").write_text(yaml.safe_dump(config))
    raised = snakemake(workdir, "--configfile", "share.yaml")
    assert raised.returncode == 0, raised.stdout[-3000:] + raised.stderr[-3000:]
    assert fake_sglang.count_requests(counter) == tokenized
    assert (workdir / "results/rejected/verdict/code.json").exists()


def test_restarted_controller_waits_for_its_orphaned_job_and_completes(tmp_path):
    """The controller is SIGKILLed mid-generate; its generate job runs on (an orphan). The
    restarted controller's job finds the shard locked, waits for the holder, and completes from
    its journal: the run succeeds, every sample once, and generate.log keeps the holder's lines."""
    workdir = copy_workflow(tmp_path)
    counter, hold = tmp_path / "requests.jsonl", tmp_path / "hold"
    hold.write_text("5")  # 5 answered, then every request is held
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["categories"] = {"chat": {**config["categories"]["chat"], "shards": 1}}
    config["generation"]["launch"]["command"] = [
        "{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}",
        "--port", "{port}", "--counter-file", str(counter), "--hold-file", str(hold),
    ]  # fmt: skip
    config["jobs"] = {"lock_wait_s": 300, "lock_poll_s": 0.5}  # the newcomer waits that long
    (workdir / "run.yaml").write_text(yaml.safe_dump(config))
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    cmd = [str(BIN / "snakemake"), "--profile", "profiles/local", "--cores", "2"]
    cmd += ["--configfile", "run.yaml"]
    with open(tmp_path / "controller-a.log", "w") as log_a:  # the child keeps its own copy
        first = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log_a, stderr=subprocess.STDOUT)
    second = holder = None
    try:
        lock = workdir / "journal/_jobs/generate/chat/000/lock.json"  # journal_dir: journal
        deadline = time.monotonic() + 600
        while fake_sglang.count_requests(counter) < 5 and time.monotonic() < deadline:
            assert first.poll() is None, (tmp_path / "controller-a.log").read_text()[-3000:]
            time.sleep(0.5)
        assert lock.exists()
        holder = json.loads(lock.read_text())["pid"]
        first.kill()  # SIGKILL: the controller only; its generate job runs on
        first.wait(timeout=30)
        assert os.path.exists(f"/proc/{holder}")

        unlock = snakemake(workdir, "--configfile", "run.yaml", "--unlock")
        assert unlock.returncode == 0, unlock.stderr[-2000:]
        second = subprocess.Popen(
            cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        history = workdir / "results/logs/generate/chat/000/generate.log"
        deadline = time.monotonic() + 300
        while "Waiting up to 300 s" not in history.read_text() and time.monotonic() < deadline:
            assert second.poll() is None
            time.sleep(0.5)
        hold.unlink()  # the orphan goes on and finishes its shard
        out, _ = second.communicate(timeout=600)
        assert second.returncode == 0, out[-4000:]
        text = history.read_text()
        assert text.count("=== tokenmill generate attempt:") == 2, text[-4000:]
        holder_part = text.split("=== tokenmill generate attempt:")[1]
        assert "INFO" in holder_part  # the holder's first lines, before the restart: still there
        assert "Waiting up to 300 s" in text and "generate failed" not in text, text[-4000:]
        engine_log = (workdir / "results/logs/generate/chat/000/engine.log").read_text()
        assert engine_log.count("engine start #") == 1  # the waiting job started none
        ids = [
            pid
            for name in ("generated/chat/000.parquet", "rejected/generate/chat/000.parquet")
            for pid in pq.read_table(workdir / "results" / name).column("prompt_id").to_pylist()
        ]
        assert len(ids) == len(set(ids)) and fake_sglang.count_requests(counter) == len(ids)
    finally:  # never leave a controller, the orphan or its engine behind
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        if holder is not None and os.path.exists(f"/proc/{holder}"):
            os.kill(holder, 15)


def test_a_systemic_failure_stops_every_shard_of_the_run_after_one_batch(tmp_path):
    """Issue 28: every request of the run is answered with the same 500 (the engine refuses
    the requests' shape: no shard can do better). Three shards, run one after the other as a
    queue starts them (--cores 1, --keep-going): the first fails fast after one in-flight batch
    and records the failure run-wide; the two later shards are refused before they start an
    engine. One engine start and one batch of requests in all (before: three of each)."""
    workdir = copy_workflow(tmp_path)
    counter = tmp_path / "requests.jsonl"
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["categories"] = {"code": {**config["categories"]["code"], "shards": 3}}
    fake = ["{python}", fake_sglang.FAKE, "--model-path", "{model}", "--host", "{host}"]
    fake += ["--port", "{port}", "--counter-file", str(counter), "--fail-500", "1000000"]
    gen = config["generation"]
    gen["launch"]["command"] = fake
    gen["concurrency"] = 4
    (workdir / "systemic.yaml").write_text(yaml.safe_dump(config))

    run = snakemake(workdir, "--configfile", "systemic.yaml", "--cores", "1", "--keep-going")
    assert run.returncode != 0, run.stdout[-3000:]
    said = run.stdout + run.stderr
    starts = {
        s: (workdir / f"results/logs/generate/code/{s}/engine.log") for s in ("000", "001", "002")
    }
    engine_starts = sum(
        p.read_text().count("engine start #") for p in starts.values() if p.exists()
    )
    assert engine_starts == 1, said[-3000:]
    requests = fake_sglang.count_requests(counter)
    settings = Settings.from_config(config).generation
    assert 0 < requests <= settings.concurrency + settings.retry.fail_fast_after, requests
    # The shards that never started name the one that failed, and why, in the run's last lines.
    last = "\n".join(said.strip().splitlines()[-12:])
    assert "failed for a reason every shard shares with this config" in last, last
    assert "HTTP 500" in last, last
    record = workdir / "journal/_jobs/generate/run_failure.json"
    assert json.loads(record.read_text())["identity"]["generation_fingerprint"]
    # tokenmill status says it too, with every shard failed and why.
    status = subprocess.run(
        [str(BIN / "tokenmill"), "status", "--configfile", "systemic.yaml"],
        cwd=workdir, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 1, status.stdout + status.stderr
    assert "3 failed" in status.stdout and "the run's generate jobs stop: " in status.stdout
