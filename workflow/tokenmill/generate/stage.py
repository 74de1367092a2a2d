"""`tokenmill generate`: one tokenized shard -> generated shard (+ rejected rows, + meta JSON).

    tokenmill generate --generation-config GEN.json --tokenizer-config TOK.json --category C
        --shard 007 --tokenized T.parquet --out G.parquet --rejected R.parquet --meta M.json
        --journal-dir DIR --log-dir DIR [--basedir .]

Order of work: keys for every prompt -> the journal's layout (a one-time migration when the shard
count changed) -> index this shard's journal files only -> if nothing is missing, write the shard
without starting any engine -> else start (or reach) the engine, send only the missing samples,
journal each as it completes, restart a dead engine up to launch.max_restarts times -> stream
the shard from the journal in row groups (prompt_id order) while writing the shard's compacted
journal file -> swap the compacted file in. SIGTERM/SIGINT: flush the journal, stop the engine,
exit non-zero (Snakemake retries; the retry resumes from the journal).

Memory follows a row group, not the shard: prompt ids are read from the tokenized shard when a
request is built, answers go to the journal (only their place in it stays in memory), and the
output is written from the journal FETCH_ROWS records at a time.

Stop tokens given as strings were resolved to ids by `tokenmill tokenize` (tokenized shard
metadata), so this command imports neither transformers nor torch.

Timing (meta `timing`): startup_s is process start to the first request (imports, keys, journal
replay, engine start), generation_s the first request to the last answer (the window the rates
and progress lines use), write_s the output and journal compaction, total_s all of it
(`wall_time_s`, kept for older readers).
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
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import contracts, keys
from tokenmill.cli import json_arg
from tokenmill.generate import engines, journal, shard_lock
from tokenmill.generate.client import (
    OK,
    REASONS,
    REJECTED,
    Client,
    ClientOptions,
    EngineDied,
    FailFast,
    GenerationFailed,
    Item,
    RejectionGuard,
    Stats,
)
from tokenmill.generate.launch import (
    EngineError,
    ExternalEngines,
    ManagedEngine,
    model_vocab_size,
)
from tokenmill.generate.shard_lock import ShardLocked
from tokenmill.redaction import redact
from tokenmill.tokenization.stage import META_NUM_SHARDS, META_STOP_TOKEN_IDS, META_STOP_TOKENS

log = logging.getLogger("tokenmill.generate")

# Prompts whose journal records are read (and decoded) at once while the output is written.
FETCH_ROWS = 256
# Row groups of the tokenized shard kept decoded for building requests (they are asked for in
# shard order, so one or two are in use at a time; a retry may reach back a little).
PROMPT_ROW_GROUPS_CACHED = 4


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


def resolve_stop_ids(gen: dict, tok_cfg: dict, basedir: str, shard_meta: dict):
    """(stop token ids, where they came from). Strings were resolved by `tokenmill tokenize`
    into the tokenized shard's metadata; only a shard written without them (or for other stop
    tokens) makes this load the tokenizer, which imports transformers."""
    tokens = list(gen.get("stop_tokens") or [])
    if all(isinstance(t, int) for t in tokens):
        return tokens, "config"
    stored = shard_meta.get(META_STOP_TOKENS)
    if stored is not None and json.loads(stored) == tokens:
        return json.loads(shard_meta[META_STOP_TOKEN_IDS]), "tokenized shard metadata"
    log.warning(
        "stop tokens %s are not resolved in the tokenized shard's metadata (%s); loading the "
        "tokenizer to resolve them",
        tokens,
        "written for other stop tokens" if stored is not None else "written without them",
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tokenmill.tokenization.tokenizer import (  # heavy: only when needed
        load_tokenizer,
        resolve_token_ids,
    )

    return resolve_token_ids(load_tokenizer(tok_cfg, basedir), tokens), "tokenizer"


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
    """The shard's prompts, their lengths and sample keys, read one row group at a time.

    The prompt ids themselves are not kept: `ids(i)` reads them again from the file (a few
    decoded row groups cached), so memory follows a row group whatever the shard's size.
    """

    def __init__(self, path: str, fingerprint: str, seed_policy: str):
        # Not memory-mapped: mapped pages of the file would count in the job's RSS.
        self.pf = pq.ParquetFile(path, memory_map=False)
        self.metadata = contracts.read_metadata(path)
        n = self.metadata.get(META_NUM_SHARDS)
        self.num_shards = int(n) if n else None
        self.prompt_id: list[str] = []
        self.keys: list[str] = []
        lengths, sizes = [], []
        for g in range(self.pf.num_row_groups):
            t = self.pf.read_row_group(g, columns=["prompt_id", "prompt_ids"])
            self.prompt_id += t.column("prompt_id").to_pylist()
            values, offsets = _list_arrays(t.column("prompt_ids"))
            lengths.append(np.diff(offsets))
            sizes.append(t.num_rows)
            self.keys += [
                keys.sample_key(fingerprint, values[offsets[i] : offsets[i + 1]])
                for i in range(t.num_rows)
            ]
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self._starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._groups: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.seed_policy = seed_policy

    def __len__(self):
        return len(self.prompt_id)

    def ids(self, i: int) -> np.ndarray:
        g = int(np.searchsorted(self._starts, i, side="right")) - 1
        if g not in self._groups:
            col = self.pf.read_row_group(g, columns=["prompt_ids"]).column(0)
            self._groups[g] = _list_arrays(col)
            if len(self._groups) > PROMPT_ROW_GROUPS_CACHED:
                self._groups.popitem(last=False)
        self._groups.move_to_end(g)
        values, offsets = self._groups[g]
        r = i - int(self._starts[g])
        return values[offsets[r] : offsets[r + 1]]

    def item(self, i: int) -> Item:
        key = self.keys[i]
        seed = keys.sampling_seed(key) if self.seed_policy == "per_sample" else None
        return ShardItem(self, i, key, seed)


def _list_arrays(col) -> tuple[np.ndarray, np.ndarray]:
    """(values as little-endian int32, offsets into them) of a list<int32> column."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    values = arr.values.to_numpy(zero_copy_only=False).astype("<i4", copy=False)
    return values, arr.offsets.to_numpy()


