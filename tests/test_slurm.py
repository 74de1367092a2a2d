"""tokenmill on a REAL single-node SLURM cluster (slurm-wlm 22.05, slurmdbd, 2 fake GPUs), through
snakemake-executor-plugin-slurm, with the project's profile plus the test cluster's overrides:

    snakemake --profile profiles/slurm --profile tests/slurm/test-overrides --configfile C.yaml

- the whole pipeline: prepare/tokenize/merge as CPU jobs, generate as GPU jobs (--gpus=1) that
  each start the reference engine inside their allocation (CUDA_VISIBLE_DEVICES set there), and
  the same bytes as a local run of the same config;
- asking for more GPUs than the node has fails at submission with SLURM's message;
- a generate job killed at its time limit, one cancelled with scancel and one requeued with
  `scontrol requeue` (run with --slurm-requeue) all resume from the journal: the final shard
  holds every prompt exactly once and the engine got each prompt once (+ what was in flight);
- multi-node launch mechanics (generation.launch.nnodes > 1): one engine task per rank via srun
  inside the allocation, each with its rank and the head's address, all stopped at the end.

The cluster comes from tests/slurm/cluster.sh (root + apt). Without root or apt the module is
skipped, except under CI=true, where that is a failure. Run: pytest -m slurm tests/test_slurm.py
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import helpers
import pyarrow.parquet as pq
import pytest
import yaml
from helpers import BIN, ROOT, tool_env

from tokenmill import contracts

CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
PROBE = "tests/slurm/engine_probe.py"
PROBE_LOG = "engine-probe.jsonl"

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.e2e]

# The engine stand-in: the real reference engine, with a probe that logs each start/request/stop.
PROBE_COMMAND = [
    "{python}",
    PROBE,
    "--",
    "--model-path",
    "{model}",
    "--skip-tokenizer-init",
    "--host",
    "{host}",
    "--port",
    "{port}",
]


# ---------------------------------------------------------------------------------- helpers


def sh(*cmd: str, timeout: float = 60, check: bool = True) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def env() -> dict:
    # The controller's environment reaches the jobs (--export=ALL): `tokenmill` must be on PATH.
    return tool_env()


def copy_workflow(dest: Path) -> Path:
    """The workflow, the engine probe and the test cluster's profile overrides."""
    return helpers.copy_workflow(dest, extra=(PROBE, "tests/slurm/test-overrides"))


def make_config(**generation) -> dict:
    """The sample config cut down for a 2-CPU node: two categories, three shards."""
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["categories"] = {k: config["categories"][k] for k in ("code", "chat")}
    config["categories"]["code"]["shards"] = 2
    config["categories"]["chat"]["shards"] = 1
    config["dataset"]["export_jsonl"] = False
    gen = config["generation"]
    gen["launch"]["command"] = list(PROBE_COMMAND)
    gen["launch"]["env"] = {"TOKENMILL_PROBE_LOG": PROBE_LOG}
    gen["sampling"]["max_new_tokens"] = 64
    gen["concurrency"] = 4
    gen["resources"] = {"gpus": 1, "cpus": 1, "mem_mb": 2000, "runtime_min": 10}
    for key, value in generation.items():
        if isinstance(value, dict):
            gen[key] = {**gen.get(key, {}), **value}
        else:
            gen[key] = value
    return config


def write_config(workdir: Path, config: dict, name: str = "test-config.yaml") -> Path:
    path = workdir / name
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def snakemake_cmd(
    timeout_s: int, configfile: Path, *args: str, profile: str = "slurm", kill_after_s: int = 30
) -> list:
    if profile == "slurm":
        profiles = ["--profile", "profiles/slurm", "--profile", "tests/slurm/test-overrides"]
    else:
        profiles = ["--profile", "profiles/local", "--cores", "2"]
    # SIGINT, not SIGTERM: on SIGINT snakemake scancels its jobs; -k if that hangs. The -k clock
    # starts at any SIGINT that `timeout` forwards, a test's own included: a test that needs
    # Snakemake's orderly Ctrl-C exit (lock released) must give it kill_after_s to finish.
    # --configfile comes last: it takes several values and would swallow the targets.
    return [
        "timeout", "-s", "INT", "-k", str(kill_after_s), str(timeout_s),
        str(BIN / "snakemake"), *profiles, *args, "--configfile", str(configfile),
    ]  # fmt: skip


