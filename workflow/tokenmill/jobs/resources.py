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

from collections.abc import Mapping

from tokenmill.settings import ResourceSettings, Settings, as_settings


def category_resources(config: Settings | Mapping, category: str | None) -> ResourceSettings:
    """generation.resources with the category's own `resources` laid over it."""
    return as_settings(config).resources(category)


def nnodes(config: Settings | Mapping) -> int:
    return as_settings(config).generation.launch.nnodes


def job_resources(config: Settings | Mapping, category: str | None, attempt: int = 1) -> dict:
    """The rule's resources for one job of `category` at `attempt` (1 = first)."""
    config = as_settings(config)
    r = config.resources(category)
    n = nnodes(config)
    gpus = r.gpus
    out: dict = {"nodes": n, "cpus_per_task": r.cpus}
    model = r.gpu_model if gpus > 0 else None
    if n > 1 and gpus > 0:
        out.update(gpu=0, gpu_model=None, gres=f"gpu:{model}:{gpus}" if model else f"gpu:{gpus}")
    else:
        out.update(gpu=gpus, gpu_model=model, gres=None)
    out.update(attempt_growth(r, attempt))
    out["qos"] = r.qos
    out["constraint"] = r.constraint
    return out


def gpus_per_job(config: Settings | Mapping, category: str | None) -> int:
    """GPUs one generate job holds (all nodes together): for GPU-hours."""
    config = as_settings(config)
    return config.resources(category).gpus * nnodes(config)


def attempt_growth(r: ResourceSettings, attempt: int) -> dict:
    """runtime and mem_mb of a GPU job at `attempt` (1 = first): each grows with the attempt up
    to its cap (generate's and hidden_states' jobs alike)."""
    return {
        "runtime": _capped(r.runtime_min * attempt, r.max_runtime_min),
        "mem_mb": _capped(r.mem_mb * attempt, r.max_mem_mb),
    }


def _capped(value: int, cap) -> int:
    return min(value, int(cap)) if cap else value


def problems(config: Settings | Mapping) -> list[str]:
    """What the schema cannot check: caps below the first attempt's request."""
    config = as_settings(config)
    found = []
    scopes = [("generation.resources", None)]
    scopes += [(f"categories.{c}.resources", c) for c in sorted(config.categories)]
    for where, category in scopes:
        if category is not None and not config.categories[category].resources:
            continue
        r = config.resources(category)
        for value, cap in (("runtime_min", "max_runtime_min"), ("mem_mb", "max_mem_mb")):
            want, most = getattr(r, value), getattr(r, cap)
            if most and want and want > most:
                found.append(
                    f"config key '{where}.{value}': {want} is above {cap} ({most}); "
                    "the first attempt would already ask for more than the cap"
                )
    return found
