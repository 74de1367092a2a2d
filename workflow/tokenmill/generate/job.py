"""The core of one generate job: what a prompt shard (generate/prompts.py) and a conversation
shard (generate/conversations.py) do alike.

    job = open_job(args, gen, tok_cfg, meta, t0, wanted)   # keys, journal layout, index
    ...the runner finds what is missing (its own rule)...
    await generate(job, missing, ...)                    # engine: start, client loop, restarts
    ...the runner writes its rows through OutputFrame...  # file metadata, in = kept + rejected
    meta["journal"]["compaction"] = commit_compaction(...)
    finish_timing(job, t_write)                           # meta timing

What lives here, and only here:
- `Shard`: the tokenized shard's prompts, lengths and sample keys, read a row group at a time;
- `open_job`: the journal's layout (a one-time migration when the shard count changed) and the
  index of this shard's journal files;
- `generate`: start (or reach) the engine, send the missing samples, journal each answer as it
  comes, restart a dead engine up to launch.max_restarts times, hold refusals until the shard
  passed the rejection guard (engine errors are never journaled: the next run asks again);
- `engine_meta`, `common_meta`, `timing`, `job_record`: what the job's record says about the
  engine and where its time went (contracts.GenerateJobRecord; what the job held and its
  attempts come from the harness, jobs/harness.py);
- `OutputFrame`: the output files' metadata and the count check (every record in, once, in the
  generated or the rejected file);
- `commit_compaction`: swap a shard's compacted journal file in once the output is written.

Timing (the record's `timing`): startup_s is process start to the first request (imports, keys,
journal replay, engine start), generation_s the first request to the last answer (the window the
rates and progress lines use), write_s the output and journal compaction, total_s all of it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from tokenmill import contracts, engines, keys, layout, prefix_reuse
from tokenmill.engines.launch import ExternalEngines, ManagedEngine
from tokenmill.generate import failure, journal
from tokenmill.generate.client import (
    OK,
    REJECTED,
    Client,
    ClientOptions,
    EngineDied,
    FailFast,
    GenerationFailed,
    Item,
    RejectionGuard,
    Stats,
    plural,
)
from tokenmill.model import model_vocab_size
from tokenmill.redaction import redact
from tokenmill.settings import (
    GenerationSettings,
    TokenizerSettings,
    thaw,
)
from tokenmill.tokenization import shards

log = logging.getLogger("tokenmill.generate")

# Prompts whose journal records are read (and decoded) at once while the output is written.
FETCH_ROWS = 256
# Row groups of the tokenized shard kept decoded for building requests (they are asked for in
# shard order, so one or two are in use at a time; a retry may reach back a little).
PROMPT_ROW_GROUPS_CACHED = 4


# ------------------------------------------------------------------------------ settings


def api_key(gen: GenerationSettings) -> str | None:
    """The API key from generation.api_key_env (None without one); an unset variable fails."""
    name = gen.api_key_env
    if not name:
        return None
    value = os.environ.get(name)
    if not value:
        raise ValueError(f"generation.api_key_env: environment variable {name} is not set")
    return value


def resolve_stop_ids(
    gen: GenerationSettings, tok_cfg: TokenizerSettings, basedir: str, shard_meta: dict
):
    """(stop token ids, where they came from). Strings were resolved by `tokenmill tokenize`
    into the tokenized shard's metadata; only a shard written without them (or for other stop
    tokens) makes this load the tokenizer, which imports transformers."""
    tokens = list(gen.stop_tokens)
    if all(isinstance(t, int) for t in tokens):
        return tokens, "config"
    stored = shard_meta.get(contracts.META_STOP_TOKENS)
    if stored is not None and json.loads(stored) == tokens:
        return json.loads(shard_meta[contracts.META_STOP_TOKEN_IDS]), "tokenized shard metadata"
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


# --------------------------------------------------------------------------------- shard


class Shard:
    """The shard's prompts, their lengths and sample keys, read one row group at a time.

    The prompt ids themselves are not kept: `ids(i)` reads them again from the file (a few
    decoded row groups cached), so memory follows a row group whatever the shard's size.
    """

    def __init__(self, path: str, fingerprint: str, seed_policy: str):
        # Not memory-mapped: mapped pages of the file would count in the job's RSS.
        self.pf = pq.ParquetFile(path, memory_map=False)
        self.metadata = contracts.read_metadata(path)
        n = self.metadata.get(contracts.META_NUM_SHARDS)
        self.num_shards = int(n) if n else None
        self.prompt_id: list[str] = []
        self.keys: list[str] = []
        lengths, sizes = [], []
        for g in range(self.pf.num_row_groups):
            t = self.pf.read_row_group(g, columns=["prompt_id", "prompt_ids"])
            self.prompt_id += t.column("prompt_id").to_pylist()
            values, offsets = contracts.list_arrays(t.column("prompt_ids"))
            lengths.append(np.diff(offsets))
            sizes.append(t.num_rows)
            self.keys += keys.sample_keys(fingerprint, (values, offsets))
        self.lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self._groups: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self.seed_policy = seed_policy

    def __len__(self):
        return len(self.prompt_id)

    def ids(self, i: int) -> np.ndarray:
        g = int(np.searchsorted(self.starts, i, side="right")) - 1
        if g not in self._groups:
            col = self.pf.read_row_group(g, columns=["prompt_ids"]).column(0)
            self._groups[g] = contracts.list_arrays(col)
            if len(self._groups) > PROMPT_ROW_GROUPS_CACHED:
                self._groups.popitem(last=False)
        self._groups.move_to_end(g)
        values, offsets = self._groups[g]
        r = i - int(self.starts[g])
        return values[offsets[r] : offsets[r + 1]]

    def item(self, i: int) -> Item:
        key = self.keys[i]
        seed = keys.sampling_seed(key) if self.seed_policy == "per_sample" else None
        return ShardItem(self, i, key, seed)


class ShardItem(Item):
    """An Item whose prompt ids are read from the tokenized shard when a request is built, so
    that the queue of missing samples holds no token lists."""

    def __init__(self, shard: Shard, i: int, key: str, seed: int | None):
        self.prompt_id, self.key, self.seed = shard.prompt_id[i], key, seed
        self._shard, self._i = shard, i

    @property
    def prompt_ids(self) -> list[int]:
        return self._shard.ids(self._i).tolist()

    def ids(self) -> np.ndarray:
        return self._shard.ids(self._i)

    def window(self) -> int:
        """The cached row groups this prompt is read with: a job orders its queue within each
        such window, so building a request never decodes a row group again."""
        g = int(np.searchsorted(self._shard.starts, self._i, side="right")) - 1
        return g // PROMPT_ROW_GROUPS_CACHED


def check_vocab(shard: Shard, gen: GenerationSettings, basedir: str, meta: dict) -> None:
    """Refuse to send a prompt id the model cannot embed: SGLang's scheduler dies on one (a
    tokenizer/model mismatch), and a managed engine would crash-loop through its restarts."""
    vocab, source = model_vocab_size(gen.model, basedir, gen.revision)
    meta["vocab_check"] = {"vocab_size": vocab, "source": source}
    if vocab is None:
        log.warning("prompt ids not range-checked before generation: %s", source)
        return
    rows: list[int] = []
    first_bad = None
    for g in range(shard.pf.num_row_groups):  # a row group at a time, like the rest of the job
        col = shard.pf.read_row_group(g, columns=["prompt_ids"])[0]
        values, offsets = contracts.list_arrays(col)
        bad = np.flatnonzero((values >= vocab) | (values < 0))
        if len(bad):
            first_bad = int(values[bad[0]]) if first_bad is None else first_bad
            local = np.unique(np.searchsorted(offsets, bad, side="right") - 1)
            rows += (local + int(shard.starts[g])).tolist()
    if rows:
        ids = [shard.prompt_id[r] for r in rows[:5]]
        hold = "holds" if len(rows) == 1 else "hold"
        raise ValueError(
            f"{plural(len(rows), 'prompt')} {hold} token ids outside the model's vocabulary "
            f"[0, {vocab}) ({source}), e.g. id {first_bad} in prompt {ids[0]} (prompts "
            f"{', '.join(ids)}): the tokenizer does not belong to generation.model "
            f"{gen.model!r}. Nothing was sent (such an id kills SGLang's scheduler)"
        )


# ----------------------------------------------------------------------------------- job


@dataclass
class Job:
    """What the steps of one generate job share."""

    args: object  # the command's arguments (category, shard, paths)
    gen: GenerationSettings
    tok_cfg: TokenizerSettings
    meta: dict
    clock: dict  # monotonic times: t0 (process start), run, replayed, first_request, ...
    fingerprint: str
    api: engines.EngineAPI
    shard: Shard
    sj: journal.ShardJournal
    index: journal.Index
    migration: dict | None = None  # what ensure_layout moved (None: nothing)
    pre_rejected: dict = field(default_factory=dict)  # row -> (reason, detail), never sent
    counts: dict = field(default_factory=dict)
    stats: Stats = field(default_factory=Stats)
    unjournaled: dict = field(default_factory=dict)  # this job's engine errors, by key


def job_layout(args) -> layout.Layout:
    """The run's layout as the generate command sees it: results/ above its output
    (results/generated/{category}/{shard}.parquet) and the journal folder it is given."""
    return layout.Layout(str(Path(args.out).parent.parent.parent), args.journal_dir)


def open_job(args, gen: GenerationSettings, tok_cfg: TokenizerSettings, meta: dict,
             t0: float | None, wanted, pre_reject=None) -> Job:  # fmt: skip
    """Check the settings a request needs, read the shard's keys, bring the journal to the
    shard count (a changed count moves records once, here, in the first job that sees it) and
    index this shard's journal files. `wanted(shard, pre_rejected)`: the keys to index (None:
    every record of the shard's files); `pre_reject(shard)`: {row: (reason, detail)} of prompts
    refused before any engine sees them. The caller closes job.index."""
    t_run = time.monotonic()
    fingerprint = keys.generation_fingerprint(gen)
    api = engines.for_config(gen)  # the engine-specific part: requests, answers, identity
    # The engine's sampling keys are checked before the first request is paid for.
    engines.validate(gen)
    api_key(gen)  # an unset key variable fails here, before any work
    shard = Shard(args.tokenized, fingerprint, gen.seed_policy)
    pre_rejected = pre_reject(shard) if pre_reject is not None else {}
    want = wanted(shard, pre_rejected)
    migration = None
    if shard.num_shards is not None:
        # shard_by: prefix: the siblings' prompt ids are read only if the journal must move
        # (the tokenize checkpoint wrote every shard of the category)
        assignment = shards.assignment_of(args.tokenized, shard.metadata, shard.num_shards)
        migration = journal.ensure_layout(
            args.journal_dir, args.category, shard.num_shards, assignment
        )
    sj = journal.ShardJournal(args.journal_dir, args.category, args.shard)
    index = sj.open(want)
    material = redact(keys.generation_material(gen))
    change = fingerprint_change(sj, fingerprint, material, index)
    if change is not None:
        log.warning("%s", change_message(change))
        meta["fingerprint_change"] = change
    if change is not None or sj.read_generation() is None:
        sj.write_generation(fingerprint, material)
    clock = {"t0": t_run if t0 is None else t0, "run": t_run}
    return Job(args, gen, tok_cfg, meta, clock, fingerprint, api, shard, sj, index, migration,
               pre_rejected)  # fmt: skip


def fingerprint_change(sj: journal.ShardJournal, fingerprint: str, material: dict,
                       index: journal.Index | None = None, wanted=None) -> dict | None:  # fmt: skip
    """What changed since the shard's last job, when it ran with another generation
    fingerprint: {"shard", "changes": ["generation.X: old -> new", ...], "records": N,
    "upper_bound"}. N: the shard's journaled records whose key the shard no longer asks for
    (its compacted and JSONL files, as `index` read them or as `wanted` selects); a
    conversation shard (every key wanted) counts all of them, an upper bound. None: no
    change, or no fingerprint recorded (a journal older than the record)."""
    prev = sj.read_generation()
    if prev is None or prev.get("fingerprint") == fingerprint:
        return None
    own = index is None
    if own:
        index = sj.open(wanted)
    try:
        bound = index.wanted is None
        n = index.lines if bound else index.unwanted
    finally:
        if own:
            index.close()
    changes = keys.material_changes(prev.get("material") or {}, material)
    return {"shard": sj.shard, "changes": changes, "records": n, "upper_bound": bound}


def change_message(change: dict) -> str:
    what = "; ".join(change["changes"]) or "settings not recorded"
    n = change["records"]
    bound = "up to " if change["upper_bound"] else ""
    return (
        f"generation fingerprint changed ({what}): {bound}{n} journaled "
        f"sample{'' if n == 1 else 's'} of shard {change['shard']} no longer match"
    )


def common_meta(job: Job) -> dict:
    """The meta keys every generate job writes before it starts an engine."""
    return dict(
        generation_fingerprint=job.fingerprint,
        category=job.args.category,
        shard=job.args.shard,
        mode=job.gen.mode,
        engine=job.api.name,
        engine_started=False,
        counts=job.counts,
    )


async def generate(job: Job, missing: list[Item], frontier=None, follow=None) -> None:
    """Start (or reach) the engine and generate the missing samples into the journal.
    Conversations (generate/conversations.py): `follow(record)` gives the items an answer makes
    possible, `frontier()` the items still to send after an engine restart."""
    args, gen, meta, clock, stats, api = job.args, job.gen, job.meta, job.clock, job.stats, job.api
    managed = gen.managed
    # Prompts that share a prefix go back to back, while the engine's cache holds it; the
    # output is written in prompt_id order whatever the order they were answered in.
    missing = prefix_reuse.dispatch_order(missing, window=lambda it: it.window())
    key = api_key(gen)
    secrets = [key] if key else []
    stop_ids, meta["stop_token_ids_from"] = resolve_stop_ids(
        gen, job.tok_cfg, args.basedir, job.shard.metadata
    )
    check_vocab(job.shard, gen, args.basedir, meta)
    opts = ClientOptions.from_config(gen, stop_ids, key)
    # Another shard's fail-fast (a failure every shard shares) stops this job's requests too.
    run_stop = failure.RunStop(
        job_layout(args).run_failure_record("generate"), failure.run_identity(gen),
        (args.category, args.shard),
    )  # fmt: skip
    ok_before = sum(1 for k in job.index.entries if job.index.ok(k))
    guard = RejectionGuard(opts.reject_max_fraction, opts.reject_min_count, ok_before)
    engine = (
        ManagedEngine(gen, args.log_dir, args.basedir, key, api=api)
        if managed
        else ExternalEngines(gen, key, api=api, basedir=args.basedir)
    )
    writer, append = job.sj.writer(job.index)
    meta["journal"]["file"] = str(writer.path)
    # Rejections are journaled (as final) only once the shard passed the rejection guard: a
    # tripped shard is a deterministic failure (its retries with this config are refused before
    # an engine starts, so nothing is sent twice), and the corrected config or server, or the
    # user deleting its failure.json, asks for them again. Engine errors are never journaled: a
    # later run of the shard tries those prompts again.
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
        engine_meta(meta, engine, secrets)
        if not managed:
            sti = any(api.server_skips_tokenizer(si) for si in engine.server_info.values())
            api.validate_sampling(thaw(gen.sampling), sti)
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
                urls, opts, on_record, alive, stats, api=api, guard=guard, follow=follow,
                stop_check=run_stop,
            )  # fmt: skip
            if "first_request" not in clock:
                # The generation window opens now: progress lines' rates count from here.
                clock["first_request"] = stats.started = time.monotonic()
            try:
                await client.run(todo)
            except FailFast as exc:  # still a FailFast: the command records it (failure.py)
                raise FailFast(
                    f"{exc}\nlast lines of the engine log:\n{engine.log_tail()}"
                ) from None
            except EngineDied as exc:
                if restarts >= gen.launch.max_restarts:
                    raise GenerationFailed(
                        f"engine died {restarts + 1} times (launch.max_restarts={restarts}); "
                        f"last: {exc}; engine log tail:\n{engine.log_tail()}"
                    ) from None
                restarts += 1
                log.warning("engine died (%s); restart %d", exc, restarts)
                engine.stop()
                await engine.start()
                engine_meta(meta, engine, secrets)
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


def engine_meta(meta: dict, engine, secrets: list[str]) -> None:
    """What the job's meta says about the engine it reached (secrets redacted)."""
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


