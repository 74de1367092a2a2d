"""`tokenmill generate`: one tokenized shard -> generated shard (+ rejected rows, + meta JSON).

    tokenmill generate --generation-config GEN.json --tokenizer-config TOK.json --category C
        --shard 007 --tokenized T.parquet --out G.parquet --rejected R.parquet --meta M.json
        --journal-dir DIR --log-dir DIR [--basedir .]

Order of work: keys for every prompt -> read the category's journal -> if nothing is missing,
write the shard without starting any engine -> else start (or reach) the engine, send only the
missing samples, journal each as it completes, restart a dead engine up to launch.max_restarts
times -> write the shard from the journal's records. SIGTERM/SIGINT: flush the journal, stop the
engine, exit non-zero (Snakemake retries; the retry resumes from the journal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import contracts, keys
from tokenmill.cli import json_arg
from tokenmill.generate import engines, journal, shard_lock
from tokenmill.generate.client import (
    Client,
    ClientOptions,
    EngineDied,
    GenerationFailed,
    Item,
    Stats,
)
from tokenmill.generate.launch import EngineError, ExternalEngines, ManagedEngine
from tokenmill.generate.shard_lock import ShardLocked
from tokenmill.redaction import redact

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


def _load_section(path: str, name: str) -> dict:
    obj = json_arg(path, f"--{name}-config")
    # Accept the whole config as well as the section itself.
    return obj[name] if isinstance(obj.get(name), dict) else obj


def resolve_stop_ids(gen: dict, tok_cfg: dict, basedir: str) -> list[int]:
    tokens = list(gen.get("stop_tokens") or [])
    if all(isinstance(t, int) for t in tokens):
        return tokens
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenmill.tokenization.tokenizer import (  # heavy: only when needed
        load_tokenizer,
        resolve_token_ids,
    )

    return resolve_token_ids(load_tokenizer(tok_cfg, basedir), tokens)


def _api_key(gen: dict) -> str | None:
    name = gen.get("api_key_env")
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"generation.api_key_env: environment variable {name} is not set")
    return value


def _write_json_atomic(path: str, obj) -> None:
    tmp = contracts.atomic_path(path)
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)


class Shard:
    """The shard's prompts and their sample keys (computed from the Arrow buffers, no lists)."""

    def __init__(self, path: str, fingerprint: str, seed_policy: str):
        table = pq.read_table(path, columns=["prompt_id", "prompt_ids"])
        self.prompt_ids_col = table.column("prompt_ids").combine_chunks()
        self.prompt_id = table.column("prompt_id").to_pylist()
        values = self.prompt_ids_col.values.to_numpy(zero_copy_only=False).astype("<i4", copy=False)
        offsets = self.prompt_ids_col.offsets.to_numpy()
        self._values, self._offsets = values, offsets
        self.keys = [
            keys.sample_key(fingerprint, values[offsets[i] : offsets[i + 1]])
            for i in range(len(self.prompt_id))
        ]
        self.seed_policy = seed_policy

    def __len__(self):
        return len(self.prompt_id)

    def ids(self, i: int) -> np.ndarray:
        return self._values[self._offsets[i] : self._offsets[i + 1]]

    def item(self, i: int) -> Item:
        key = self.keys[i]
        seed = keys.sampling_seed(key) if self.seed_policy == "per_sample" else None
        return Item(self.prompt_id[i], key, self.ids(i).tolist(), seed)


def build_tables(shard: Shard, records: dict, pre_rejected: dict, category: str):
    order = sorted(range(len(shard)), key=lambda i: shard.prompt_id[i])
    gen_rows = {name: [] for name in contracts.GENERATED.names}
    rej_rows = []
    for i in order:
        pid, key = shard.prompt_id[i], shard.keys[i]
        if i in pre_rejected:
            reason, detail = pre_rejected[i]
            rec = None
        else:
            rec = records[key]
            if rec.get("status") == "ok":
                for name in contracts.GENERATED.names:
                    gen_rows[name].append(rec.get(name))
                gen_rows["prompt_id"][-1] = pid
                gen_rows["sample_key"][-1] = key
                continue
            reason, detail = "engine_rejected", rec.get("message")
        rej_rows.append(
            {
                "stage": "generate",
                "category": category,
                "reason": reason,
                "detail": detail,
                "prompt_id": pid,
                "record": contracts.canonical_json(
                    {"sample_key": key, "num_prompt_tokens": len(shard.ids(i))}
                ),
            }
        )
    return pa.table(gen_rows, schema=contracts.GENERATED), contracts.rejected_table(rej_rows)


