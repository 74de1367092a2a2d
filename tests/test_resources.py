"""SLURM resources of generate jobs (tokenmill/jobs/resources.py and the generate rule):
GPUs per node through the plugin's real keys, per-category overrides, runtime and memory that
grow with the attempt up to their caps, qos/constraint only when set, and the schema's checks."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import copy_workflow, tool_env

from tokenmill.config import ConfigError, check_config
from tokenmill.jobs.resources import gpus_per_job, job_resources

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.fixture
def config():
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["generation"]["resources"] = {"gpus": 8, "cpus": 16, "mem_mb": 200000, "runtime_min": 240}
    return check_config(cfg, ROOT)


def test_one_node_asks_for_gpus(config):
    r = job_resources(config, "code")
    assert (r["gpu"], r["gres"], r["nodes"], r["gpu_model"]) == (8, None, 1, None)
    assert (r["cpus_per_task"], r["mem_mb"], r["runtime"]) == (16, 200000, 240)
    assert r["qos"] is None and r["constraint"] is None
    config["generation"]["resources"]["gpu_model"] = "h100"
    assert job_resources(config, "code")["gpu_model"] == "h100"  # plugin: --gpus=h100:8


def test_two_nodes_ask_for_gres_per_node_and_no_gpus(config):
    config["generation"]["launch"]["nnodes"] = 2
    r = job_resources(config, "code")
    # sbatch --nodes=2 --gres=gpu:8 (8 on EACH node); gpu=0 keeps --gpus off the jobstep's srun.
    assert (r["gpu"], r["gres"], r["nodes"]) == (0, "gpu:8", 2)
    assert "gpu_model" not in r or r["gpu_model"] is None
    config["generation"]["resources"]["gpu_model"] = "h100"
    assert job_resources(config, "code")["gres"] == "gpu:h100:8"
    assert gpus_per_job(config, "code") == 16


def test_retries_grow_runtime_and_memory_up_to_the_caps(config):
    res = config["generation"]["resources"]
    res.update(max_runtime_min=600, max_mem_mb=500000)
    got = [(job_resources(config, "chat", a)["runtime"], job_resources(config, "chat", a)["mem_mb"])
           for a in (1, 2, 3)]  # fmt: skip
    assert got == [(240, 200000), (480, 400000), (600, 500000)]
    res.update(max_runtime_min=None, max_mem_mb=None)
    assert job_resources(config, "chat", 3)["runtime"] == 720  # uncapped: 3 x 240


def test_category_overrides_only_what_it_sets(config):
    config["categories"]["code"]["resources"] = {"runtime_min": 600, "qos": "long"}
    config["generation"]["resources"].update(constraint="hbm", max_runtime_min=1440)
    code, chat = job_resources(config, "code", 3), job_resources(config, "chat", 3)
    assert (code["runtime"], code["qos"], code["constraint"], code["gpu"]) == (
        1440,
        "long",
        "hbm",
        8,
    )
    assert (chat["runtime"], chat["qos"], chat["constraint"]) == (720, None, "hbm")


@pytest.mark.parametrize(
    "mutate, key, message",
    [
        (lambda c: c["generation"]["resources"].update(gpus=-1), "generation.resources.gpus",
         "less than the minimum"),
        (lambda c: c["generation"]["resources"].update(gpus_per_node=2), "generation.resources",
         "'gpus_per_node' was unexpected"),
        (lambda c: c["generation"]["resources"].update(qos="high prio"), "generation.resources.qos",
         "does not match"),
        (lambda c: c["categories"]["code"].update(resources={"runtime": 5}),
         "categories.code.resources", "'runtime' was unexpected"),
        (lambda c: c["categories"]["code"].update(resources={"mem_mb": "lots"}),
         "categories.code.resources.mem_mb", "is not of type 'integer'"),
        (lambda c: c["generation"]["resources"].update(runtime_min=300, max_runtime_min=200),
         "generation.resources.runtime_min", "above max_runtime_min"),
        (lambda c: (c["generation"]["resources"].update(max_runtime_min=200),
                    c["categories"]["code"].update(resources={"runtime_min": 300})),
         "categories.code.resources.runtime_min", "above max_runtime_min"),
    ],
)  # fmt: skip
def test_bad_resources_fail_naming_the_key(mutate, key, message):
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    mutate(cfg)
    with pytest.raises(ConfigError) as err:
        check_config(copy.deepcopy(cfg), ROOT)
    assert f"config key '{key}'" in str(err.value) and message in str(err.value), str(err.value)


def test_the_rule_gives_each_category_its_resources(tmp_path):
    """A real snakemake dry run: the generate jobs' resources as Snakemake resolved them."""
    copy_workflow(tmp_path)
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    cfg["categories"] = {k: cfg["categories"][k] for k in ("code", "chat")}
    cfg["generation"]["launch"]["nnodes"] = 2
    cfg["generation"]["resources"] = {"gpus": 2, "cpus": 2, "mem_mb": 1000, "runtime_min": 30}
    cfg["categories"]["code"]["resources"] = {"runtime_min": 90, "qos": "long"}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = tool_env()
    proc = subprocess.run(
        [str(BIN / "snakemake"), "-n", "--cores", "1", "--configfile", "c.yaml",
         "--verbose", "results/generated/code/000.parquet", "results/generated/chat/000.parquet"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    jobs = [block for block in out.split("rule generate_shard:")[1:]]
    assert len(jobs) == 2, out
    by_cat = {("code" if "category=code" in b else "chat"): b.split("\n\n")[0] for b in jobs}
    for cat, runtime in (("code", 90), ("chat", 30)):
        block = by_cat[cat]
        assert "gres=gpu:2" in block and "nodes=2" in block and "gpu=0" in block, block
        assert f"runtime={runtime}" in block, block
    assert "qos=long" in by_cat["code"] and "qos=" not in by_cat["chat"], by_cat


def test_plan_prints_what_each_generate_job_asks_for(config, tmp_path):
    """`tokenmill plan` (before anything is tokenized) names each category's memory, runtime,
    CPUs and GPUs at attempts 1-3, the numbers the generate rule asks SLURM for."""
    from tokenmill import plan

    res = config["generation"]["resources"]
    res.update(mem_mb=30000, max_mem_mb=70000, runtime_min=100, max_runtime_min=250)
    config["categories"]["chat"]["resources"] = {"mem_mb": 1000}
    p = plan.make_plan(config, tmp_path, None)
    lines = {r["category"]: r["job_resources"] for r in p["categories"]}
    for category, asked in lines.items():
        for n in (1, 2, 3):
            r = job_resources(config, category, n)
            assert (asked["mem_mb"][n - 1], asked["runtime_min"][n - 1]) == (
                r["mem_mb"],
                r["runtime"],
            )
    assert lines["code"]["mem_mb"] == [30000, 60000, 70000]
    assert lines["chat"]["mem_mb"] == [1000, 2000, 3000]
    assert lines["code"]["runtime_min"] == [100, 200, 250]
    table = plan.format_table(p)
    assert (
        "generate job code: mem 30000/60000/70000 MB, runtime 100/200/250 min at attempts "
        "1/2/3; 16 CPUs, 8 GPUs (generation.resources)"
    ) in table, table
    assert "generate job chat: mem 1000/2000/3000 MB" in table, table