# -------------------------------------------------------------------------------- output


class OutputFrame:
    """The frame of a shard's two output files: their metadata and the count check.

    `n_in` records came in (prompts, or conversations); `kept` of them are in the generated
    file (a conversation with several turns is one record there), `rejected` in the rejected
    file; in = kept + rejected (contracts.check_conservation) before the files count as
    written. `extra`: metadata keys of the variant (e.g. the context), placed before the counts
    as the files always had them."""

    def __init__(self, job: Job, n_in: int, extra: dict | None = None, counts: bool = True):
        self.job, self.n_in = job, n_in
        self.metadata = {
            contracts.META_GENERATION_FINGERPRINT: job.fingerprint,
            contracts.META_CATEGORY: job.args.category,
            contracts.META_SHARD: job.args.shard,
            **(extra or {}),
            contracts.META_RECORDS_IN: str(n_in),
        }
        self._counts = counts

    def expect(self, kept: int, rejected: int) -> None:
        """Record the counts the files will hold (plain shards write them into the metadata)."""
        contracts.check_conservation("generate", self.n_in, kept, rejected)
        if self._counts:
            self.metadata[contracts.META_KEPT] = str(kept)
            self.metadata[contracts.META_REJECTED] = str(rejected)

    def check(self, kept: int, rejected: int) -> None:
        """Every record exactly once, in one of the two files."""
        contracts.check_conservation("generate", self.n_in, kept, rejected)


