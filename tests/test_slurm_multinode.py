"""GPU request semantics, nested srun and preemption on a REAL two-node SLURM (slurm-wlm 22.05:
`slurmd -N n1` and `slurmd -N n2` on this host, 2 fake GPUs each, slurmdbd), started by

    TOKENMILL_SLURM_NODES=2 tests/slurm/cluster.sh up     (its own cluster "ci2", SLURM_CONF)

What it pins down (docs/cluster.md, "Two nodes: GPUs, nested srun, preemption"):
- `--nodes=2 --gres=gpu:N` gives EACH node N GPUs; `--gpus=N` is a total for the job (split over
  the nodes); `--gpus` below the node count is rejected;
- how the slurm plugin runs a rule (the jobstep plugin: `srun -n1 ... --nodes=N [--gpus=G]`):
  with `gpu=G` (sbatch/srun `--gpus=G`) and nodes=2 that step cannot even be created; with
  `gres=gpu:N` (and no `gpu`) the rule runs, on the first node only;
- from inside that step, `srun --overlap --nodes=2 --ntasks=2 --ntasks-per-node=1` fails with the
  inherited environment (SLURM_JOB_NODELIST names the step's single node) and gets one task per
  node once the SLURM_* variables are stripped;
- preemption (PreemptType=preempt/partition_prio): what a preempted job receives, and the states
  sacct and squeue show for PreemptMode=REQUEUE, CANCEL and REQUEUE with GraceTime.

Without root or apt the module is skipped (under CI=true that is a failure).
Run: pytest -m slurm tests/test_slurm_multinode.py. The cluster's config stays in its own folder,
so the single-node cluster (config in /etc/slurm) can run at the same time. Real snakemake runs
against it need one piece of test plumbing (`slurm_conf_path`): the jobstep plugin drops
SLURM_CONF before its srun, so that srun would read /etc/slurm; wrappers first on PATH put it
back.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
HERE = ROOT / "tests" / "slurm" / "multinode"
RUN = Path(os.environ.get("TOKENMILL_SLURM2_RUN", "/tmp/tokenmill-slurm2"))
SLURM_CONF = Path(os.environ.get("TOKENMILL_SLURM_ETC", RUN / "etc")) / "slurm.conf"
# The SLURM commands a job or its steps may call; each gets a wrapper in slurm_conf_path.
SLURM_COMMANDS = ("srun", "sbatch", "squeue", "sacct", "scancel", "scontrol", "sinfo")

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def cluster_env() -> dict:
    return dict(
        os.environ,
        SLURM_CONF=str(SLURM_CONF),
        TOKENMILL_SLURM_NODES="2",
        TOKENMILL_SLURM_RUN=str(RUN),
    )


def sh(*cmd: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cluster_env())
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def cluster2():
    if os.geteuid() != 0 or not (shutil.which("apt-get") or shutil.which("slurmctld")):
        if os.environ.get("CI") == "true":
            pytest.fail("two-node SLURM tests need root and apt-get under CI=true")
        pytest.skip("needs root and apt-get (tests/slurm/cluster.sh)")
    already_up = sh("bash", str(CLUSTER), "status", check=False).returncode == 0
    if not already_up:
        proc = sh("bash", str(CLUSTER), "up", timeout=900, check=False)
        assert proc.returncode == 0, f"cluster did not start:\n{proc.stdout}{proc.stderr}"
    try:
        yield
    finally:
        if not already_up:
            sh("bash", str(CLUSTER), "stop", timeout=120, check=False)


@pytest.fixture(scope="module")
def slurm_conf_path(cluster2, tmp_path_factory) -> str:
    """A PATH whose first folder wraps every SLURM command: each sets SLURM_CONF from
    TOKENMILL_TEST_SLURM_CONF, which no plugin strips, then runs the real command. Jobs inherit
    the controller's PATH (--export=ALL), so the jobstep plugin's srun, and tokenmill's own srun
    inside the step, reach this cluster and not the one configured in /etc/slurm."""
    wrappers = tmp_path_factory.mktemp("slurm-conf-bin")
    for name in SLURM_COMMANDS:
        real = shutil.which(name)
        assert real, f"{name} is not installed"
        path = wrappers / name
        path.write_text(
            f'#!/bin/sh\nexport SLURM_CONF="${{TOKENMILL_TEST_SLURM_CONF:?}}"\nexec {real} "$@"\n'
        )
        path.chmod(0o755)
    return f"{wrappers}{os.pathsep}{os.environ['PATH']}"


def wrapped_env(base: dict, path: str) -> dict:
    return {**base, "PATH": path, "SLURM_CONF": str(SLURM_CONF),
            "TOKENMILL_TEST_SLURM_CONF": str(SLURM_CONF)}  # fmt: skip


def wait_job(job: str, timeout: float = 90) -> str:
    """Wait until the job has left squeue; its final state from sacct."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sh("squeue", "-h", "-j", job, "-o", "%T", check=False).stdout.strip():
            break
        time.sleep(0.3)
    else:
        sh("scancel", job, check=False)
        raise AssertionError(f"job {job} still queued after {timeout} s")
    for _ in range(50):  # the end record reaches slurmdbd a moment later
        state = sh("sacct", "-X", "-n", "-P", "-j", job, "-o", "State").stdout.split()
        if state and state[-1] not in ("RUNNING", "PENDING", "COMPLETING"):
            return state[-1]
        time.sleep(0.2)
    return state[-1] if state else ""


