"""SLURM resources of one generate job, from `generation.resources` and the category's overrides.

The generate rule's resources are functions of (category, attempt) built here, so the rule stays
thin and `tokenmill plan` sizes jobs with the same numbers. They use the keys of
snakemake-executor-plugin-slurm 2.8 as it really submits them (docs/cluster.md, sections 3, 7, 9):

- one node (launch.nnodes == 1): `gpu` = gpus (sbatch `--gpus=N`; with gpu_model `--gpus=M:N`);
- several nodes: `gres` = "gpu:N" or "gpu:M:N" (GRES counts are PER NODE), `gpu` = 0 and
  `nodes` = nnodes. `gpu`/`gpus` would reach the jobstep's `srun -n1 ... --gpus=G --nodes=N`,
  which SLURM refuses ("Invalid generic resource (gres) specification"); `tasks` is never set.
- runtime: runtime_min x attempt (a job killed at its time limit gets more), capped at
  max_runtime_min (the partition's MaxTime: a longer request is never scheduled);
- mem_mb: mem_mb x attempt (an OUT_OF_MEMORY job gets more), capped at max_mem_mb;
- qos, constraint: only when set (the plugin turns an empty string into `--qos ''`).
"""

from __future__ import annotations

# Keys of generation.resources that a category may override (categories.X.resources).
KEYS = (
    "gpus",
    "gpu_model",
    "cpus",
    "mem_mb",
    "max_mem_mb",
    "runtime_min",
    "max_runtime_min",
    "qos",
    "constraint",
)


def category_resources(config: dict, category: str | None) -> dict:
    """generation.resources with the category's own `resources` laid over it."""
    merged = dict(config["generation"].get("resources") or {})
    if category is not None:
        merged.update(config["categories"][category].get("resources") or {})
    return merged


def nnodes(config: dict) -> int:
    return int((config["generation"].get("launch") or {}).get("nnodes", 1))


def job_resources(config: dict, category: str | None, attempt: int = 1) -> dict:
    """The rule's resources for one job of `category` at `attempt` (1 = first)."""
    r = category_resources(config, category)
    n = nnodes(config)
    gpus = int(r.get("gpus", 0))
    out: dict = {"nodes": n, "cpus_per_task": int(r["cpus"])}
    model = r.get("gpu_model") if gpus > 0 else None
    if n > 1 and gpus > 0:
        out.update(gpu=0, gpu_model=None, gres=f"gpu:{model}:{gpus}" if model else f"gpu:{gpus}")
    else:
        out.update(gpu=gpus, gpu_model=model, gres=None)
    out["runtime"] = _capped(int(r["runtime_min"]) * attempt, r.get("max_runtime_min"))
    out["mem_mb"] = _capped(int(r["mem_mb"]) * attempt, r.get("max_mem_mb"))
    out["qos"] = r.get("qos")
    out["constraint"] = r.get("constraint")
    return out


def gpus_per_job(config: dict, category: str | None) -> int:
    """GPUs one generate job holds (all nodes together): for GPU-hours."""
    return int(category_resources(config, category).get("gpus", 0)) * nnodes(config)


def _capped(value: int, cap) -> int:
    return min(value, int(cap)) if cap else value


def problems(config: dict) -> list[str]:
    """What the schema cannot check: caps below the first attempt's request."""
    found = []
    scopes = [("generation.resources", None)]
    scopes += [(f"categories.{c}.resources", c) for c in sorted(config["categories"])]
    for where, category in scopes:
        if category is not None and not config["categories"][category].get("resources"):
            continue
        r = category_resources(config, category)
        for value, cap in (("runtime_min", "max_runtime_min"), ("mem_mb", "max_mem_mb")):
            if r.get(cap) and r.get(value) and int(r[value]) > int(r[cap]):
                found.append(
                    f"config key '{where}.{value}': {r[value]} is above {cap} ({r[cap]}); "
                    "the first attempt would already ask for more than the cap"
                )
    return found