def rejected_row(job: Job, reason: str, detail, prompt_id: str, record: dict) -> dict:
    """A generate rejected row (contracts.rejected_row) of this job's category."""
    return contracts.rejected_row(
        "generate", job.args.category, reason, detail=detail, prompt_id=prompt_id, record=record
    )


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


# ------------------------------------------------------------------------ timing and cost


def timing(clock: dict, t_write: float, t_end: float) -> dict:
    """Start-up (process start to the first request), the generation window (first request to
    last answer), writing (output + journal compaction) and the total, in seconds."""
    first = clock.get("first_request")
    last = clock.get("last_answer", first)
    startup_end = first if first is not None else clock["replayed"]
    t = {
        "startup_s": round(startup_end - clock["t0"], 3),
        "generation_s": round(last - first, 3) if first is not None else 0.0,
        "write_s": round(t_end - t_write, 3),
        "total_s": round(t_end - clock["t0"], 3),
        "imports_s": round(clock["run"] - clock["t0"], 3),
        "replay_s": round(clock["replayed"] - clock["run"], 3),
        "engine_start_s": round(clock["engine_start_s"], 3) if "engine_start_s" in clock else None,
    }
    if "tokenizer_s" in clock:  # a conversation shard's tokenizer, loaded in the start-up
        t["tokenizer_s"] = round(clock["tokenizer_s"], 3)
    return t