def start(workdir: Path, cmd: list, name: str) -> tuple[subprocess.Popen, Path]:
    out = workdir / f"{name}.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env(), stdout=f, stderr=subprocess.STDOUT)
    return proc, out


def finish(proc: subprocess.Popen, out: Path, timeout: float) -> tuple[int, str]:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    return rc, out.read_text()


def run(workdir: Path, cmd: list, name: str, timeout: float) -> tuple[int, str]:
    proc, out = start(workdir, cmd, name)
    return finish(proc, out, timeout)


def digests(root: Path, pattern: str) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.glob(pattern))
    }


def probe_events(workdir: Path) -> list[dict]:
    path = workdir / PROBE_LOG
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def slurm_jobs_of(workdir: Path, rule: str, wildcards: str | None = None) -> list[str]:
    """SLURM job ids of a rule's jobs, from the plugin's log layout slurm_logs/rule_R/W/ID.log."""
    base = workdir / "slurm_logs" / f"rule_{rule}"
    pattern = f"{wildcards}/*.log" if wildcards else "*/*.log"
    return sorted((p.stem for p in base.glob(pattern)), key=int)


def sacct(jobs: list[str]) -> dict[str, dict]:
    if not jobs:
        return {}
    out = sh(
        "sacct", "-X", "-n", "-P", "--duplicates", "-j", ",".join(jobs),
        "-o", "JobID,State,AllocTRES,ExitCode",
    )  # fmt: skip
    rows = {}
    for line in out.splitlines():
        jobid, state, tres, code = line.split("|")
        rows.setdefault(jobid, []).append({"state": state.split()[0], "tres": tres, "exit": code})
    return rows


def journal_records(workdir: Path, category: str, shard: str) -> int:
    """Records journaled for a shard: its attempt files' lines, plus the lines compacted into
    its Parquet file once the shard completed (a sample journaled twice counts twice)."""
    from tokenmill.generate import journal

    return journal.journaled_lines(workdir / "journal", category, shard)


