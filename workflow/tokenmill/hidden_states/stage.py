"""`tokenmill hidden-states`: one dataset shard -> its rows' hidden states (job.py).

    tokenmill hidden-states --category C --shard 000 --dataset results/dataset/C/000.parquet \
        --out-dir results/hidden_states/C/000 --config-json CONFIG --journal-dir journal \
        [--basedir .] [--record results/hidden_states/C/000.job.json] [--log-dir DIR]

CONFIG is the whole resolved config (inline JSON or a file): hidden_states.* and the model
(hidden_states.model, else generation.model), the harness's `jobs` settings. Writes the shard
folder and, last, its manifest.json (layout.py), then the job record
(contracts.HiddenStatesJobRecord: what it computed, every attempt and its GPU-hours); a killed
run resumes from its journal. The GPU-job harness (jobs/harness.py) holds the shard's lock,
records every attempt and turns SIGTERM/SIGINT into a clean stop.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import time
from pathlib import Path

from tokenmill import contracts
from tokenmill import layout as run_layout
from tokenmill import model as model_files
from tokenmill.hidden_states import job, layout
from tokenmill.jobs import harness
from tokenmill.jobs.lock import ShardLocked
from tokenmill.jobs.resources import attempt_growth
from tokenmill.settings import ConfigError, Settings, hidden_states_resources, load_section

STAGE = "hidden_states"


def layout_of(settings: Settings, basedir=".") -> run_layout.Layout:
    """The run's layout with its folders under `basedir` (unless absolute)."""
    return run_layout.Layout(
        str(Path(basedir) / settings.results_dir), str(Path(basedir) / settings.journal_dir)
    )


def model_name(settings: Settings) -> str | None:
    return settings.hidden_states.model or settings.generation.model


def plan_layers(settings: Settings, basedir=".") -> tuple[layout.ModelShape, list[int]]:
    """The model's shape and the resolved layer ids (LayoutError when they cannot be read)."""
    shape = layout.model_shape(model_name(settings), basedir, settings.generation.revision)
    hs = settings.hidden_states
    return shape, layout.resolve_layers(hs.layers, shape.num_layers, hs.drafter)


def fingerprint(settings: Settings, basedir=".") -> dict:
    """What the stored values depend on: the weights, the layer ids, the dtype, the backend."""
    shape, layers = plan_layers(settings, basedir)
    where = layout.model_dir(model_name(settings), basedir, settings.generation.revision)
    return {
        "model": model_name(settings),
        "weights": model_files.weights_fingerprint(where),
        "layers": layers,
        "dtype": shape.dtype,
        "hidden_size": shape.hidden_size,
        "backend": settings.hidden_states.backend,
    }


def job_resources(settings: Settings, attempt: int = 1) -> dict:
    """The rule's SLURM resources (one node; generation.resources with hidden_states.resources
    laid over it): GPUs as generate's one-node jobs ask for them, runtime and memory growing
    with the attempt up to their caps."""
    r = hidden_states_resources(settings.generation, settings.hidden_states)
    return {
        "nodes": 1,
        "cpus_per_task": r.cpus,
        "gpu": r.gpus,
        "gpu_model": r.gpu_model if r.gpus > 0 else None,
        **attempt_growth(r, attempt),
        "qos": r.qos,
        "constraint": r.constraint,
    }


def backend_factory(settings: Settings, basedir, layers: list[int], out_dir: Path, log_dir: Path):
    """A callable that starts the configured backend (only called when a row is left to do)."""
    hs = settings.hidden_states
    where = layout.model_dir(model_name(settings), basedir, settings.generation.revision)

    def make():
        if hs.backend == "vllm":
            from tokenmill.hidden_states.vllm_backend import VLLMBackend

            scratch = out_dir / ".vllm-scratch"
            return VLLMBackend(settings, basedir, where, layers, scratch, log_dir)
        from tokenmill.hidden_states.hf import HFBackend

        return HFBackend(str(where), layers, hs.device)

    return make