def sbatch(tmp_path: Path, label: str, *args: str, wrap: str | None = None) -> tuple[str, Path]:
    out = tmp_path / f"{label}.out"
    cmd = ["sbatch", "--parsable", "-o", str(out), "--mem=500", *args]
    if wrap is not None:
        cmd += ["--wrap", wrap]
    job = sh(*cmd).stdout.strip().split(";")[0]
    return job, out


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]


def by_node(recs: list[dict], label: str) -> dict[str, str]:
    return {r["node"]: r["cuda"] for r in recs if r.get("label") == label and "node" in r}


# ---------------------------------------------------------------------------------- GPUs


@pytest.mark.parametrize(
    "request_args, per_node",
    [
        (["--gres=gpu:2"], {"n1": 2, "n2": 2}),  # per node
        (["--gres=gpu:1"], {"n1": 1, "n2": 1}),  # per node
        (["--gpus=2"], {"n1": 1, "n2": 1}),  # a total, split over the nodes
        (["--gpus=4"], {"n1": 2, "n2": 2}),  # a total
        (["--gpus=3"], {"n1": 2, "n2": 1}),  # a total: uneven
        (["--gpus-per-node=1"], {"n1": 1, "n2": 1}),
    ],
)
def test_gpu_request_semantics_on_two_nodes(cluster2, tmp_path, request_args, per_node):
    probe = HERE / "probe.sh"
    launch = f"srun --nodes=2 --ntasks=2 --ntasks-per-node=1 {probe} task"
    job, out = sbatch(tmp_path, "gpus", "--nodes=2", *request_args, wrap=launch)
    assert wait_job(job) == "COMPLETED", out.read_text()
    got = by_node(records(out), "task")
    assert {node: len(cuda.split(",")) for node, cuda in got.items()} == per_node, got


def test_fewer_gpus_than_nodes_is_rejected(cluster2):
    proc = sh("sbatch", "--nodes=2", "--gpus=1", "--wrap", "true", check=False)
    assert proc.returncode != 0
    assert "--gpus < -N" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------- nested srun


def test_plugin_gpu_resource_with_two_nodes_cannot_start_the_rule(cluster2, tmp_path):
    """resources gpu=2, nodes=2: the plugin submits `--nodes=2 --gpus=2` and the jobstep plugin
    runs `srun -n1 ... --gpus=2 --nodes=2`: -n1 shrinks the step to one node, which holds one
    of the two GPUs, so SLURM refuses the step and the rule never runs."""
    rule = f"{HERE / 'nested.sh'} {HERE / 'probe.sh'}"
    job, out = sbatch(
        tmp_path, "gpu", "--nodes=2", "--gpus=2", "--cpus-per-task=1",
        str(HERE / "jobstep.sh"), "2", "2", *rule.split(),
    )  # fmt: skip
    assert wait_job(job) == "FAILED"
    text = out.read_text()
    assert "can't run 1 processes on 2 nodes, setting nnodes to 1" in text, text
    assert "Invalid generic resource (gres) specification" in text, text
    assert not records(out)


@pytest.fixture(scope="module")
def nested(cluster2, tmp_path_factory):
    """resources gres="gpu:2", nodes=2 (no gpu): `--nodes=2 --gres=gpu:2`, the jobstep's
    `srun -n1 --cpu-bind=q --cpus-per-task=1 --nodes=2`, and the engine launch inside it."""
    tmp = tmp_path_factory.mktemp("nested")
    rule = [str(HERE / "nested.sh"), str(HERE / "probe.sh")]
    job, out = sbatch(
        tmp, "gres", "--nodes=2", "--gres=gpu:2", "--cpus-per-task=1",
        str(HERE / "jobstep.sh"), "0", "2", *rule,
    )  # fmt: skip
    assert wait_job(job) == "COMPLETED", out.read_text()
    return records(out), out.read_text()


def test_the_rule_step_is_on_the_first_node_only(nested):
    recs, text = nested
    assert "can't run 1 processes on 2 nodes, setting nnodes to 1" in text
    (rule,) = [r for r in recs if r["label"] == "rule"]
    # The step's own nodelist replaces the job's: SLURM_JOB_NODELIST=n1, SLURM_NODELIST=n[1-2].
    assert (rule["node"], rule["job_nodelist"], rule["nodelist"]) == ("n1", "n1", "n[1-2]"), rule
    assert rule["cuda"] == "0,1", rule  # the step sees the node's GPUs of the job