def squeue_state(job: str) -> str:
    return sh("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()


def assert_exactly_once(workdir: Path, category: str, shard: str) -> set[str]:
    """Every tokenized prompt is in the generated shard or its rejected file, exactly once."""
    results = workdir / "results"
    tokenized = pq.read_table(results / f"tokenized/{category}/{shard}.parquet")
    generated = pq.read_table(results / f"generated/{category}/{shard}.parquet")
    rejected = pq.read_table(results / f"rejected/generate/{category}/{shard}.parquet")
    kept = generated.column("prompt_id").to_pylist()
    refused = rejected.column("prompt_id").to_pylist()
    assert len(kept) == len(set(kept)), "a prompt appears twice in the generated shard"
    assert sorted(kept + refused) == sorted(tokenized.column("prompt_id").to_pylist())
    return set(kept)


def requests_by_job(events: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in events:
        if e["event"] == "request":
            counts[e["job"]] = counts.get(e["job"], 0) + 1
    return counts


def running(pid: int) -> bool:
    """Alive and not a zombie (a slow PID 1 may not have reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def tail(text: str, n: int = 6000) -> str:
    return text[-n:]


# ---------------------------------------------------------------------------------- cluster


def _cannot_run_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (the SLURM daemons are started by tests/slurm/cluster.sh)"
    if not shutil.which("apt-get") and not shutil.which("slurmctld"):
        return "needs apt-get to install slurm-wlm (Debian/Ubuntu)"
    return None


@pytest.fixture(scope="session")
def cluster():
    reason = _cannot_run_reason()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SLURM tests cannot run under CI=true: {reason}")
        pytest.skip(reason)
    status = subprocess.run(["bash", str(CLUSTER), "status"], capture_output=True, text=True)
    already_up = status.returncode == 0
    if not already_up:
        proc = subprocess.run(
            ["bash", str(CLUSTER), "up"], capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, f"cluster did not start:\n{proc.stdout}{proc.stderr}"
    try:
        yield socket.gethostname().split(".")[0]
    finally:
        if not already_up:  # stop only what this session started
            subprocess.run(["bash", str(CLUSTER), "stop"], capture_output=True, timeout=120)


# ---------------------------------------------------------------------------------- pipeline


@pytest.fixture(scope="module")
def pipeline(cluster, tmp_path_factory):
    """The whole pipeline on SLURM and, at the same time, locally; same config file."""
    config = make_config()
    on_slurm = copy_workflow(tmp_path_factory.mktemp("slurm") / "wf")
    local = copy_workflow(tmp_path_factory.mktemp("local") / "wf")
    slurm_cfg = write_config(on_slurm, config)
    local_cfg = write_config(local, config)
    local_proc, local_out = start(local, snakemake_cmd(600, local_cfg, profile="local"), "local")
    rc, out = run(on_slurm, snakemake_cmd(480, slurm_cfg), "slurm", timeout=560)
    local_rc, local_log = finish(local_proc, local_out, timeout=600)
    assert local_rc == 0, "local run failed:\n" + tail(local_log)
    assert rc == 0, "SLURM run failed:\n" + tail(out)
    return {"slurm": on_slurm, "local": local, "out": out, "config": config}


def test_pipeline_on_slurm_gives_the_local_bytes(pipeline):
    on_slurm, local = pipeline["slurm"] / "results", pipeline["local"] / "results"
    for pattern in ("prompts/*.parquet", "tokenized/*/*.parquet", "dataset/*/*.parquet"):
        ours, theirs = digests(on_slurm, pattern), digests(local, pattern)
        assert ours, pattern
        assert ours == theirs, pattern
    # Generated shards: same rows and tokens. latency_s and server (the engine's URL, a free
    # port) are measurements, so those two columns differ between any two runs.
    volatile = {"latency_s", "server"}
    for path in sorted(on_slurm.glob("generated/*/*.parquet")):
        ours = pq.read_table(path)
        theirs = pq.read_table(local / path.relative_to(on_slurm))
        keep = [c for c in ours.column_names if c not in volatile]
        assert ours.select(keep).equals(theirs.select(keep)), path


def test_every_job_ran_on_slurm_and_none_failed(pipeline):
    workdir = pipeline["slurm"]
    rules = ["prepare_prompts", "tokenize_prompts", "generate_shard", "merge_shard"]
    jobs = {rule: slurm_jobs_of(workdir, rule) for rule in rules}
    assert len(jobs["prepare_prompts"]) == 2 and len(jobs["tokenize_prompts"]) == 2, jobs
    assert len(jobs["generate_shard"]) == 3 and len(jobs["merge_shard"]) == 3, jobs
    states = sacct([j for js in jobs.values() for j in js])
    # No failure hidden by the profile's retries: one COMPLETED run per job.
    assert {j: [r["state"] for r in rows] for j, rows in states.items()} == {
        j: ["COMPLETED"] for js in jobs.values() for j in js
    }
    # generate asked SLURM for one GPU (--gpus=1 from generation.resources.gpus); CPU stages none.
    for rule, ids in jobs.items():
        for j in ids:
            has_gpu = "gres/gpu=1" in states[j][0]["tres"]
            assert has_gpu == (rule == "generate_shard"), (rule, j, states[j])
    # stats, card and provenance are local rules: no SLURM job, their outputs exist.
    assert not (workdir / "slurm_logs/rule_summarize_stats").exists()
    assert (workdir / "results/provenance.json").exists()


def test_each_generate_job_ran_its_engine_on_its_gpu(pipeline):
    workdir = pipeline["slurm"]
    gen_jobs = set(slurm_jobs_of(workdir, "generate_shard"))
    starts = [e for e in probe_events(workdir) if e["event"] == "start"]
    assert {e["job"] for e in starts} == gen_jobs, starts
    for e in starts:
        # SLURM gave the job one fake GPU; the engine process sees it.
        assert e["cuda_visible_devices"] in ("0", "1"), e
        assert e["slurm_step_gpus"] == e["cuda_visible_devices"], e
    stops = {e["pid"] for e in probe_events(workdir) if e["event"] == "stop"}
    assert {e["pid"] for e in starts} <= stops, "an engine was not stopped"
    records = [contracts.GenerateJobRecord.read(m) for m in
               sorted((workdir / "results/generated").glob("*/*.meta.json"))]  # fmt: skip
    assert len(records) == len(gen_jobs)
    for record in records:
        # the job record names its SLURM job, and each attempt it paid for ran in one of them
        assert record.slurm.job_id in gen_jobs, record.slurm
        assert record.attempts and {a.slurm.job_id for a in record.attempts} <= gen_jobs
        assert record.attempts[-1].status == "ok" and record.attempts[-1].gpus == 1


# ---------------------------------------------------------------------------------- mistakes


def fresh_copy(pipeline, tmp_path: Path, drop: list[str]) -> Path:
    """A copy of the finished SLURM run (prompts and tokenized shards up to date) without the
    given results, the journal, the SLURM logs and the probe log."""
    workdir = tmp_path / "wf"
    shutil.copytree(pipeline["slurm"], workdir, symlinks=True)
    for name in ["journal", "results/logs/generate", "slurm_logs", PROBE_LOG, *drop]:
        for path in workdir.glob(name):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return workdir


def test_too_many_gpus_fails_at_submission_with_slurms_message(pipeline, tmp_path):
    workdir = fresh_copy(pipeline, tmp_path, ["results/generated/chat/000*"])
    cfg = write_config(workdir, make_config(resources={"gpus": 3}), "gpus3.yaml")
    t0 = time.monotonic()
    rc, out = run(
        workdir, snakemake_cmd(180, cfg, "results/generated/chat/000.parquet"), "gpus3", 240
    )
    assert rc != 0, tail(out)
    assert "Requested node configuration is not available" in out, tail(out)
    assert "SLURM sbatch failed" in out, tail(out)
    assert time.monotonic() - t0 < 150
    assert not probe_events(workdir), "no engine may start"


def test_shipped_profile_cores_fit_the_2_cpu_test_nodes():
    """The pipeline fixture runs with the profile's own `cores` (the test overrides leave it
    alone), on nodes of 2 CPUs: the shipped default fits small nodes (issue 19, item 10)."""
    overrides = yaml.safe_load((ROOT / "tests/slurm/test-overrides/config.yaml").read_text())
    assert "cores" not in overrides
    assert yaml.safe_load((ROOT / "profiles/slurm/config.yaml").read_text())["cores"] <= 2


@pytest.mark.usefixtures("cluster")
def test_a_job_asking_more_cpus_than_any_node_fails_the_run_within_a_minute(tmp_path):
    """`--cores 8` makes each tokenize job ask SLURM for 8 CPUs, more than the test node has: the
    run fails within a minute, naming the job and SLURM's reason, instead of waiting for good
    (it waited 16 minutes, pending with reason PartitionConfig, before the watchdog)."""
    workdir = copy_workflow(tmp_path / "wf")
    cfg = write_config(workdir, make_config(), "cpus8.yaml")
    # the prompts locally: the SLURM run below submits only the tokenize job
    local = snakemake_cmd(300, cfg, "--until", "prepare_prompts", profile="local")
    rc, out = run(workdir, local, "prepare", 360)
    assert rc == 0, tail(out)
    target = "results/rejected/tokenize/chat.parquet"  # the tokenize checkpoint's file output
    t0 = time.monotonic()
    rc, out = run(workdir, snakemake_cmd(240, cfg, "--cores", "8", target), "cpus8", 300)
    elapsed = time.monotonic() - t0
    assert rc != 0, tail(out)
    assert elapsed < 60 + 15, (elapsed, tail(out))  # a minute, plus the controller's start
    assert "(rule tokenize_prompts, wildcards chat; tokenmill_" in out, tail(out)
    reasons = ("PartitionConfig", "Requested node configuration is not available")
    assert any(r in out for r in reasons), tail(out)
    assert not (workdir / target).exists()
    for job in slurm_jobs_of(workdir, "tokenize_prompts"):
        assert not squeue_state(job), f"job {job} of the failed run is still queued"


def test_profile_says_how_to_poll_without_slurmdbd():
    """Without slurmdbd the plugin's default sacct polling hangs forever (see docs/cluster.md)."""
    profile = (ROOT / "profiles/slurm/config.yaml").read_text()
    assert "slurm-status-command: squeue" in profile
    settings = yaml.safe_load(profile)
    assert settings["executor"] == "slurm"
    assert settings["slurm-init-seconds-before-status-checks"] * 3 <= 300  # MinJobAge default
    docs = (ROOT / "docs/cluster.md").read_text()
    assert "--slurm-status-command squeue" in docs and "slurmdbd" in docs


def test_squeue_status_command_sees_success_and_failure(pipeline, tmp_path):
    """`--slurm-status-command squeue`, the setting for clusters without slurmdbd: the controller
    sees a generate job complete, and sees a failing one fail (every attempt) and says so; it
    never waits silently."""
    drop = ["results/generated/chat/*", "results/rejected/generate/chat/*"]
    target = "results/generated/chat/000.parquet"
    squeue = ["--slurm-status-command", "squeue", "--verbose"]

    ok_dir = fresh_copy(pipeline, tmp_path / "ok", drop)
    cfg = write_config(ok_dir, make_config(), "ok.yaml")
    rc, out = run(ok_dir, snakemake_cmd(300, cfg, *squeue, target), "squeue-ok", 360)
    assert rc == 0, tail(out)
    assert "command=squeue" in out and "command=sacct" not in out, tail(out)
    assert "Falling back to 'sacct'" not in out, tail(out)
    assert (ok_dir / target).exists()

    bad_dir = fresh_copy(pipeline, tmp_path / "bad", drop)
    exits = {"command": ["{python}", "-c", "import sys; sys.exit(3)"]}
    cfg = write_config(bad_dir, make_config(launch=exits), "bad.yaml")
    t0 = time.monotonic()
    rc, out = run(bad_dir, snakemake_cmd(300, cfg, *squeue, target), "squeue-bad", 360)
    assert rc != 0, tail(out)
    assert time.monotonic() - t0 < 280, "the controller only stopped at the timeout"
    assert "SLURM status is: 'FAILED'" in out, tail(out)
    assert "status command is not 'sacct'" in out, tail(out)
    assert len(slurm_jobs_of(bad_dir, "generate_shard", "chat_000")) == 3  # retries: 2
    assert "engine exited with code 3 during startup" in _generate_log(bad_dir, "chat", "000")
    # The profile's retries are the only count: one `tokenmill generate` per SLURM job, none
    # retried inside an allocation (it was 6 + 3 + 1 = 10 with the rule's own `retries: 2`).
    history = (bad_dir / "results/logs/generate/chat/000/generate.log").read_text()
    assert history.count("=== tokenmill generate attempt:") == 3, history[-4000:]
    # ...and one engine start per attempt: the profile's attempts, no more.
    engine_log = (bad_dir / "results/logs/generate/chat/000/engine.log").read_text()
    assert engine_log.count("tokenmill: engine start") == 3, engine_log[-3000:]
    assert not (bad_dir / target).exists()


# ---------------------------------------------------------------------------------- faults

FAULT_DELAY_S = 8  # per /generate request; 2 in flight: a 20-prompt shard needs ~80 s of work
FAULT_CONCURRENCY = 2
CANCEL_NOTICE_S = 30  # how long the controller gets to notice an external scancel
CTRL_C_EXIT_S = 420  # how long a Ctrl-C'd controller gets to exit (status pause + sacct)


def fault_config(runtime_min: int) -> dict:
    return make_config(
        concurrency=FAULT_CONCURRENCY,
        resources={"gpus": 1, "cpus": 1, "mem_mb": 2000, "runtime_min": runtime_min},
        launch={
            "env": {"TOKENMILL_PROBE_LOG": PROBE_LOG, "TOKENMILL_PROBE_DELAY_S": str(FAULT_DELAY_S)}
        },
    )


def wait_until(predicate, timeout: float, proc: subprocess.Popen | None = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc is not None and proc.poll() is not None:
            return predicate()
        time.sleep(1)
    return False


@pytest.fixture(scope="module")
def faults(pipeline, tmp_path_factory):
    """Two workflow copies side by side (2 CPUs, 2 GPUs: one generate job each), slow engine.

    time limit: code/000 with a 1-minute first attempt runs into its limit (SIGTERM from SLURM);
    the profile's retry gets 2 minutes and must finish the shard.

    scancel + rerun + requeue: code/001 (5-minute limit) is scancelled once it has journaled two
    samples; the controller gets CANCEL_NOTICE_S to notice, else it is interrupted (SIGINT) like a
    user would. The rerun (with --slurm-requeue) is requeued with `scontrol requeue` once it has
    journaled two more; SLURM restarts it under the same job id.
    """
    drop = ["results/generated/code/*", "results/rejected/generate/code/*"]
    limit_dir = fresh_copy(pipeline, tmp_path_factory.mktemp("timelimit"), drop)
    cancel_dir = fresh_copy(pipeline, tmp_path_factory.mktemp("scancel"), drop)
    limit_cfg = write_config(limit_dir, fault_config(runtime_min=1), "faults.yaml")
    cancel_cfg = write_config(cancel_dir, fault_config(runtime_min=5), "faults.yaml")
    target_000 = "results/generated/code/000.parquet"
    target_001 = "results/generated/code/001.parquet"
    limit_proc, limit_out = start(limit_dir, snakemake_cmd(420, limit_cfg, target_000), "limit")
    runs: dict = {}
    actions: dict = {}
    cancel_proc = None
    try:
        # scancel of a running generate job, attempt 1.
        # The test's Ctrl-C goes to `timeout`, which forwards it and SIGKILLs snakemake
        # kill_after_s later: a CI run's controller, killed 30 s after its Ctrl-C, left its lock.
        run1_cmd = snakemake_cmd(300, cancel_cfg, target_001, kill_after_s=CTRL_C_EXIT_S + 60)
        cancel_proc, cancel_out = start(cancel_dir, run1_cmd, "run1")
        jobs = lambda: slurm_jobs_of(cancel_dir, "generate_shard", "code_001")  # noqa: E731
        done = lambda: journal_records(cancel_dir, "code", "001")  # noqa: E731
        assert wait_until(lambda: jobs() and done() >= 2, 240, cancel_proc), "no progress"
        actions["scancel"], actions["records_at_scancel"] = jobs()[0], done()
        # `tokenmill status` while the job runs on SLURM (it reads files only, never SLURM).
        actions["status"] = subprocess.run(
            [str(BIN / "tokenmill"), "status", "--configfile", str(cancel_cfg)],
            cwd=cancel_dir, capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
        sh("scancel", actions["scancel"])
        assert wait_until(lambda: sacct([actions["scancel"]]), 30)
        noticed = wait_until(lambda: cancel_proc.poll() is not None, CANCEL_NOTICE_S)
        actions["controller_noticed_cancel"] = noticed
        if not noticed:
            cancel_proc.send_signal(signal.SIGINT)
        # A controller stopped by Ctrl-C first waits for the plugin's status thread, whose pause
        # between polls grows by 10 s per quiet poll (up to 180 s): wait for it, as a user would.
        # A second interrupt leaves Snakemake's lock behind, and the rerun cannot start.
        exited = wait_until(lambda: cancel_proc.poll() is not None, CTRL_C_EXIT_S)
        run1_tail = tail(cancel_out.read_text(), 3000)
        assert exited, f"run1 ignored one Ctrl-C for {CTRL_C_EXIT_S} s:\n{run1_tail}"
        runs["run1"] = finish(cancel_proc, cancel_out, timeout=1)
        # Every job of run1 has ended (a retry the controller submitted was cancelled by it).
        assert wait_until(lambda: not any(squeue_state(j) for j in jobs()), 120), jobs()
        locks = sorted(p.name for p in (cancel_dir / ".snakemake/locks").glob("*"))
        assert not locks, f"run1 left Snakemake's lock {locks}:\n{tail(runs['run1'][1], 3000)}"

        # The rerun: same command, plus --slurm-requeue; requeue its job mid-shard.
        cmd = snakemake_cmd(360, cancel_cfg, "--slurm-requeue", target_001)
        cancel_proc, cancel_out = start(cancel_dir, cmd, "run2")
        run1_jobs = set(jobs())
        retry = lambda: [j for j in jobs() if j not in run1_jobs]  # noqa: E731
        progressed = lambda: retry() and done() >= actions["records_at_scancel"] + 2  # noqa: E731
        assert wait_until(progressed, 240, cancel_proc), (
            f"the rerun made no progress (exit {cancel_proc.poll()}, jobs {jobs()}, "
            f"{done()} records); run1's tail:\n{tail(runs['run1'][1], 1500)}\n"
            f"run2's tail:\n{tail(cancel_out.read_text(), 3000)}"
        )
        actions["requeue"] = retry()[0]
        sh("scontrol", "requeue", actions["requeue"])
        # SLURM holds a requeued job (Reason=BeginTime, ~2 min): let it start now.
        assert wait_until(lambda: squeue_state(actions["requeue"]) == "PENDING", 30)
        sh("scontrol", "update", f"jobid={actions['requeue']}", "StartTime=now")
        runs["run2"] = finish(cancel_proc, cancel_out, timeout=400)
        runs["limit"] = finish(limit_proc, limit_out, timeout=480)
    finally:
        for proc in (limit_proc, cancel_proc):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=90)
    return {"limit": limit_dir, "cancel": cancel_dir, "runs": runs, "actions": actions}


def _shard_size(workdir: Path, shard: str) -> int:
    return pq.read_metadata(workdir / f"results/tokenized/code/{shard}.parquet").num_rows


def test_time_limit_then_retry_resumes_from_the_journal(faults):
    workdir = faults["limit"]
    rc, out = faults["runs"]["limit"]
    assert rc == 0, tail(out)
    jobs = slurm_jobs_of(workdir, "generate_shard", "code_000")
    # A loaded machine may also run the 2-minute retry into its limit (CI saw 3 attempts):
    # every attempt but the last ends at its limit, the last completes, each one resumes.
    assert len(jobs) >= 2, jobs
    states = sacct(jobs)
    assert [states[j][-1]["state"] for j in jobs[:-1]] == ["TIMEOUT"] * (len(jobs) - 1), states
    assert states[jobs[-1]][-1]["state"] == "COMPLETED", states
    slurm_log = workdir / f"slurm_logs/rule_generate_shard/code_000/{jobs[0]}.log"
    assert "DUE TO TIME LIMIT" in slurm_log.read_text()
    assert f"SLURM-job '{jobs[0]}' failed, SLURM status is: 'TIMEOUT'" in out
    # Every killed attempt stopped its engine (generate's finally) after SLURM's SIGTERM.
    engine_log = (workdir / "results/logs/generate/code/000/engine.log").read_text()
    assert engine_log.count("tokenmill: engine start") == len(jobs), engine_log[-3000:]
    assert engine_log.count("tokenmill: engine stopped") == len(jobs), engine_log[-3000:]

    n = _shard_size(workdir, "000")
    kept = assert_exactly_once(workdir, "code", "000")
    meta = json.loads((workdir / "results/generated/code/000.meta.json").read_text())
    counts = meta["counts"]
    assert 0 < counts["from_journal"] < n, counts  # the retry resumed, it did not start over
    assert counts["from_journal"] + counts["requested"] == n == len(kept), counts
    per_job = requests_by_job(probe_events(workdir))
    assert per_job[jobs[-1]] == counts["requested"], per_job
    # What the engine received: every prompt once, plus at most what was in flight at each kill.
    sent = sum(per_job.get(j, 0) for j in jobs)
    assert n <= sent <= n + FAULT_CONCURRENCY * (len(jobs) - 1), (per_job, n)
    assert journal_records(workdir, "code", "000") == n  # nothing journaled twice


def test_scancel_then_rerun_resumes_from_the_journal(faults):
    workdir, actions = faults["cancel"], faults["actions"]
    rc, out = faults["runs"]["run1"]
    assert rc != 0, tail(out)  # a cancelled job never counts as done
    assert sacct([actions["scancel"]])[actions["scancel"]][-1]["state"] == "CANCELLED"
    if actions["controller_noticed_cancel"]:
        assert "SLURM status is: 'CANCELLED'" in out, tail(out)
    # else: plugin 2.8.0 reads sacct's "CANCELLED by <uid>" as still running (docs/cluster.md).

    # The status asked while the cancelled job ran: code/001 running, part way.
    rows = [line.split() for line in actions["status"].splitlines()]
    row = next(r for r in rows if r[:2] == ["code", "001"])
    assert row[4] == "running", actions["status"]
    assert actions["records_at_scancel"] <= int(row[2]) < int(row[3]), actions["status"]
    assert "1 running" in actions["status"].splitlines()[-1], actions["status"]

    rc, out = faults["runs"]["run2"]
    assert rc == 0, tail(out)
    n = _shard_size(workdir, "001")
    assert len(assert_exactly_once(workdir, "code", "001")) == n
    meta = json.loads((workdir / "results/generated/code/001.meta.json").read_text())
    assert meta["counts"]["from_journal"] >= actions["records_at_scancel"], meta["counts"]
    jobs = slurm_jobs_of(workdir, "generate_shard", "code_001")
    assert jobs == [actions["scancel"], actions["requeue"]], jobs
    per_job = requests_by_job(probe_events(workdir))
    total = sum(per_job.get(j, 0) for j in jobs)
    # Two kills (scancel, requeue): at most two batches of in-flight requests were paid twice.
    assert n <= total <= n + 2 * FAULT_CONCURRENCY, (per_job, n)
    assert journal_records(workdir, "code", "001") == n  # nothing journaled twice


def test_requeued_job_restarts_under_its_id_and_resumes(faults):
    workdir, actions = faults["cancel"], faults["actions"]
    rc, out = faults["runs"]["run2"]
    assert rc == 0, tail(out)
    job = actions["requeue"]
    # One job id, two runs: the first REQUEUED, the second COMPLETED; the plugin followed it.
    assert [r["state"] for r in sacct([job])[job]] == ["REQUEUED", "COMPLETED"]
    # Two engines under that one id (SLURM_RESTART_COUNT does not reach the engine: the jobstep
    # plugin drops SLURM_* variables before its srun).
    starts = [e for e in probe_events(workdir) if e["event"] == "start" and e["job"] == job]
    assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"], starts
    # Each run of the job says which restart it is, though the jobstep executor drops
    # SLURM_RESTART_COUNT (issue 28): the job record's attempts and generate.log's headers.
    record = contracts.GenerateJobRecord.read(workdir / "results/generated/code/001.meta.json")
    runs = [a.slurm for a in record.attempts if a.slurm.job_id == job]
    assert [r.restart_count for r in runs] == [0, 1], record.attempts
    assert all(r.nodelist for r in runs), runs
    history = (workdir / "results/logs/generate/code/001/generate.log").read_text()
    assert f"SLURM job {job} (restart 0)" in history and f"SLURM job {job} (restart 1)" in history
    # The SLURM log of the job id keeps both runs (--open-mode=append), not only the last.
    slurm_log = (workdir / f"slurm_logs/rule_generate_shard/code_001/{job}.log").read_text()
    assert slurm_log.count("rule generate_shard") >= 2, slurm_log[-3000:]
    engine_log = (workdir / "results/logs/generate/code/001/engine.log").read_text()
    # scancel'd attempt, the rerun's first run and its restart: three engines, three stops.
    assert engine_log.count("tokenmill: engine start") == 3, engine_log[-3000:]
    assert engine_log.count("tokenmill: engine stopped") == 3, engine_log[-3000:]


# ---------------------------------------------------------------------------------- multi-node


def test_multi_node_launch_gives_each_task_its_rank_and_the_head(pipeline, tmp_path, cluster):
    """nnodes=2 on a one-node cluster: the launcher (generation.launch.launcher,
    engines/launch.py) runs the two ranks as two tasks of one srun step on the same node, and
    --set-resources keeps the job on the one node (the rule asks for nnodes nodes)."""
    workdir = fresh_copy(
        pipeline, tmp_path, ["results/generated/code/000*", "results/rejected/generate/code/000*"]
    )
    command = ["{python}", PROBE, "--node-rank", "{node_rank}", "--dist-init-addr",
               "{dist_init_addr}", "--nnodes", "{nnodes}", *PROBE_COMMAND[2:]]  # fmt: skip
    prefix = ["srun", "--overlap", "--nodes=1", "--ntasks=2", "--kill-on-bad-exit=1"]
    config = make_config(
        launch={"command": command, "nnodes": 2, "host": "0.0.0.0", "launcher": prefix},
        resources={"gpus": 0, "cpus": 2, "mem_mb": 2000, "runtime_min": 5},
    )
    cfg = write_config(workdir, config, "multinode.yaml")
    one_node = ["--set-resources", "generate_shard:nodes=1"]
    target = "results/generated/code/000.parquet"
    # (after the target: --set-resources takes several values)
    rc, out = run(workdir, snakemake_cmd(300, cfg, target, *one_node), "mn", 360)
    assert rc == 0, tail(out) + "\n" + _generate_log(workdir, "code", "000")
    events = probe_events(workdir)
    starts = [e for e in events if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts) == [0, 1], starts
    assert sorted(e["procid"] for e in starts) == ["0", "1"], starts
    assert len({e["job"] for e in starts}) == 1 and len({e["step"] for e in starts}) == 1, starts
    heads = {e["dist_init_addr"] for e in starts}
    assert len(heads) == 1 and next(iter(heads)).split(":")[0] == cluster, heads
    assert all(e["nnodes"] == 2 for e in starts)
    # Stopping the engine stops srun, and srun ends the step: SLURM kills every task (SIGKILL,
    # so the ranks log no "stop"; see the report) and none outlives the job.
    engine_log = (workdir / "results/logs/generate/code/000/engine.log").read_text()
    assert "tokenmill: engine stopped" in engine_log, engine_log[-3000:]
    assert "Terminating StepId" in engine_log, engine_log[-3000:]
    for e in starts:
        assert not running(e["pid"]), f"rank {e['rank']} (pid {e['pid']}) is still running"
    # Requests went to rank 0 only, and the shard is complete.
    assert {e["rank"] for e in events if e["event"] == "request"} == {0}
    assert len(assert_exactly_once(workdir, "code", "000")) == _shard_size(workdir, "000")


def _generate_log(workdir: Path, category: str, shard: str) -> str:
    path = workdir / f"results/logs/generate/{category}/{shard}/generate.log"
    return path.read_text()[-4000:] if path.exists() else "(no generate log)"
