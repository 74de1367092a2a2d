"""`tokenmill generate`: one tokenized shard -> generated shard (+ rejected rows, + meta JSON).

    tokenmill generate --generation-config GEN.json --tokenizer-config TOK.json --category C
        --shard 007 --tokenized T.parquet --out G.parquet --rejected R.parquet --meta M.json
        --journal-dir DIR --log-dir DIR [--basedir .]

The command only: it reads its arguments and settings, takes the shard's lock (one process per
shard), picks the runner (generate/prompts.py for a shard of single prompts,
generate/conversations.py for a `context: regenerated` one; both are variants of the job core,
generate/job.py), turns SIGTERM/SIGINT into a clean stop (flush the journal, stop the engine,
exit non-zero: Snakemake retries, the retry resumes from the journal) and writes the meta JSON
once the shard is written, with what the job held (job.held_resources).

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

from tokenmill import contracts
from tokenmill.engines.launch import EngineError
from tokenmill.generate import conversations, failure, prompts
from tokenmill.generate.client import FailFast, GenerationFailed
from tokenmill.generate.job import held_resources
from tokenmill.jobs import lock as shard_lock
from tokenmill.jobs.lock import ShardLocked
from tokenmill.redaction import redact
from tokenmill.settings import ConfigError, load_section

log = logging.getLogger("tokenmill.generate")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="tokenmill generate", description=__doc__.split("\n")[0])
    p.add_argument("--generation-config", required=True, help="JSON: the generation section")
    p.add_argument("--tokenizer-config", required=True, help="JSON: the tokenizer section")
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


def _process_age_s() -> float:
    """Seconds since this process started (imports included), from /proc; 0 elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


async def run(args, gen, tok_cfg, meta: dict, t0: float | None = None) -> int:
    """The runner for the shard's kind. `t0`: the process's start on the monotonic clock
    (timing counts imports too)."""
    if contracts.is_regenerated(args.tokenized):  # context: regenerated
        return await conversations.run(args, gen, tok_cfg, meta, t0)
    return await prompts.run(args, gen, tok_cfg, meta, t0)


async def _main_async(args, gen, tok_cfg, meta, t0=None) -> int:
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
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        return await run(args, gen, tok_cfg, meta, t0)
    except asyncio.CancelledError:
        if caught:
            return 128 + caught[0]
        raise


def main(argv: list[str]) -> int:
    t0 = time.monotonic() - _process_age_s()
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    try:
        # Inline JSON or a file, the whole config or the section: validated, defaults filled.
        gen = load_section(args.generation_config, "generation")
        tok_cfg = load_section(args.tokenizer_config, "tokenizer")
    except ConfigError as exc:
        log.error("generate: %s", exc)
        return 2
    meta: dict = {
        "start_time": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm": {
            k: os.environ[k]
            for k in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "CUDA_VISIBLE_DEVICES")
            if k in os.environ
        },  # fmt: skip
    }
    failed_at = failure.failure_path(args.journal_dir, args.category, args.shard)
    try:
        # One process per shard: a second job on it (a restarted controller) waits for the
        # live holder (TOKENMILL_LOCK_WAIT_S), then resumes from its journal.
        with shard_lock.hold(args.journal_dir, args.category, args.shard):
            # A deterministic failure of an earlier attempt with this very config is not paid
            # again (generate/failure.py): exit before any engine starts.
            ident = failure.identity(gen, args.tokenized)
            earlier = failure.recorded(failed_at, ident)
            if earlier is not None:
                log.error(
                    "generate failed: an earlier attempt (%s, SLURM job %s) failed with this "
                    "same config for a reason a retry cannot change; not starting an engine. "
                    "Change the config, or delete %s to try again. Its message:\n%s",
                    earlier.get("time"), earlier.get("slurm_job_id") or "-", failed_at,
                    earlier.get("message"),
                )  # fmt: skip
                return 1
            try:
                rc = asyncio.run(_main_async(args, gen, tok_cfg, meta, t0))
            except FailFast as exc:
                failure.record(failed_at, ident, str(exc))
                raise
    except (GenerationFailed, EngineError, ValueError, OSError, ShardLocked) as exc:
        log.error("generate failed: %s", exc)
        return 1
    if rc == 0:
        failure.clear(failed_at)
    if rc == 0:
        meta["end_time"] = datetime.now(UTC).isoformat(timespec="seconds")
        meta["held"] = held_resources(gen, args.category, meta)
        secrets = [k for k in [os.environ.get(gen.api_key_env or "")] if k]
        contracts.write_json_atomic(args.meta, redact(meta, secrets))
    return rc
