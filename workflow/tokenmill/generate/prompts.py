"""The prompt runner: one tokenized shard of single prompts -> generated shard (+ rejected rows).

Order of work (the job's steps are generate/job.py's): keys for every prompt -> the journal's
layout -> index this shard's journal files only -> if nothing is missing, write the shard
without starting any engine -> else start (or reach) the engine, send only the missing samples
(duplicate prompts share one) and the journaled refusals to ask again -> stream the shard from
the journal in row groups (prompt_id order) while writing the shard's compacted journal file ->
swap the compacted file in.

Memory follows a row group, not the shard: prompt ids are read from the tokenized shard when a
request is built, answers go to the journal (only their place in it stays in memory), and the
output is written from the journal job.FETCH_ROWS records at a time.
"""

from __future__ import annotations

import json
import logging
import time

import pyarrow as pa
import pyarrow.compute as pc

from tokenmill import contracts
from tokenmill.generate import journal
from tokenmill.generate.client import REASONS, REJECTED, Item, plural
from tokenmill.generate.job import (
    FETCH_ROWS,
    Job,
    OutputFrame,
    Shard,
    commit_compaction,
    common_meta,
    finish_timing,
    generate,
    open_job,
    rejected_row,
)
from tokenmill.settings import GenerationSettings, TokenizerSettings

log = logging.getLogger("tokenmill.generate")


def pre_reject(shard: Shard) -> dict:
    """Prompts that no engine could answer are refused here rather than paid for."""
    return {i: ("empty_prompt", "prompt_ids is empty") for i in range(len(shard))
            if shard.lengths[i] == 0}  # fmt: skip


def wanted(shard: Shard, pre_rejected: dict) -> set[str]:
    return {shard.keys[i] for i in range(len(shard)) if i not in pre_rejected}


async def run(
    args, gen: GenerationSettings, tok_cfg: TokenizerSettings, meta: dict, t0: float | None = None
) -> int:
    """`tokenmill generate` for a shard of single prompts. `t0`: the process's start on the
    monotonic clock (timing counts imports too)."""
    job = open_job(args, gen, tok_cfg, meta, t0, wanted, pre_reject)
    shard, index, sj = job.shard, job.index, job.sj
    want = wanted(shard, job.pre_rejected)
    try:
        from_stale = sj.search_stale(index, want - index.entries.keys())
        missing = missing_items(job)
        job.clock["replayed"] = time.monotonic()
        jstats = index.stats()
        log.info(
            "shard %s/%s: %s, %s, %d journaled (%d files of this shard, "
            "%d torn lines, %d from the stale file), replay %.2f s",
            args.category, args.shard, plural(len(shard), "prompt"),
            plural(len(want), "unique sample"), len(index.entries),
            jstats["files"], jstats["torn"], from_stale, job.clock["replayed"] - job.clock["run"],
        )  # fmt: skip
        job.counts.update(
            prompts=len(shard),
            unique_samples=len(want),
            from_journal=len(index.entries),
            to_generate=len(missing),
        )
        meta.update(
            common_meta(job),
            journal={
                "dir": str(args.journal_dir),
                "files_read": jstats["files_read"],
                "bytes_read": jstats["bytes_read"],
                "lines_read": jstats["lines"],
                "torn_lines": jstats["torn"],
                "from_stale": from_stale,
                "migration": job.migration,
            },
        )
        if missing:
            await generate(job, missing)
        write(job)
    finally:
        index.close()
    return 0


def missing_items(job: Job) -> list[Item]:
    """One item per sample the journal does not hold (duplicate prompts share one), and per
    journaled refusal to ask again (journal.Index.ask_again)."""
    again = job.index.ask_again(job.index.entries, job.api.prompt_at_fault)
    missing, seen = [], set()
    for i, k in enumerate(job.shard.keys):
        if i in job.pre_rejected or k in seen or job.index.done(k, again):
            continue
        seen.add(k)
        missing.append(job.shard.item(i))
    return missing


def write(job: Job) -> None:
    """Write the shard from the journal, then compact the shard's journal files."""
    args, shard, index, meta, counts = job.args, job.shard, job.index, job.meta, job.counts
    t_write = time.monotonic()
    kept = sum(
        1
        for i, k in enumerate(shard.keys)
        if i not in job.pre_rejected and index.has(k) and index.ok(k)
    )
    rejected = len(shard) - kept
    frame = OutputFrame(job, len(shard))
    frame.expect(kept, rejected)
    compaction = None
    if job.sj.needs_compaction(index):
        compaction = journal.Compaction(job.sj, index, args.category)
    gen_w = contracts.ParquetWriter(args.out, contracts.GENERATED, "generate", frame.metadata)
    rej_w = contracts.ParquetWriter(args.rejected, contracts.REJECTED, "generate", frame.metadata)
    try:
        with gen_w, rej_w:
            out_tokens = write_outputs(job, gen_w, rej_w, compaction)
            if gen_w.rows != kept:
                raise RuntimeError(
                    f"count mismatch: {len(shard)} in, {gen_w.rows} kept, {rej_w.rows} rejected"
                )
            frame.check(gen_w.rows, rej_w.rows)
    except BaseException:
        if compaction is not None:
            compaction.abort()
        raise
    meta["journal"]["compaction"] = commit_compaction(compaction, shard.num_shards)
    counts.update(kept=kept, rejected=rejected, output_tokens=out_tokens)
    counts.setdefault("requested", 0)
    counts.setdefault("restarts", 0)
    counts.setdefault("retries", 0)
    timing = finish_timing(job, t_write)
    gen_s = timing["generation_s"]
    meta["rates"] = {
        "requests_per_s": round(job.stats.done / gen_s, 3) if gen_s else None,
        "output_tokens_per_s": round(job.stats.output_tokens / gen_s, 1) if gen_s else None,
    }
    log.info("shard %s/%s done: %s", args.category, args.shard, json.dumps(counts, sort_keys=True))
    log.info("timing: %s", json.dumps(timing, sort_keys=True))


def write_outputs(job: Job, gen_w, rej_w, compaction) -> int:
    """Stream the generated and rejected rows (prompt_id order) from the journal, FETCH_ROWS
    prompts at a time, into row groups; hand each record once to the compaction. Returns the
    number of output tokens. job.unjournaled: this job's outcomes that are never journaled
    (engine errors, asked again by the next run), by key; they win over a journaled refusal."""
    shard, index, pre_rejected = job.shard, job.index, job.pre_rejected
    unjournaled = job.unjournaled
    order = sorted(range(len(shard)), key=shard.prompt_id.__getitem__)
    gen_buf = contracts.RowGroupBuffer(gen_w.write, "output_ids")
    rej_buf = contracts.RowGroupBuffer(rej_w.write, None)
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
            record = {"sample_key": key, "num_prompt_tokens": int(shard.lengths[i])}
            rej.append(rejected_row(job, reason, detail, shard.prompt_id[i], record))
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
    for buf, writer in ((gen_buf, gen_w), (rej_buf, rej_w)):
        buf.finish()
        writer.write_schema_if_empty()
    return out_tokens