def test_nested_srun_with_inherited_env_fails(nested):
    recs, _ = nested
    (res,) = [r for r in recs if r["label"] == "inherited" and "rc" in r]
    assert res["rc"] != 0
    assert "Only allocated 1 nodes asked for 2" in res["stderr"], res
    assert not by_node(recs, "inherited")


@pytest.mark.parametrize("label", ["no_job_nodelist", "stripped"])
def test_nested_srun_gets_one_task_per_node_once_stripped(nested, label):
    recs, _ = nested
    (res,) = [r for r in recs if r["label"] == label and "rc" in r]
    assert res["rc"] == 0, res
    tasks = [r for r in recs if r["label"] == label and "node" in r]
    assert sorted((t["node"], t["procid"]) for t in tasks) == [("n1", "0"), ("n2", "1")]
    for t in tasks:  # each task sees its node's 2 GPUs and the whole job's nodelist
        assert t["cuda"] == "0,1" and t["job_nodelist"] == "n[1-2]", t


# ---------------------------------------------------------------------------------- preemption


def squeue_states(job: str) -> str:
    return sh("squeue", "-h", "-j", job, "-o", "%T|%r", check=False).stdout.strip()


def sacct_rows(job: str) -> list[str]:
    out = sh("sacct", "-X", "-n", "-P", "--duplicates", "-j", job, "-o", "JobID,State,ExitCode")
    return out.stdout.splitlines()


def scontrol_job(job: str) -> dict:
    out = sh("scontrol", "-o", "show", "job", job, check=False).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def seconds(ts: str) -> float:
    return time.mktime(time.strptime(ts, "%Y-%m-%dT%H:%M:%S"))


def plugin_view(name: str) -> str:
    """The plugin's own status query (job_status_query.py), for a job named `name`."""
    out = sh(
        "sacct", "-X", "--parsable2", "--clusters", "all", "--noheader",
        "--format=JobIdRaw,State", "--starttime", "now-1hour", "--endtime", "now", "--name", name,
    )  # fmt: skip
    return out.stdout.strip()