class ShardItem(Item):
    """An Item whose prompt ids are read from the tokenized shard when a request is built, so
    that the queue of missing samples holds no token lists."""

    def __init__(self, shard: Shard, i: int, key: str, seed: int | None):
        self.prompt_id, self.key, self.seed = shard.prompt_id[i], key, seed
        self._shard, self._i = shard, i

    @property
    def prompt_ids(self) -> list[int]:
        return self._shard.ids(self._i).tolist()


def write_outputs(shard: Shard, index, pre_rejected: dict, category: str, gen_w, rej_w,
                  compaction, unjournaled: dict | None = None) -> int:  # fmt: skip
    """Stream the generated and rejected rows (prompt_id order) from the journal, FETCH_ROWS
    prompts at a time, into row groups; hand each record once to the compaction. Returns the
    number of output tokens. `unjournaled`: this job's outcomes that are never journaled (engine
    errors, asked again by the next run), by key; they win over a journaled refusal."""
    unjournaled = unjournaled or {}
    order = sorted(range(len(shard)), key=shard.prompt_id.__getitem__)
    gen_buf = journal.RowGroupBuffer(gen_w.write, "output_ids")
    rej_buf = journal.RowGroupBuffer(rej_w.write, None)
    compacted: set[str] = set()
    out_tokens = 0
    for start in range(0, len(order), FETCH_ROWS):
        rows = order[start : start + FETCH_ROWS]
        ks = list(
            dict.fromkeys(
                shard.keys[i] for i in rows if i not in pre_rejected and index.has(shard.keys[i])
            )
        )
        table = index.fetch(ks)
        pos = {k: j for j, k in enumerate(ks)}
        ok = pc.fill_null(pc.equal(table.column("status"), "ok"), False).to_numpy(
            zero_copy_only=False
        )
        take, pids, skeys, rej = [], [], [], []
        for i in rows:
            key = shard.keys[i]
            if i in pre_rejected:
                reason, detail = pre_rejected[i]
            elif key in unjournaled and not (key in pos and ok[pos[key]]):
                rec = unjournaled[key]
                reason, detail = REASONS[rec["status"]], rec.get("message")
            elif ok[pos[key]]:
                take.append(pos[key])
                pids.append(shard.prompt_id[i])
                skeys.append(key)
                continue
            else:
                status = table.column("status")[pos[key]].as_py()
                reason = REASONS.get(status, REASONS[REJECTED])
                detail = table.column("message")[pos[key]].as_py()
            rej.append(
                {
                    "stage": "generate",
                    "category": category,
                    "reason": reason,
                    "detail": detail,
                    "prompt_id": shard.prompt_id[i],
                    "record": contracts.canonical_json(
                        {"sample_key": key, "num_prompt_tokens": int(shard.lengths[i])}
                    ),
                }
            )
        if take:
            # Usually every record of the chunk, in order: share its buffers (no copy).
            in_order = take == list(range(table.num_rows))
            g = table if in_order else table.take(pa.array(take, pa.int64()))
            g = g.set_column(
                g.schema.get_field_index("prompt_id"), "prompt_id", pa.array(pids, pa.string())
            )
            g = g.append_column("sample_key", pa.array(skeys, pa.string()))
            out_tokens += pc.sum(pc.list_value_length(g.column("output_ids"))).as_py() or 0
            gen_buf.add(g.select(contracts.GENERATED.names))
        if rej:
            rej_buf.add(contracts.rejected_table(rej))
        if compaction is not None:
            fresh = [j for j, k in enumerate(ks) if k not in compacted]
            compacted.update(ks)
            compaction.add(table if len(fresh) == len(ks) else table.take(pa.array(fresh)))
    gen_buf.finish()
    rej_buf.finish()
    # An empty shard is still a file with its schema (what write_table of no rows gives).
    if gen_w.rows == 0:
        gen_w.write(contracts.GENERATED.empty_table())
    if rej_w.rows == 0:
        rej_w.write(contracts.REJECTED.empty_table())
    return out_tokens


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