def backend_problems(settings: Settings) -> list[str]:
    """What the vLLM backend needs beyond the schema (for check-config)."""
    hs = settings.hidden_states
    if hs.backend != "vllm":
        return []
    if hs.mode == "managed" and not hs.launch.command:
        return ["config key 'hidden_states.launch.command': required for backend vllm (managed)"]
    if hs.mode == "external" and not hs.external.urls:
        return ["config key 'hidden_states.external.urls': required for backend vllm (external)"]
    return []


def main(argv: list[str]) -> int:
    t0 = time.monotonic() - harness.process_age_s()
    p = argparse.ArgumentParser(prog="tokenmill hidden-states", description=__doc__.split("\n")[0])
    p.add_argument("--category", required=True)
    p.add_argument("--shard", required=True)
    p.add_argument("--dataset", required=True, type=Path)
    p.add_argument("--out-dir", required=True, type=Path)
    p.add_argument("--record", type=Path, help="the job record; default: beside --out-dir")
    p.add_argument("--config-json", required=True)
    p.add_argument("--journal-dir", required=True, type=Path)
    p.add_argument("--basedir", default=".", type=Path)
    p.add_argument(
        "--log-dir", type=Path, help="the job's log folder (vllm: its engine log); default: "
        "the results folder's logs/hidden_states/{category}/{shard}",
    )  # fmt: skip
    a = p.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(message)s")
    # results/hidden_states/{category}/{shard} -> results
    lay = run_layout.Layout(str(a.out_dir.parent.parent.parent), str(a.journal_dir))
    log_dir = a.log_dir or Path(lay.job_log_dir(STAGE, a.category, a.shard))
    try:
        settings = load_section(a.config_json, None)
        fp = fingerprint(settings, a.basedir)
        problems = backend_problems(settings)
        if problems:
            raise ConfigError("; ".join(problems))
        factory = backend_factory(settings, a.basedir, fp["layers"], a.out_dir, log_dir)
    except (ConfigError, layout.LayoutError) as exc:
        print(f"tokenmill hidden-states: {exc}", file=sys.stderr)
        return 1
    hs = settings.hidden_states
    resources = hidden_states_resources(settings.generation, hs)
    managed = hs.backend == "hf" or hs.mode == "managed"
    source = "hidden_states.resources over generation.resources (no SLURM allocation)"
    held = harness.held(managed, resources.gpus, 1, source)
    spec = harness.JobSpec(
        stage=STAGE, category=a.category, shard=a.shard, layout=lay,
        log=str(log_dir / f"{STAGE}.log"), gpus=held.gpus, settings=settings.jobs,
    )  # fmt: skip
    journal_path = Path(lay.hidden_states_journal(a.category, a.shard))
    earlier = a.journal_dir / STAGE / a.category / f"{a.shard}.jsonl"  # before tokenmill/layout.py
    if earlier.is_file() and not journal_path.exists():
        journal_path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(earlier, journal_path)
    start_time = harness.now_iso()
    try:
        with harness.GpuJob(spec) as gpu_job, gpu_job.catch_signals():
            manifest, work = job.run_shard(
                category=a.category,
                shard=a.shard,
                dataset=a.dataset,
                out_dir=a.out_dir,
                journal_path=journal_path,
                backend_factory=factory,
                fingerprint=fp,
                layouts=tuple(hs.layouts),
                batch_tokens=hs.batch_tokens,
                max_batch_rows=hs.max_batch_rows,
                describe={"layer_ids": fp["layers"], "dtype": fp["dtype"]},
            )
            contracts.HiddenStatesJobRecord(
                category=a.category, shard=a.shard, backend=hs.backend, start_time=start_time,
                end_time=harness.now_iso(), host=socket.gethostname(), pid=os.getpid(),
                slurm=harness.slurm_job(), rows=manifest.rows,
                rows_computed=work.rows, tokens_computed=work.tokens, compute_s=work.seconds,
                total_s=round(time.monotonic() - t0, 3), held=held,
                attempts=gpu_job.succeeded(),
            ).write(a.record or lay.hidden_states_record(a.category, a.shard))  # fmt: skip
    except harness.Interrupted as exc:
        print(f"tokenmill hidden-states: {exc}: stopped; the next attempt resumes", file=sys.stderr)
        return 128 + exc.signum
    except (harness.Refused, ShardLocked, OSError, RuntimeError) as exc:
        print(f"tokenmill hidden-states: {exc}", file=sys.stderr)
        return 1
    print(
        f"{a.category}/{a.shard}: {manifest.rows} rows, {manifest.tokens} tokens, "
        f"{len(manifest.files)} files, {manifest.bytes} bytes"
    )
    return 0