def preempt(tmp_path: Path, partition: str, extra: tuple = ()) -> dict:
    """A low job in `partition` holding both nodes' GPUs, preempted by a short job in `high`."""
    log = tmp_path / "preempt.jsonl"
    name = f"low-{partition}"
    env_args = [f"--export=ALL,PREEMPT_LOG={log}"]
    low, _ = sbatch(
        tmp_path, name, "-p", partition, "-J", name, "--nodes=2", "--gres=gpu:2",
        *env_args, *extra, str(HERE / "preempt_job.sh"),
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (log.exists() and f'"step","job":"{low}","event":"start"' in log.read_text()):
        assert time.monotonic() < deadline, squeue_states(low)
        time.sleep(0.2)
    t_submit = time.time()
    high, _ = sbatch(tmp_path, "high", "-p", "high", "--nodes=1", "--gres=gpu:2", wrap="sleep 3")
    seen: list[str] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # squeue states of the low job, each change once
        st = squeue_states(low)
        if not seen or seen[-1].split(" ", 1)[1] != st:
            seen.append(f"{time.time() - t_submit:.1f} {st}")
        # SIGNALING: the preemption's signals are being delivered (a grace time may follow).
        if not st.startswith(("RUNNING", "SIGNALING", "COMPLETING")):
            break
        time.sleep(0.25)
    info = scontrol_job(low)
    result = {
        "squeue": seen,
        "scontrol": {k: info.get(k) for k in ("JobState", "Reason", "Restarts", "Requeue")},
        "eligible_after_requeue_s": (
            seconds(info["EligibleTime"]) - seconds(info["SubmitTime"])
            if info.get("JobState") == "PENDING"
            else None
        ),
        "events": [
            {**e, "t": round(float(e["t"]) - t_submit, 1)}
            for e in (json.loads(x) for x in log.read_text().splitlines())
        ],
        "sacct_after_preempt": sacct_rows(low),
        "plugin_view": plugin_view(name),
        "high": wait_job(high),
    }
    result["events"] = [
        {**e, "t": round(float(e["t"]) - t_submit, 1)}
        for e in (json.loads(x) for x in log.read_text().splitlines())
    ]
    sh("scancel", low, check=False)
    wait_job(low)
    result["sacct_final"] = sacct_rows(low)
    (tmp_path / "result.json").write_text(json.dumps(result, indent=1))
    print(partition, extra, json.dumps(result, indent=1))
    return result


def events(r: dict, who: str) -> list[str]:
    return [e["event"] for e in r["events"] if e["who"] == who]


def test_preempt_requeue(cluster2, tmp_path):
    r = preempt(tmp_path, "debug")
    # Batch script and step: SIGCONT+SIGTERM at preemption (SIGKILL after KillWait=5 s).
    for who in ("batch", "step"):
        assert events(r, who)[0] == "start" and "TERM" in events(r, who), r
    # The step (the rule's work) never ends on its own. The batch script's wait loop ends when
    # its srun does: on a loaded machine the step's SIGKILL can come first and the script logs
    # `end` before its own SIGKILL (seen once in a CI-like run with both SLURM sessions and the
    # main session at once). Either way the job is requeued below, which is what counts.
    assert "end" not in events(r, "step"), r
    # Requeued: pending again, eligible only 120 s later; one restart counted.
    assert r["scontrol"]["JobState"] == "PENDING" and r["scontrol"]["Reason"] == "BeginTime", r
    assert r["scontrol"]["Restarts"] == "1", r
    assert 110 <= r["eligible_after_requeue_s"] <= 130, r
    # sacct keeps the preempted run as its own record (--duplicates); the plugin's own query
    # (no --duplicates, a time window) reports PREEMPTED while the job is pending again.
    assert r["sacct_after_preempt"][0].split("|")[1] == "PREEMPTED", r
    assert r["plugin_view"].endswith("|PREEMPTED"), r
    assert [row.split("|")[1] for row in r["sacct_final"]] == ["PREEMPTED", "CANCELLED by 0"], r
    assert r["high"] == "COMPLETED"


def test_preempt_cancel(cluster2, tmp_path):
    r = preempt(tmp_path, "lowcancel")
    for who in ("batch", "step"):
        assert events(r, who)[0] == "start" and "TERM" in events(r, who), r
    assert events(r, "batch").count("start") == 1, r
    # Gone from squeue after COMPLETING; PREEMPTED is its final state in sacct and for the
    # plugin (which has no branch that ends a PREEMPTED job: it keeps waiting).
    assert r["squeue"][-1].endswith(" "), r
    assert [row.split("|")[1] for row in r["sacct_final"]] == ["PREEMPTED"], r
    assert r["plugin_view"].endswith("|PREEMPTED"), r


def test_preempt_requeue_with_grace_time(cluster2, tmp_path):
    r = preempt(tmp_path, "lowgrace")
    step_term = [e["t"] for e in r["events"] if e["who"] == "step" and e["event"] == "TERM"]
    batch_term = [e["t"] for e in r["events"] if e["who"] == "batch" and e["event"] == "TERM"]
    # SIGNALING (seen at the grace start on a loaded machine) is the steps' SIGTERM being
    # delivered: the job is still running its grace time.
    left = [
        float(x.split()[0])
        for x in r["squeue"]
        if not x.split(" ", 1)[1].startswith(("RUNNING", "SIGNALING"))
    ]
    # At preemption (grace start) only the job's steps get SIGTERM, not the batch script; the
    # job is killed (SIGTERM to all, SIGKILL after KillWait) no earlier than GraceTime=10 s later
    # (measured: 28 s and 36 s later; slurmctld checks the grace time on a periodic pass).
    assert step_term and step_term[0] < 10, r
    assert batch_term and batch_term[0] - step_term[0] >= 9, r
    assert left and left[0] - step_term[0] >= 9, r
    assert r["scontrol"]["JobState"] == "PENDING" and r["scontrol"]["Restarts"] == "1", r


# ---------------------------------------------------------------------------------- the plugin


@pytest.mark.parametrize("gpu_resource", ["gres", "gpu"])
def test_real_plugin_run_with_two_nodes(cluster2, slurm_conf_path, tmp_path, gpu_resource):
    """The same through snakemake --executor slurm (its jobstep plugin drops SLURM_CONF before
    its srun: slurm_conf_path)."""
    shutil.copy2(HERE / "Snakefile", tmp_path / "Snakefile")
    bin_dir = Path(sys.executable).parent
    cmd = [
        "timeout", "-s", "INT", "-k", "30", "200", str(bin_dir / "snakemake"),
        "--executor", "slurm", "--jobs", "1", "--retries", "0",
        "--default-resources", "slurm_account=root", "slurm_partition=debug",
        "--slurm-init-seconds-before-status-checks", "1", "--seconds-between-status-checks", "1",
        "--slurm-keep-successful-logs", "--config", f"gpu_resource={gpu_resource}",
    ]  # fmt: skip
    env = wrapped_env(dict(os.environ), f"{bin_dir}{os.pathsep}{slurm_conf_path}")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=260)
    logs = "".join(
        p.read_text() for p in tmp_path.glob(".snakemake/slurm_logs/rule_two_nodes/*.log")
    )
    assert "can't run 1 processes on 2 nodes, setting nnodes to 1" in logs, logs
    if gpu_resource == "gpu":
        assert proc.returncode != 0
        assert "Invalid generic resource (gres) specification" in logs, logs
        assert "SLURM status is: 'FAILED'" in proc.stdout + proc.stderr
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted((tmp_path / "two_nodes.txt").read_text().splitlines())
    assert "rule n1 n1 n[1-2] 0,1" in lines, lines
    assert "srun: error: Only allocated 1 nodes asked for 2" in lines, lines
    assert [x for x in lines if x.startswith("stripped")] == [
        "stripped n1 0 0,1",
        "stripped n2 1 0,1",
    ]