@dataclass
class Job:
    """What the steps of one generate job share."""

    args: argparse.Namespace
    gen: dict
    tok_cfg: dict
    meta: dict
    clock: dict  # monotonic times: t0 (process start), run, replayed, first_request, ...
    shard: Shard
    sj: journal.ShardJournal
    index: journal.Index
    pre_rejected: dict
    counts: dict = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)
    unjournaled: dict = field(default_factory=dict)  # this job's engine errors, by key


async def run(args, gen: dict, tok_cfg: dict, meta: dict, t0: float | None = None) -> int:
    """`t0`: the process's start on the monotonic clock (timing counts imports too)."""
    from tokenmill.generate import conversations

    if conversations.is_conversation_shard(args.tokenized):  # context: regenerated
        return await conversations.run(args, gen, tok_cfg, meta, t0)
    t_run = time.monotonic()
    fingerprint = keys.generation_fingerprint(gen)
    managed = gen.get("mode", "managed") == "managed"
    api = engines.for_config(gen)  # the engine-specific part: requests, answers, identity
    # The engine's sampling keys are checked before the first request is paid for.
    engines.validate(gen)
    _api_key(gen)  # an unset key variable fails here, before any work
    shard = Shard(args.tokenized, fingerprint, gen.get("seed_policy", "none"))

    # Prompts that no engine could answer are refused here rather than paid for.
    pre_rejected = {i: ("empty_prompt", "prompt_ids is empty") for i in range(len(shard))
                    if shard.lengths[i] == 0}  # fmt: skip
    wanted = {shard.keys[i] for i in range(len(shard)) if i not in pre_rejected}
    # The journal is sharded like the tokenized shards; a changed shard count moves records
    # once, here, in the first job that sees it.
    migration = None
    if shard.num_shards is not None:
        migration = journal.ensure_layout(args.journal_dir, args.category, shard.num_shards)
    sj = journal.ShardJournal(args.journal_dir, args.category, args.shard)
    index = sj.open(wanted)
    clock = {"t0": t_run if t0 is None else t0, "run": t_run}
    job = Job(args, gen, tok_cfg, meta, clock, shard, sj, index, pre_rejected)
    try:
        from_stale = sj.search_stale(index, wanted - index.entries.keys())
        missing = _missing_items(job, api)
        clock["replayed"] = time.monotonic()
        jstats = index.stats()
        log.info(
            "shard %s/%s: %d prompts, %d unique samples, %d journaled (%d files of this shard, "
            "%d torn lines, %d from the stale file), replay %.2f s",
            args.category, args.shard, len(shard), len(wanted), len(index.entries),
            jstats["files"], jstats["torn"], from_stale, clock["replayed"] - t_run,
        )  # fmt: skip
        job.counts.update(
            prompts=len(shard),
            unique_samples=len(wanted),
            from_journal=len(index.entries),
            to_generate=len(missing),
        )
        meta.update(
            generation_fingerprint=fingerprint,
            category=args.category,
            shard=args.shard,
            mode="managed" if managed else "external",
            engine=api.name,
            engine_started=False,
            counts=job.counts,
            journal={
                "dir": str(args.journal_dir),
                "files_read": jstats["files_read"],
                "bytes_read": jstats["bytes_read"],
                "lines_read": jstats["lines"],
                "torn_lines": jstats["torn"],
                "from_stale": from_stale,
                "migration": migration,
            },
        )
        if missing:
            await _generate(job, missing, api, managed)
        _write(job, fingerprint)
    finally:
        index.close()
    return 0