async def run(args, gen: dict, tok_cfg: dict, meta: dict) -> int:
    t_start = time.monotonic()
    fingerprint = keys.generation_fingerprint(gen)
    launch = gen.get("launch") or {}
    managed = gen.get("mode", "managed") == "managed"
    api = engines.for_config(gen)  # the engine-specific part: requests, answers, identity
    # The engine's sampling keys are checked before the first request is paid for.
    engines.validate(gen)
    api_key = _api_key(gen)
    secrets = [api_key] if api_key else []
    shard = Shard(args.tokenized, fingerprint, gen.get("seed_policy", "none"))

    # Prompts that no engine could answer are refused here rather than paid for.
    pre_rejected = {i: ("empty_prompt", "prompt_ids is empty") for i in range(len(shard))
                    if len(shard.ids(i)) == 0}  # fmt: skip
    wanted = {shard.keys[i] for i in range(len(shard)) if i not in pre_rejected}
    records, jstats = journal.load(args.journal_dir, args.category, wanted)
    log.info(
        "shard %s/%s: %d prompts, %d unique samples, %d journaled (%d files, %d torn lines)",
        args.category, args.shard, len(shard), len(wanted), len(records), jstats["files"],
        jstats["torn"],
    )  # fmt: skip
    from_journal = len(records)
    missing, seen = [], set()
    for i in range(len(shard)):
        k = shard.keys[i]
        if i in pre_rejected or k in records or k in seen:
            continue
        seen.add(k)
        missing.append(shard.item(i))

    stats = Stats()
    counts = {
        "prompts": len(shard),
        "unique_samples": len(wanted),
        "from_journal": from_journal,
        "to_generate": len(missing),
    }
    meta.update(
        generation_fingerprint=fingerprint,
        category=args.category,
        shard=args.shard,
        mode="managed" if managed else "external",
        engine=api.name,
        engine_started=False,
        counts=counts,
        journal={
            "dir": str(args.journal_dir),
            "files_read": jstats["files"],
            "torn_lines": jstats["torn"],
        },  # fmt: skip
    )
    restarts = 0
    if missing:
        stop_ids = resolve_stop_ids(gen, tok_cfg, args.basedir)
        opts = ClientOptions.from_config(gen, stop_ids, api_key)
        engine = (
            ManagedEngine(gen, args.log_dir, args.basedir, api_key, api=api)
            if managed
            else ExternalEngines(gen, api_key, api=api)
        )
        writer = journal.JournalWriter(args.journal_dir, args.category, args.shard)
        meta["journal"]["file"] = str(writer.path)

        def on_record(rec: dict) -> None:
            writer.append(rec)
            prev = records.get(rec["key"])
            if prev is None or prev.get("status") != "ok":
                records[rec["key"]] = rec

        try:
            meta["engine_started"] = True
            await engine.start()
            _record_engine(meta, engine, secrets)
            if not managed:
                sti = any(api.server_skips_tokenizer(si) for si in engine.server_info.values())
                api.validate_sampling(gen.get("sampling") or {}, sti)
            urls = [engine.url] if managed else engine.urls
            while True:
                todo = [it for it in missing if it.key not in records]
                if not todo:
                    break
                alive = engine.alive if managed else None
                client = Client(urls, opts, on_record, alive, stats, api=api)
                try:
                    await client.run(todo)
                except EngineDied as exc:
                    if restarts >= int(launch.get("max_restarts", 2)):
                        raise GenerationFailed(
                            f"engine died {restarts + 1} times (launch.max_restarts={restarts}); "
                            f"last: {exc}; engine log tail:\n{engine.log_tail()}"
                        ) from None
                    restarts += 1
                    log.warning("engine died (%s); restart %d", exc, restarts)
                    engine.stop()
                    await engine.start()
                    _record_engine(meta, engine, secrets)
                    urls = [engine.url]
        finally:
            writer.close()  # the journal first: it holds what was paid for
            engine.stop()
            counts.update(
                requested=stats.requested, retries=stats.retries, restarts=restarts,
                generated=stats.done,
            )  # fmt: skip

    gen_table, rej_table = build_tables(shard, records, pre_rejected, args.category)
    kept, rejected = gen_table.num_rows, rej_table.num_rows
    if kept + rejected != len(shard):  # every prompt exactly once, in one of the two files
        raise RuntimeError(f"count mismatch: {len(shard)} in, {kept} kept, {rejected} rejected")
    file_meta = {
        contracts.META_GENERATION_FINGERPRINT: fingerprint,
        contracts.META_CATEGORY: args.category,
        contracts.META_SHARD: args.shard,
        "tokenmill.records_in": str(len(shard)),
        "tokenmill.kept": str(kept),
        "tokenmill.rejected": str(rejected),
    }
    contracts.write_table(gen_table, args.out, contracts.GENERATED, "generate", file_meta)
    contracts.write_table(rej_table, args.rejected, contracts.REJECTED, "generate", file_meta)
    out_tokens = pc.sum(pc.list_value_length(gen_table.column("output_ids"))).as_py() or 0
    counts.update(kept=kept, rejected=rejected, output_tokens=out_tokens)
    counts.setdefault("requested", 0)
    counts.setdefault("restarts", 0)
    counts.setdefault("retries", 0)
    meta["wall_time_s"] = round(time.monotonic() - t_start, 3)
    log.info("shard %s/%s done: %s", args.category, args.shard, json.dumps(counts, sort_keys=True))
    return 0


def _record_engine(meta: dict, engine, secrets: list[str]) -> None:
    meta["server_info"] = redact(engine.server_info, secrets)
    meta["model_info"] = redact(engine.model_info, secrets)
    if isinstance(engine, ManagedEngine):
        meta["engine_argv"] = engine.redacted_argv()
        meta["engine_url"] = engine.url
        meta["engine_starts"] = engine.starts
    else:
        meta["engine_urls"] = redact(engine.urls, secrets)


async def _main_async(args, gen, tok_cfg, meta) -> int:
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
        return await run(args, gen, tok_cfg, meta)
    except asyncio.CancelledError:
        if caught:
            return 128 + caught[0]
        raise


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    gen = _load_section(args.generation_config, "generation")
    tok_cfg = _load_section(args.tokenizer_config, "tokenizer")
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
    try:
        # One process per shard: a second job on it (a restarted controller) fails fast here.
        with shard_lock.hold(args.journal_dir, args.category, args.shard):
            rc = asyncio.run(_main_async(args, gen, tok_cfg, meta))
    except (GenerationFailed, EngineError, ValueError, OSError, ShardLocked) as exc:
        log.error("generate failed: %s", exc)
        return 1
    if rc == 0:
        meta["end_time"] = datetime.now(UTC).isoformat(timespec="seconds")
        secrets = [k for k in [os.environ.get(gen.get("api_key_env") or "")] if k]
        _write_json_atomic(args.meta, redact(meta, secrets))
    return rc