# ---------------------------------------------------------------------------------- the pipeline
# tokenmill itself on the two-node cluster, through `--profile profiles/slurm` (real snakemake,
# real plugin), with slurm_conf_path like test_real_plugin_run_with_two_nodes.

MAIL = "ci@example.org"


def site_layer(workdir: Path, **generate_shard) -> str:
    """A site profile layered over profiles/slurm + tests/slurm/test-overrides."""
    layer = workdir / "site"
    layer.mkdir(exist_ok=True)
    text = "set-resources:\n  generate_shard:\n"
    text += "".join(f"    {k}: {json.dumps(v)}\n" for k, v in generate_shard.items())
    (layer / "config.yaml").write_text(text)
    return str(layer)


def pipeline_cmd(timeout_s: int, cfg: Path, layer: str, target: str) -> list:
    import test_slurm as ts

    cmd = ts.snakemake_cmd(timeout_s, cfg, target)
    at = cmd.index("--configfile")
    return [*cmd[:at], "--profile", layer, *cmd[at:]]


def pipeline_env(path: str, **extra: str) -> dict:
    import test_slurm as ts

    return {**wrapped_env(ts.env(), path), **extra}


@pytest.fixture(scope="module")
def tokenized_workflow(cluster2, tmp_path_factory) -> Path:
    """The workflow copy every pipeline run below starts from: the sample config's code and
    chat categories prepared and tokenized once, by a local Snakemake run. Tokenize does not
    read the generation keys these tests change (launch, resources, concurrency: operational,
    test_workflow.py), so each run submits only its generate jobs to SLURM."""
    import test_slurm as ts

    workdir = ts.copy_workflow(tmp_path_factory.mktemp("tokenized") / "wf")
    cfg = ts.write_config(workdir, ts.make_config())
    cmd = ts.snakemake_cmd(300, cfg, "--until", "tokenize_prompts", profile="local")
    rc, text = ts.run(workdir, cmd, "tokenize", timeout=360)
    assert rc == 0, ts.tail(text)
    return workdir


def workflow_from(tokenized: Path, dest: Path) -> Path:
    """A copy of the tokenized workflow (Snakemake's state and file times kept)."""
    from helpers import copy_run

    return copy_run(tokenized, dest)


def start_run(workdir: Path, cmd: list, name: str, path: str, **extra: str):
    out = workdir / f"{name}.out"
    with open(out, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=workdir, env=pipeline_env(path, **extra), stdout=f, stderr=subprocess.STDOUT
        )
    return proc, out


def sacct_fields(job: str, fields: str) -> list[dict]:
    out = sh("sacct", "-X", "-n", "-P", "--duplicates", "-j", job, "-o", fields).stdout
    names = fields.split(",")
    return [dict(zip(names, line.split("|"), strict=True)) for line in out.splitlines()]


def test_two_node_engine_through_the_slurm_profile(
    cluster2, slurm_conf_path, tokenized_workflow, tmp_path
):
    """generation.launch.nnodes=2 with gpus=2 (per node): the generate job gets 2 nodes with 2
    GPUs each (sbatch --nodes=2 --gres=gpu:2), the engine's srun one rank per node with that
    node's GPUs, the rendezvous address resolves to the first node's address, every prompt is
    generated exactly once. Also: qos and a category's runtime from the config, the profile's
    job-name prefix, mail on failure through slurm_extra."""
    import test_slurm as ts

    workdir = workflow_from(tokenized_workflow, tmp_path / "wf")
    command = ["{python}", ts.PROBE, "--node-rank", "{node_rank}", "--dist-init-addr",
               "{dist_init_addr}", "--nnodes", "{nnodes}", *ts.PROBE_COMMAND[2:]]  # fmt: skip
    config = ts.make_config(
        launch={"command": command, "nnodes": 2, "host": "0.0.0.0"},
        resources={"gpus": 2, "cpus": 1, "mem_mb": 1000, "runtime_min": 5, "qos": "normal"},
    )
    config["categories"]["chat"]["resources"] = {"runtime_min": 7}
    cfg = ts.write_config(workdir, config)
    layer = site_layer(workdir, slurm_extra=f"'--mail-type=FAIL --mail-user={MAIL}'")
    target = "results/generated/chat/000.parquet"
    proc, out = start_run(workdir, pipeline_cmd(400, cfg, layer, target), "mn", slurm_conf_path)
    rc, text = ts.finish(proc, out, timeout=460)
    assert rc == 0, ts.tail(text) + "\n" + ts._generate_log(workdir, "chat", "000")

    (job,) = ts.slurm_jobs_of(workdir, "generate_shard")
    (row,) = sacct_fields(job, "JobName,NNodes,AllocTRES,QOS,Timelimit,State")
    assert row["NNodes"] == "2" and "gres/gpu=4" in row["AllocTRES"], row  # 2 per node
    assert row["QOS"] == "normal" and row["Timelimit"] == "00:07:00", row
    assert row["JobName"].startswith("tokenmill_") and row["State"] == "COMPLETED", row
    info = scontrol_job(job)  # still known to slurmctld (MinJobAge=300)
    assert info.get("MailUser") == MAIL and "FAIL" in info.get("MailType", ""), info

    starts = [e for e in ts.probe_events(workdir) if e["event"] == "start"]
    assert sorted((e["node"], e["rank"]) for e in starts) == [("n1", 0), ("n2", 1)], starts
    assert all(e["cuda_visible_devices"] == "0,1" for e in starts), starts  # the node's GPUs
    assert {e["job"] for e in starts} == {job} and len({e["step"] for e in starts}) == 1
    (head,) = {e["dist_init_addr"] for e in starts}
    host, port = head.rsplit(":", 1)
    node_addr = scontrol_job_node_addr("n1")
    assert host == node_addr and socket.getaddrinfo(host, int(port)), (head, node_addr)
    # Requests went to rank 0 only; every prompt exactly once; no rank outlived the job.
    assert {e["rank"] for e in ts.probe_events(workdir) if e["event"] == "request"} == {0}
    n = pq.read_metadata(workdir / "results/tokenized/chat/000.parquet").num_rows
    assert len(ts.assert_exactly_once(workdir, "chat", "000")) == n
    assert ts.requests_by_job(ts.probe_events(workdir))[job] == n
    for e in starts:
        assert not ts.running(e["pid"]), e
    engine_log = (workdir / "results/logs/generate/chat/000/engine.log").read_text()
    assert "Only allocated 1 nodes" not in engine_log, engine_log[-3000:]