def _missing_items(job: Job, api) -> list[Item]:
    """One item per sample the journal does not hold (duplicate prompts share one), and per
    journaled refusal to ask again (journal.Index.ask_again)."""
    again = job.index.ask_again(job.index.entries, api.prompt_at_fault)
    missing, seen = [], set()
    for i, k in enumerate(job.shard.keys):
        if i in job.pre_rejected or k in seen or job.index.done(k, again):
            continue
        seen.add(k)
        missing.append(job.shard.item(i))
    return missing


def check_vocab(shard: Shard, gen: dict, basedir: str, meta: dict) -> None:
    """Refuse to send a prompt id the model cannot embed: SGLang's scheduler dies on one (a
    tokenizer/model mismatch), and a managed engine would crash-loop through its restarts."""
    vocab, source = model_vocab_size(gen.get("model"), basedir, gen.get("revision"))
    meta["vocab_check"] = {"vocab_size": vocab, "source": source}
    if vocab is None:
        log.warning("prompt ids not range-checked before generation: %s", source)
        return
    rows: list[int] = []
    first_bad = None
    for g in range(shard.pf.num_row_groups):  # a row group at a time, like the rest of the job
        values, offsets = _list_arrays(shard.pf.read_row_group(g, columns=["prompt_ids"])[0])
        bad = np.flatnonzero((values >= vocab) | (values < 0))
        if len(bad):
            first_bad = int(values[bad[0]]) if first_bad is None else first_bad
            local = np.unique(np.searchsorted(offsets, bad, side="right") - 1)
            rows += (local + int(shard._starts[g])).tolist()
    if rows:
        ids = [shard.prompt_id[r] for r in rows[:5]]
        raise ValueError(
            f"{len(rows)} prompts hold token ids outside the model's vocabulary [0, {vocab}) "
            f"({source}), e.g. id {first_bad} in prompt {ids[0]} (prompts "
            f"{', '.join(ids)}): the tokenizer does not belong to generation.model "
            f"{gen.get('model')!r}. Nothing was sent (such an id kills SGLang's scheduler)"
        )