def finish_timing(job: Job, t_write: float) -> dict:
    """meta timing, now; returns it."""
    job.meta["timing"] = t = timing(job.clock, t_write, time.monotonic())
    return t


def job_record(meta: dict, held: contracts.Held, attempts) -> contracts.GenerateJobRecord:
    """The job's record (contracts.GenerateJobRecord) from what the runner put in `meta`, what
    it held and every attempt since the shard's last record: checked key by key (a key the
    record does not know, or a missing one, fails the job instead of writing a record no reader
    can read)."""
    body = {
        **meta,
        "schema": contracts.GenerateJobRecord.SCHEMA,
        "held": held.to_json(),
        "attempts": [a.to_json() for a in attempts],
        "context": meta.get("context"),
        "rates": meta.get("rates"),
    }
    return contracts.GenerateJobRecord.from_json(body, "the generate job's record")


def engine_version(server_info, managed: bool):
    """The version the engine reported in server_info (external: per URL; one value when they
    agree), None where it reports none or was never reached."""
    if not server_info:
        return None
    infos = [server_info] if managed else list(server_info.values())
    versions = sorted({str(si["version"]) for si in infos if isinstance(si, dict) and
                       si.get("version") is not None})  # fmt: skip
    if not versions:
        return None
    return versions[0] if len(versions) == 1 else versions