def scontrol_job_node_addr(node: str) -> str:
    out = sh("scontrol", "-o", "show", "node", node).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)["NodeAddr"]


PREEMPT_DELAY_S = 4  # per /generate request, 2 in flight: a ~40-prompt shard takes ~80 s


# What each controller prints once it has seen its job preempted: the plugin's warning
# (REQUEUE), the controller's watchdog requeueing the cancelled job (CANCEL).
PREEMPTION_SEEN = {
    "requeue": "A Job preemption  occured",
    "cancel": "was preempted and cancelled (PreemptMode=CANCEL); requeued it",
}


def release_when_seen(job: str, proc: subprocess.Popen, out: Path, seen: str) -> None:
    """SLURM holds a requeued job for about 2 min (Reason=BeginTime; test_preempt_requeue pins
    that): once the controller has said it saw the preemption, let the job start now, as
    test_slurm.py does after its `scontrol requeue`. Nothing is released before the controller
    saw the preemption, so what the tests assert about that is untouched."""
    deadline = time.monotonic() + 240
    while seen not in out.read_text() and proc.poll() is None:
        assert time.monotonic() < deadline, f"the controller never said: {seen}"
        time.sleep(0.5)
    for _ in range(20):  # pending again (the watchdog's requeue may take a moment to show)
        if squeue_states(job).startswith("PENDING"):
            sh("scontrol", "update", f"jobid={job}", "StartTime=now", check=False)
            return
        time.sleep(0.5)


@pytest.fixture(scope="module")
def preempted_runs(cluster2, slurm_conf_path, tokenized_workflow, tmp_path_factory):
    """Two controllers side by side, each generating chat/000 on one GPU: one in partition
    debug (PreemptMode=REQUEUE), one in lowcancel (PreemptMode=CANCEL). Once both journaled
    two samples, a job in partition high takes every GPU of both nodes and preempts both."""
    import test_slurm as ts

    config = ts.make_config(
        concurrency=2,
        resources={"gpus": 1, "cpus": 1, "mem_mb": 1000, "runtime_min": 10},
        launch={"env": {"TOKENMILL_PROBE_LOG": ts.PROBE_LOG,
                        "TOKENMILL_PROBE_DELAY_S": str(PREEMPT_DELAY_S)}},
    )  # fmt: skip
    config["jobs"] = {"preemption_watch_s": 5}
    target = "results/generated/chat/000.parquet"
    runs, procs = {}, {}
    try:
        for mode, partition in (("requeue", "debug"), ("cancel", "lowcancel")):
            workdir = workflow_from(tokenized_workflow, tmp_path_factory.mktemp(mode) / "wf")
            cfg = ts.write_config(workdir, config)
            layer = site_layer(workdir, slurm_partition=partition)
            cmd = pipeline_cmd(600, cfg, layer, target)
            procs[mode] = start_run(workdir, cmd, mode, slurm_conf_path)
            runs[mode] = {"workdir": workdir}
        deadline = time.monotonic() + 300
        while not all(ts.journal_records(r["workdir"], "chat", "000") >= 2 for r in runs.values()):
            assert time.monotonic() < deadline, "no generate progress"
            assert all(p.poll() is None for p, _ in procs.values()), "a controller ended early"
            time.sleep(1)
        for r in runs.values():
            (r["job"],) = ts.slurm_jobs_of(r["workdir"], "generate_shard")
            r["records_at_preemption"] = ts.journal_records(r["workdir"], "chat", "000")
        t0 = time.monotonic()
        high, _ = sbatch(tmp_path_factory.mktemp("high"), "high", "-p", "high", "--nodes=2",
                         "--gres=gpu:2", wrap="sleep 5")  # fmt: skip
        runs["high"] = wait_job(high, timeout=120)
        for mode, (proc, out) in procs.items():
            release_when_seen(runs[mode]["job"], proc, out, PREEMPTION_SEEN[mode])
        for mode, (proc, out) in procs.items():
            runs[mode]["rc"], runs[mode]["out"] = ts.finish(proc, out, timeout=560)
            runs[mode]["wall_after_preemption_s"] = round(time.monotonic() - t0)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=90)
    print(json.dumps({m: {k: v for k, v in r.items() if k != "out"} for m, r in runs.items()
                      if isinstance(r, dict)}, default=str, indent=1))  # fmt: skip
    return runs