async def _generate(job: Job, missing: list[Item], api, managed: bool,
                    frontier=None, follow=None) -> None:  # fmt: skip
    """Start (or reach) the engine and generate the missing samples into the journal.
    Conversations (generate/conversations.py): `follow(record)` gives the items an answer makes
    possible, `frontier()` the items still to send after an engine restart."""
    args, gen, meta, clock, stats = job.args, job.gen, job.meta, job.clock, job.stats
    launch = gen.get("launch") or {}
    api_key = _api_key(gen)
    secrets = [api_key] if api_key else []
    stop_ids, meta["stop_token_ids_from"] = resolve_stop_ids(
        gen, job.tok_cfg, args.basedir, job.shard.metadata
    )
    check_vocab(job.shard, gen, args.basedir, meta)
    opts = ClientOptions.from_config(gen, stop_ids, api_key)
    ok_before = sum(1 for k in job.index.entries if job.index.ok(k))
    guard = RejectionGuard(opts.reject_max_fraction, opts.reject_min_count, ok_before)
    engine = (
        ManagedEngine(gen, args.log_dir, args.basedir, api_key, api=api)
        if managed
        else ExternalEngines(gen, api_key, api=api, basedir=args.basedir)
    )
    writer, append = job.sj.writer(job.index)
    meta["journal"]["file"] = str(writer.path)
    # Rejections are journaled (as final) only once the shard passed the rejection guard;
    # engine errors never are: a later run of the shard tries those prompts again.
    held: list[dict] = []
    answered: set[str] = set()

    def on_record(rec: dict) -> None:
        if rec["status"] == OK:
            append(rec)  # journaled and indexed; the record itself is not kept
            job.unjournaled.pop(rec["key"], None)
        elif rec["status"] == REJECTED:
            held.append(rec)
        else:
            job.unjournaled[rec["key"]] = rec
        answered.add(rec["key"])
        clock["last_answer"] = time.monotonic()

    restarts = 0
    try:
        meta["engine_started"] = True
        t_engine = time.monotonic()
        await engine.start()
        clock["engine_start_s"] = time.monotonic() - t_engine
        _record_engine(meta, engine, secrets)
        if not managed:
            sti = any(api.server_skips_tokenizer(si) for si in engine.server_info.values())
            api.validate_sampling(gen.get("sampling") or {}, sti)
        urls = [engine.url] if managed else engine.urls
        while True:
            if frontier is not None:
                todo = frontier()
            else:
                todo = [it for it in missing if it.key not in answered]
            if not todo:
                break
            alive = engine.alive if managed else None
            client = Client(
                urls, opts, on_record, alive, stats, api=api, guard=guard, follow=follow
            )
            if "first_request" not in clock:
                # The generation window opens now: progress lines' rates count from here.
                clock["first_request"] = stats.started = time.monotonic()
            try:
                await client.run(todo)
            except FailFast as exc:
                raise GenerationFailed(
                    f"{exc}\nlast lines of the engine log:\n{engine.log_tail()}"
                ) from None
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
        for rec in held:
            append(rec)
    finally:
        writer.close()  # the journal first: it holds what was paid for
        engine.stop()
        job.counts.update(
            requested=stats.requested, retries=stats.retries, restarts=restarts,
            generated=stats.done, engine_rejected=stats.rejected, engine_errors=stats.errors,
        )  # fmt: skip