# ------------------------------------------------------------------------------ plan


def dataset_tokens(settings: Settings, basedir, category: str) -> int | None:
    """Tokens of a category's merged shards (exact), or None before merge has run them all."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    lay = layout_of(settings, basedir)
    files = [Path(lay.dataset(category, s)) for s in run_layout.declared(settings)[category]]
    if not all(f.exists() for f in files):
        return None
    return sum(int(pc.sum(pq.read_table(f, columns=["num_total_tokens"])[0]).as_py() or 0)
               for f in files)  # fmt: skip


def estimate(settings: Settings, basedir, expected_tokens: dict[str, int]) -> dict | None:
    """What the stage will write, per category and layout: tokens x layers x H x dtype bytes
    (+ the int64 ids and masks; container headers and the rows folder not counted). Tokens: the
    merged shards' when merge has run, else `expected_tokens` (the plan's prompt + expected
    output tokens). None when the stage is off."""
    hs = settings.hidden_states
    if not hs.enabled:
        return None
    try:
        shape, layers = plan_layers(settings, basedir)
    except layout.LayoutError as exc:
        return {"error": str(exc)}
    per_token = {
        lay: layout.bytes_per_token(lay, len(layers), shape.hidden_size, shape.dtype_bytes)
        for lay in hs.layouts
    }
    rows = []
    for category in sorted(settings.categories):
        exact = dataset_tokens(settings, basedir, category)
        tokens = exact if exact is not None else int(expected_tokens.get(category, 0))
        rows.append(
            {
                "category": category,
                "tokens": tokens,
                "tokens_from": "merged shards" if exact is not None else "plan estimate",
                "bytes": {lay: tokens * n for lay, n in per_token.items()},
            }
        )
    return {
        "layer_ids": layers,
        "hidden_size": shape.hidden_size,
        "dtype": shape.dtype,
        "bytes_per_token": per_token,
        "categories": rows,
        "total_bytes": sum(sum(r["bytes"].values()) for r in rows),
    }


def _size(n: int) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_estimate(est: dict | None) -> list[str]:
    """The plan's lines for the stage (none when it is off)."""
    if est is None:
        return []
    if "error" in est:
        return [f"hidden_states: cannot estimate: {est['error']}"]
    lays = list(est["bytes_per_token"])
    lines = [
        f"hidden_states: layers {est['layer_ids']}, H {est['hidden_size']}, {est['dtype']}; "
        + ", ".join(
            f"{lay} {n} B/token" + (" before gzip (at most)" if layout.is_gzipped(lay) else "")
            for lay, n in est["bytes_per_token"].items()
        )
    ]
    for r in est["categories"]:
        sizes = ", ".join(f"{lay} {_size(r['bytes'][lay])} ({r['bytes'][lay]} B)" for lay in lays)
        lines.append(f"  {r['category']}: {r['tokens']} tokens ({r['tokens_from']}): {sizes}")
    lines.append(f"  total: {_size(est['total_bytes'])} ({est['total_bytes']} B)")
    return lines
