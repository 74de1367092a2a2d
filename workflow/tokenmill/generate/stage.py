"""`tokenmill generate`: one tokenized shard -> generated shard (+ rejected rows, + job record).

    tokenmill generate --config-json CONFIG --category C --shard 007 --tokenized T.parquet
        --out G.parquet --rejected R.parquet --meta M.json --journal-dir DIR --log-dir DIR
        [--basedir .]

CONFIG is the whole resolved config (inline JSON or a file; the rules pass the workflow's, in
$TOKENMILL_CONFIG_JSON): the generation and tokenizer sections, the category's resources and
the job harness's settings come from it, loaded here and handed down. A job started by hand may
give `--generation-config` and `--tokenizer-config` (a section or the whole config each)
instead; the category's resources and `jobs` then take the schema's defaults.

The command only: it reads its arguments and settings, runs inside the GPU-job harness
(jobs/harness.py: the shard's lock, a deterministic failure not paid twice, every attempt and
its GPU-hours recorded), picks the runner (generate/prompts.py for a shard of single prompts,
generate/conversations.py for a `context: regenerated` one; both are variants of the job core,
generate/job.py), turns SIGTERM/SIGINT into a clean stop (flush the journal, stop the engine,
exit non-zero: Snakemake retries, the retry resumes from the journal) and writes the job record
(contracts.GenerateJobRecord) once the shard is written.

Stop tokens given as strings were resolved to ids by `tokenmill tokenize` (tokenized shard
metadata), so this command imports neither transformers nor torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from tokenmill import contracts
from tokenmill.engines.launch import EngineError
from tokenmill.generate import conversations, failure, prompts
from tokenmill.generate.client import FailFast, GenerationFailed, RunStopped, TooManyRejections
from tokenmill.generate.job import engine_version, job_layout, job_record
from tokenmill.jobs import harness
from tokenmill.jobs.lock import ShardLocked
from tokenmill.redaction import redact
from tokenmill.settings import ConfigError, effective_resources, load_section

log = logging.getLogger("tokenmill.generate")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tokenmill generate", description=__doc__.split("\n")[0])
    p.add_argument("--config-json", help="the whole resolved config (JSON or a file)")
    p.add_argument("--generation-config", help="without --config-json: the generation section")
    p.add_argument("--tokenizer-config", help="without --config-json: the tokenizer section")
    p.add_argument("--category", required=True)
    p.add_argument("--shard", required=True)
    p.add_argument("--tokenized", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rejected", required=True)
    p.add_argument("--meta", required=True)
    p.add_argument("--journal-dir", required=True)
    p.add_argument("--log-dir", required=True)
    p.add_argument("--basedir", default=".")
    return p.parse_args(argv)


async def run(args, gen, tok_cfg, meta: dict, t0: float | None = None) -> int:
    """The runner for the shard's kind. `t0`: the process's start on the monotonic clock
    (timing counts imports too)."""
    if contracts.is_regenerated(args.tokenized):  # context: regenerated
        return await conversations.run(args, gen, tok_cfg, meta, t0)
    return await prompts.run(args, gen, tok_cfg, meta, t0)


async def _main_async(args, gen, tok_cfg, meta, t0, job: harness.GpuJob) -> int:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    caught: list[int] = []

    def on_signal(signum: int) -> None:
        if not caught:
            log.error(
                "received %s: flushing the journal, stopping the engine",
                signal.Signals(signum).name,
            )
        caught.append(signum)
        job.interrupted(signum)
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await run(args, gen, tok_cfg, meta, t0)
    except asyncio.CancelledError:
        if caught:
            return 128 + caught[0]
        raise


def load_settings(args):
    """(generation, tokenizer, the category's resources, jobs) settings: from --config-json,
    else from --generation-config and --tokenizer-config with the schema's defaults for the
    rest. ConfigError names the key."""
    if args.config_json:
        whole = load_section(args.config_json, None)
        category = whole.categories.get(args.category)
        resources = effective_resources(whole.generation, category)
        source = ""
        if category is not None and category.resources:
            source = f"categories.{args.category}.resources over "
        return whole.generation, whole.tokenizer, resources, whole.jobs, source
    if not (args.generation_config and args.tokenizer_config):
        raise ConfigError("give --config-json, or --generation-config and --tokenizer-config")
    gen = load_section(args.generation_config, "generation")
    tok = load_section(args.tokenizer_config, "tokenizer")
    return gen, tok, gen.resources, load_section({}, "jobs"), ""


def main(argv: list[str]) -> int:
    t0 = time.monotonic() - harness.process_age_s()
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    try:
        # Inline JSON or a file: validated, defaults filled.
        gen, tok_cfg, resources, jobs, source = load_settings(args)
    except ConfigError as exc:
        log.error("generate: %s", exc)
        return 2
    source += "generation.resources x launch.nnodes (no SLURM allocation)"
    held = harness.held(gen.managed, resources.gpus, gen.launch.nnodes, source)
    spec = harness.JobSpec(
        stage="generate", category=args.category, shard=args.shard,
        layout=job_layout(args),
        log=str(Path(args.log_dir) / "generate.log"), gpus=held.gpus, settings=jobs,
        identity=failure.identity(gen, args.tokenized),
        deterministic=(FailFast, TooManyRejections, RunStopped),
        run_identity=failure.run_identity(gen), systemic=(FailFast,),
    )  # fmt: skip
    meta: dict = {
        "start_time": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm": harness.slurm_job().to_json(),
    }
    try:
        # One process per shard: a second job on it (a restarted controller) waits for the
        # live holder (jobs.lock_wait_s), then resumes from its journal. A deterministic
        # failure of an earlier attempt with this very config is not paid again: Refused,
        # before any engine starts.
        with harness.GpuJob(spec) as job:
            rc = asyncio.run(_main_async(args, gen, tok_cfg, meta, t0, job))
            if rc == 0:
                meta["end_time"] = datetime.now(UTC).isoformat(timespec="seconds")
                version = engine_version(meta.get("server_info"), gen.managed)
                held = harness.held(gen.managed, resources.gpus, gen.launch.nnodes, source,
                                    version)  # fmt: skip
                secrets = [k for k in [os.environ.get(gen.api_key_env or "")] if k]
                record = job_record(redact(meta, secrets), held, job.succeeded())
                record.write(args.meta)
    except (harness.Refused, GenerationFailed, EngineError, ValueError, OSError,
            ShardLocked, contracts.RecordError) as exc:  # fmt: skip
        log.error("generate failed: %s", exc)
        return 1
    return rc