@pytest.mark.parametrize("mode", ["requeue", "cancel"])
def test_preempted_generate_job_resumes_and_the_controller_finishes(preempted_runs, mode):
    import test_slurm as ts

    r = preempted_runs[mode]
    assert preempted_runs["high"] == "COMPLETED"
    assert r["rc"] == 0, ts.tail(r["out"]) + ts._generate_log(r["workdir"], "chat", "000")
    job = r["job"]
    # One job id throughout: SLURM (REQUEUE) or the controller's watchdog (CANCEL) requeued it,
    # the plugin kept following it, nothing was submitted twice.
    assert ts.slurm_jobs_of(r["workdir"], "generate_shard") == [job]
    states = [row["State"] for row in sacct_fields(job, "State")]
    assert states[-1] == "COMPLETED" and states[0] in ("PREEMPTED", "REQUEUED"), states
    # REQUEUE: the plugin saw PREEMPTED and waited for SLURM. CANCEL: the controller's watchdog
    # requeued the job (often before the plugin's next poll, which then never sees PREEMPTED).
    watchdog = "was preempted and cancelled (PreemptMode=CANCEL); requeued it" in r["out"]
    assert watchdog == (mode == "cancel"), ts.tail(r["out"])
    if mode == "requeue":
        assert "A Job preemption  occured" in r["out"], ts.tail(r["out"])
    # The preempted attempt got SIGTERM, stopped its engine, kept its journal; the restart
    # resumed from it.
    engine_log = (r["workdir"] / "results/logs/generate/chat/000/engine.log").read_text()
    assert engine_log.count("tokenmill: engine start") == 2, engine_log[-3000:]
    assert engine_log.count("tokenmill: engine stopped") == 2, engine_log[-3000:]
    n = pq.read_metadata(r["workdir"] / "results/tokenized/chat/000.parquet").num_rows
    assert len(ts.assert_exactly_once(r["workdir"], "chat", "000")) == n
    meta = json.loads((r["workdir"] / "results/generated/chat/000.meta.json").read_text())
    assert meta["counts"]["from_journal"] >= r["records_at_preemption"], meta["counts"]
    assert ts.journal_records(r["workdir"], "chat", "000") == n  # nothing journaled twice
    total = ts.requests_by_job(ts.probe_events(r["workdir"]))[job]
    assert n <= total <= n + 2, (total, n)  # at most the 2 in flight were paid twice
    starts = [e for e in ts.probe_events(r["workdir"]) if e["event"] == "start"]
    assert len(starts) == 2, starts  # the preempted engine and the restarted one


PREEMPTIONS = 5
# Twice PREEMPT_DELAY_S: a 40-prompt shard takes ~160 s of work, ample for five rounds of
# preempt, requeue and restart.
PREEMPT5_DELAY_S = 2 * PREEMPT_DELAY_S