def _write(job: Job, fingerprint: str) -> None:
    """Write the shard from the journal, then compact the shard's journal files."""
    args, shard, index, meta, counts = job.args, job.shard, job.index, job.meta, job.counts
    t_write = time.monotonic()
    kept = sum(
        1
        for i, k in enumerate(shard.keys)
        if i not in job.pre_rejected and index.has(k) and index.ok(k)
    )
    rejected = len(shard) - kept
    file_meta = {
        contracts.META_GENERATION_FINGERPRINT: fingerprint,
        contracts.META_CATEGORY: args.category,
        contracts.META_SHARD: args.shard,
        "tokenmill.records_in": str(len(shard)),
        "tokenmill.kept": str(kept),
        "tokenmill.rejected": str(rejected),
    }
    compaction = None
    if job.sj.needs_compaction(index):
        compaction = journal.Compaction(job.sj, index, args.category)
    gen_w = contracts.ParquetWriter(args.out, contracts.GENERATED, "generate", file_meta)
    rej_w = contracts.ParquetWriter(args.rejected, contracts.REJECTED, "generate", file_meta)
    try:
        with gen_w, rej_w:
            out_tokens = write_outputs(
                shard,
                index,
                job.pre_rejected,
                args.category,
                gen_w,
                rej_w,
                compaction,
                job.unjournaled,
            )
            # every prompt exactly once, in one of the two files
            if (gen_w.rows, rej_w.rows) != (kept, rejected):
                raise RuntimeError(
                    f"count mismatch: {len(shard)} in, {gen_w.rows} kept, {rej_w.rows} rejected"
                )
    except BaseException:
        if compaction is not None:
            compaction.abort()
        raise
    meta["journal"]["compaction"] = commit_compaction(compaction, shard.num_shards)
    counts.update(kept=kept, rejected=rejected, output_tokens=out_tokens)
    counts.setdefault("requested", 0)
    counts.setdefault("restarts", 0)
    counts.setdefault("retries", 0)
    meta["timing"] = timing = _timing(job.clock, t_write, time.monotonic())
    meta["wall_time_s"] = timing["total_s"]
    gen_s = timing["generation_s"]
    meta["rates"] = {
        "requests_per_s": round(job.stats.done / gen_s, 3) if gen_s else None,
        "output_tokens_per_s": round(job.stats.output_tokens / gen_s, 1) if gen_s else None,
    }
    log.info("shard %s/%s done: %s", args.category, args.shard, json.dumps(counts, sort_keys=True))
    log.info("timing: %s", json.dumps(timing, sort_keys=True))


def commit_compaction(compaction: journal.Compaction | None, num_shards) -> dict | None:
    """Swap the compacted journal in once the output is written; what meta["journal"]
    ["compaction"] records (None: nothing to compact)."""
    if compaction is None:
        return None
    try:
        return compaction.commit(num_shards)
    except (OSError, journal.JournalError) as exc:
        # The output is written and the journal still holds every record (the old files or a
        # superset of them): the next run compacts again.
        compaction.abort()
        log.warning("journal compaction failed, the journal is left as it was: %s", exc)
        return {"error": str(exc)}


def _timing(clock: dict, t_write: float, t_end: float) -> dict:
    """Start-up (process start to the first request), the generation window (first request to
    last answer), writing (output + journal compaction) and the total, in seconds."""
    first = clock.get("first_request")
    last = clock.get("last_answer", first)
    startup_end = first if first is not None else clock["replayed"]
    return {
        "startup_s": round(startup_end - clock["t0"], 3),
        "generation_s": round(last - first, 3) if first is not None else 0.0,
        "write_s": round(t_end - t_write, 3),
        "total_s": round(t_end - clock["t0"], 3),
        "imports_s": round(clock["run"] - clock["t0"], 3),
        "replay_s": round(clock["replayed"] - clock["run"], 3),
        "engine_start_s": round(clock["engine_start_s"], 3) if "engine_start_s" in clock else None,
    }


def _record_engine(meta: dict, engine, secrets: list[str]) -> None:
    meta["server_info"] = redact(engine.server_info, secrets)
    meta["model_info"] = redact(engine.model_info, secrets)
    meta["model_check"] = engine.model_check
    # False: the server ignores sampling_seed (generation.allow_ignored_seeds let it run).
    meta["seeds_honoured"] = engine.notes.get("seeds_honoured")
    if isinstance(engine, ManagedEngine):
        meta["engine_argv"] = engine.redacted_argv()
        meta["engine_url"] = engine.url
        meta["engine_starts"] = engine.starts
    else:
        meta["engine_urls"] = redact(engine.urls, secrets)


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
            rc = asyncio.run(_main_async(args, gen, tok_cfg, meta, t0))
    except (GenerationFailed, EngineError, ValueError, OSError, ShardLocked) as exc:
        log.error("generate failed: %s", exc)
        return 1
    if rc == 0:
        meta["end_time"] = datetime.now(UTC).isoformat(timespec="seconds")
        secrets = [k for k in [os.environ.get(gen.get("api_key_env") or "")] if k]
        _write_json_atomic(args.meta, redact(meta, secrets))
    return rc