def test_a_job_preempted_five_times_under_cancel_completes_exactly_once(
    cluster2, slurm_conf_path, tokenized_workflow, tmp_path
):
    """The same generate job, in partition lowcancel (PreemptMode=CANCEL), preempted five times
    (the fourth used to hang the run: successful requeues counted toward the refusal limit):
    the watchdog requeues it every time, the run completes, every sample exactly once, one
    engine per run of the job."""
    import test_slurm as ts

    config = ts.make_config(
        concurrency=2,
        resources={"gpus": 1, "cpus": 1, "mem_mb": 1000, "runtime_min": 10},
        launch={"env": {"TOKENMILL_PROBE_LOG": ts.PROBE_LOG,
                        "TOKENMILL_PROBE_DELAY_S": str(PREEMPT5_DELAY_S)}},
    )  # fmt: skip
    config["jobs"] = {"preemption_watch_s": 5}
    target = "results/generated/chat/000.parquet"
    workdir = workflow_from(tokenized_workflow, tmp_path / "wf")
    cfg = ts.write_config(workdir, config)
    layer = site_layer(workdir, slurm_partition="lowcancel")
    cmd = pipeline_cmd(900, cfg, layer, target)
    proc, out = start_run(workdir, cmd, "cancel5", slurm_conf_path)
    seen = PREEMPTION_SEEN["cancel"]
    at_preemption = []  # samples journaled when each preemption had been handled
    job = None
    try:
        for i in range(PREEMPTIONS):
            # The job runs (again) and has journaled one more sample than when it was last
            # preempted: preempting a job still held PENDING would preempt nothing.
            wanted = (at_preemption[-1] if at_preemption else 1) + 1
            deadline = time.monotonic() + 300
            while not (
                ts.journal_records(workdir, "chat", "000") >= wanted
                and job is not None
                and squeue_states(job).startswith("RUNNING")
            ):
                assert time.monotonic() < deadline, f"preemption {i + 1}: no generate progress"
                assert proc.poll() is None, ts.tail(out.read_text())
                if job is None and ts.slurm_jobs_of(workdir, "generate_shard"):
                    (job,) = ts.slurm_jobs_of(workdir, "generate_shard")
                time.sleep(0.5)
            high, _ = sbatch(tmp_path, f"high{i}", "-p", "high", "--nodes=2", "--gres=gpu:2",
                             wrap="sleep 2")  # fmt: skip
            assert wait_job(high, timeout=120) == "COMPLETED"
            deadline = time.monotonic() + 240
            while out.read_text().count(seen) < i + 1:
                assert time.monotonic() < deadline, f"preemption {i + 1} was never requeued"
                assert proc.poll() is None, ts.tail(out.read_text())
                time.sleep(0.5)
            # the preempted run has stopped (its journal flushed) before the requeue is said
            at_preemption.append(ts.journal_records(workdir, "chat", "000"))
            release_when_seen(job, proc, out, seen)
        rc, text = ts.finish(proc, out, timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=90)
    assert rc == 0, ts.tail(text) + ts._generate_log(workdir, "chat", "000")
    assert text.count(seen) == PREEMPTIONS, ts.tail(text)
    assert "refused to requeue" not in text, ts.tail(text)
    assert ts.slurm_jobs_of(workdir, "generate_shard") == [job]  # one job id, requeued each time
    states = [row["State"] for row in sacct_fields(job, "State")]
    assert states[-1] == "COMPLETED", states
    n = pq.read_metadata(workdir / "results/tokenized/chat/000.parquet").num_rows
    assert len(ts.assert_exactly_once(workdir, "chat", "000")) == n
    assert ts.journal_records(workdir, "chat", "000") == n  # nothing journaled twice
    starts = [e for e in ts.probe_events(workdir) if e["event"] == "start"]
    assert len(starts) == PREEMPTIONS + 1, starts
    total = ts.requests_by_job(ts.probe_events(workdir))[job]
    assert n <= total <= n + 2 * PREEMPTIONS, (total, n)  # at most the 2 in flight, each time
    assert at_preemption == sorted(at_preemption), at_preemption


def test_retries_grow_memory_and_runtime_up_to_the_caps(
    cluster2, slurm_conf_path, tokenized_workflow, tmp_path
):
    """A generate job that fails every attempt (its engine exits at start): the profile's two
    retries ask for more memory each time (for an OUT_OF_MEMORY kill) and more time (for a
    TIMEOUT), but never more than max_mem_mb and max_runtime_min; the controller then stops."""
    import test_slurm as ts

    workdir = workflow_from(tokenized_workflow, tmp_path / "wf")
    config = ts.make_config(
        launch={"command": ["{python}", "-c", "import sys; sys.exit(3)"]},
        resources={"gpus": 1, "cpus": 1, "mem_mb": 1000, "max_mem_mb": 2500,
                   "runtime_min": 5, "max_runtime_min": 12},
    )  # fmt: skip
    cfg = ts.write_config(workdir, config)
    layer = site_layer(workdir, slurm_partition="debug")
    target = "results/generated/chat/000.parquet"
    proc, out = start_run(
        workdir, pipeline_cmd(400, cfg, layer, target), "retries", slurm_conf_path
    )
    rc, text = ts.finish(proc, out, timeout=460)
    assert rc != 0, ts.tail(text)
    jobs = ts.slurm_jobs_of(workdir, "generate_shard")
    assert len(jobs) == 3, jobs
    rows = [sacct_fields(j, "ReqMem,Timelimit,State")[-1] for j in jobs]
    assert [(r["ReqMem"], r["Timelimit"]) for r in rows] == [
        ("1000M", "00:05:00"),
        ("2000M", "00:10:00"),
        ("2500M", "00:12:00"),
    ], rows
    assert all(r["State"] == "FAILED" for r in rows), rows
    assert "engine exited with code 3 during startup" in ts._generate_log(workdir, "chat", "000")
