"""`tokenmill merge`: one tokenized + one generated shard -> one validated training shard.

    input_ids = prompt_ids + output_ids
    loss_mask = [0] * len(prompt_ids) + [1] * len(output_ids)   (the matched stop token included)

Output columns (contracts.DATASET, results/dataset/{category}/{shard}.parquet, sorted by
prompt_id): prompt_id, category, sample_key, input_ids list<int32>, loss_mask list<int8>,
num_prompt_tokens, num_output_tokens, num_reasoning_tokens / num_answer_tokens (output tokens
up to and including the first dataset.think_end_token / the rest; an output that never closed a
thinking block that was open is all reasoning (validate.unterminated); null when think_end_token
is null), num_total_tokens, finish_type.

Rows that fail validation (validate.py, one reason code each), duplicate and unknown generated
rows, and tokenized prompts that were neither generated nor rejected by generate
(`not_generated`) go to results/rejected/merge/{category}/{shard}.parquet. The rejected row's
`record` holds the sample's scalar fields as canonical JSON (the tokens stay in the generated
shard). Conservation, checked on every run (the command fails with the counts otherwise):

    tokenized prompts = dataset rows + distinct tokenized prompts rejected by merge
                        + prompts rejected by generate (--generate-rejected)

With `counts_out` (`--counts-out`, the `merge_shard` rule always gives it), the same pass also
counts the loss-masked tokens of the kept rows (loss_mask = 1 is exactly the output part, so
one np.bincount per batch over the output ids) and writes them in draft_vocab's counts format
to results/token_counts/{category}/{shard}.parquet, so an incremental rebuild recounts only the
shards it re-merges. With dataset.max_train_length L, only the ids in the first L positions of
each row (prompt + output) are counted: the trainers cut rows to their sequence length first.

File key-value metadata (the counts are added at close; read them with
contracts.read_metadata): tokenmill.records_in (generated rows + not_generated prompts, i.e.
everything merge accounts for), records_kept, records_rejected (in = kept + rejected),
tokenmill.not_generated, tokenmill.generate_rejected, tokenmill.tokenized_rows, and the tokenizer
and generation fingerprints carried over from the input shards.

Everything is vectorized over flattened token arrays and streamed in one pass, in batches that
end at contracts.ROW_GROUP_SIZE rows or with the row that brings them to
contracts.ROW_GROUP_TOKENS prompt + output tokens (contracts.row_group_ends; the output lengths
come from a first pass over the generated shard's output_ids, READ_ROWS rows at a time). Each
batch's kept rows are one output row group. Input row groups (token-bounded the same way by the
stages that write them) are read when a batch first needs them and dropped after the last batch
that needs them, and list columns are read without a memory map (a mapped file's pages stay in
the job's RSS): memory stays at a few bounded row groups when the inputs are sorted by prompt_id
(as every stage writes them), whatever the shard size or output length
(`benchmarks/bench_merge.py --memory 200,2000 --samples 12000`, README).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import contracts, guards, keys
from tokenmill.dataset import draft_vocab, validate
from tokenmill.dataset.validate import REASONS, Rules

BATCH_ROWS = contracts.ROW_GROUP_SIZE
READ_ROWS = 1024  # rows an input list column is decoded at a time (_RowGroupColumn._read)
# A batch's write overlaps the next batch's work (reading, validating, building) only while
# the batch is smaller than this: two batches of long outputs in memory at once would make
# memory follow output length.
OVERLAP_BYTES = 32 << 20
COUNT_VALUES = 1 << 20  # output ids per np.bincount of the token counts
# Generated turn rows of whole conversations read at a time by merge_conversation_shard.
CONVERSATION_BATCH_ROWS = READ_ROWS


ConservationError = contracts.ConservationError  # the counts of a shard do not add up


@dataclass
class MergeResult:
    tokenized: int = 0
    generated: int = 0
    kept: int = 0
    rejected: int = 0
    generate_rejected: int = 0
    not_generated: int = 0
    reasons: dict[str, int] = field(default_factory=dict)


class _RowGroupColumn:
    """One list column of a Parquet file, gathered by row index, row group by row group.

    It is given every batch's row indices up front so that each row group is released after
    the last batch that needs it.
    """

    def __init__(self, path, column: str, batches: list[np.ndarray]):
        # No memory map: every page of a mapped file read once stays in the RSS until the end.
        self.pf = pq.ParquetFile(path, memory_map=False)
        self.column = column
        sizes = [self.pf.metadata.row_group(i).num_rows for i in range(self.pf.num_row_groups)]
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.cache: dict[int, pa.Array] = {}
        self.last_use: dict[int, int] = {}
        for b, rows in enumerate(batches):
            for g in np.unique(self.group_of(rows)):
                self.last_use[int(g)] = b

    def _read(self, g: int) -> pa.Array:
        """Row group `g` of the column as one array, decoded READ_ROWS rows at a time: read
        whole, the list reader's decoding buffers (levels, values grown by doubling) took
        about four times the column's size, the largest part of merge's peak with long
        outputs."""
        parts = [
            b.column(0)
            for b in self.pf.iter_batches(
                batch_size=READ_ROWS, row_groups=[g], columns=[self.column], use_threads=False
            )
        ]
        if not parts:
            return self.pf.read_row_group(g, columns=[self.column]).column(0).combine_chunks()
        return pa.concat_arrays(parts) if len(parts) > 1 else parts[0]

    def group_of(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.starts, rows, side="right") - 1

    def take(self, rows: np.ndarray, batch_no: int) -> pa.Array:
        groups = self.group_of(rows)
        parts, order = [], []
        for g in np.unique(groups):
            g = int(g)
            if g not in self.cache:
                self.cache[g] = self._read(g)
            sel = np.flatnonzero(groups == g)
            local = rows[sel] - self.starts[g]
            # Both inputs are sorted by prompt_id, so rows are usually a contiguous run:
            # a zero-copy slice instead of a gather.
            first = int(local[0]) if len(local) else 0
            if len(local) and np.array_equal(local, np.arange(first, first + len(local))):
                parts.append(self.cache[g].slice(first, len(local)))
            else:
                parts.append(self.cache[g].take(pa.array(local)))
            order.append(sel)
        for g in [g for g, last in self.last_use.items() if last <= batch_no and g in self.cache]:
            del self.cache[g]
        if not parts:
            return pa.array([], type=self.pf.schema_arrow.field(self.column).type)
        out = pa.concat_arrays(parts) if len(parts) > 1 else parts[0]
        order = np.concatenate(order)
        if not np.array_equal(order, np.arange(len(order))):
            # rows came from row groups out of order: put them back in batch order
            out = out.take(pa.array(np.argsort(order, kind="stable")))
        return out


class _Rejects:
    """The rejected rows of one shard (contracts.rejected_row, source category/shard), for
    prompt and conversation shards alike."""

    def __init__(self, category: str, shard: str):
        self.category, self.shard = category, shard
        self.rows: list[dict] = []

    def add(self, reason: str, prompt_id, detail: str | None = None, record=None) -> None:
        self.rows.append(
            contracts.rejected_row(
                "merge",
                self.category,
                reason,
                detail,
                f"{self.category}/{self.shard}",
                prompt_id,
                record,
            )  # fmt: skip
        )

    def not_generated(self, prompt_id, record=None) -> None:
        self.add("not_generated", prompt_id, validate.describe("not_generated"), record)

    def reasons(self) -> dict[str, int]:
        return dict(sorted(collections.Counter(r["reason"] for r in self.rows).items()))

    def tokenized_prompts(self) -> set:
        """The distinct tokenized prompts (conversations) among the rejected rows."""
        return {r["prompt_id"] for r in self.rows if r["reason"] != "unknown_prompt_id"}

    def write(self, path, metadata: dict) -> None:
        contracts.write_table(
            contracts.rejected_table(self.rows), path, contracts.REJECTED, "merge", metadata
        )


def _file_meta(category: str, shard: str, extra: dict | None = None) -> dict:
    return {contracts.META_CATEGORY: category, contracts.META_SHARD: shard, **(extra or {})}


def _generate_rejected(path) -> pa.Array:
    """The prompt_ids generate rejected (results/rejected/generate/{c}/{s}.parquet)."""
    if not path or not Path(path).exists():
        return pa.array([], pa.string())
    return _read_scalar(path, ["prompt_id"]).column("prompt_id").combine_chunks().drop_null()


def _check_tokenized(what, tokenized, kept, merge_rejected, generate_rejected, generated) -> None:
    """Conservation over tokenized prompts (conversations): each is a dataset row (kept),
    rejected by merge, or rejected by generate."""
    contracts.check_conservation(
        f"{what} (in: tokenized, kept: in the dataset, rejected: "
        f"merge_rejected_prompts={merge_rejected} + generate_rejected={generate_rejected}; "
        f"generated rows={generated})",
        tokenized,
        kept,
        merge_rejected + generate_rejected,
    )


def concat_lists(p_off, p_val, o_off, o_val):
    """input_ids and loss_mask as flattened arrays: prompt then output of every row.

    The loss mask is the rows' prompt and output lengths alternately expanded to 0s and 1s
    (one np.repeat); the ids are filled through it as a boolean mask (prompt values in row
    order where it is 0, output values where it is 1): no per-value index arrays, which at
    8 bytes a value were the largest buffers of a batch of long outputs."""
    p_len, o_len = np.diff(p_off), np.diff(o_off)
    n = len(p_len)
    off = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(p_len + o_len, out=off[1:])
    seg = np.empty(2 * n, dtype=np.int64)
    seg[0::2], seg[1::2] = p_len, o_len
    mask = np.repeat(np.tile(np.array([0, 1], dtype=np.int8), n), seg)
    ids = np.empty(int(off[-1]), dtype=np.int32)
    is_out = mask.view(bool)
    ids[is_out] = o_val
    np.logical_not(is_out, out=is_out)
    ids[is_out] = p_val
    np.logical_not(is_out, out=is_out)  # back to the loss mask (is_out is a view of it)
    return off, ids, mask


def _list_lengths(path, column: str) -> np.ndarray:
    """The list lengths of one column of a Parquet file (int64, nulls 0), decoded READ_ROWS rows
    at a time: what batching by tokens needs, in the memory of READ_ROWS rows."""
    pf = pq.ParquetFile(path, memory_map=False)
    parts = [
        pc.fill_null(pc.list_value_length(b.column(0)), 0).to_numpy()
        for b in pf.iter_batches(batch_size=READ_ROWS, columns=[column], use_threads=False)
    ]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def _read_scalar(path, columns) -> pa.Table:
    # ParquetFile.read, not pq.read_table: the latter imports pyarrow.dataset and pandas
    # (~0.2 s of every merge job).
    return pq.ParquetFile(path, memory_map=True).read(columns=columns)


def merge_shard(
    tokenized: str | os.PathLike,
    generated: str | os.PathLike,
    out: str | os.PathLike,
    rejected: str | os.PathLike,
    rules: Rules,
    generation_fp: str,
    category: str,
    shard: str,
    generate_rejected: str | os.PathLike | None = None,
    counts_out: str | os.PathLike | None = None,
    count_max_length: int | None = None,
) -> MergeResult:
    """Merge one shard; raises ConservationError when the counts do not add up. With
    `counts_out`, also writes the loss-token counts of the kept rows there; with
    `count_max_length` (dataset.max_train_length), only those in the first that many positions
    of each row (the trainers' cut)."""
    if contracts.read_metadata(generated).get(contracts.META_CONTEXT) == "regenerated":
        res = merge_conversation_shard(
            tokenized, generated, out, rejected, rules, generation_fp, category, shard,
            generate_rejected,
        )  # fmt: skip
        if counts_out:  # conversation shards are small: counted from the written rows
            counts, rows = draft_vocab.count_dataset(
                out, rules.vocab_size, max_length=count_max_length
            )
            draft_vocab.write_counts(
                counts_out, counts, rows, category=category, shard=shard,
                max_length=count_max_length,
            )  # fmt: skip
        return res
    res = MergeResult()
    tok = _read_scalar(tokenized, ["prompt_id", "num_prompt_tokens"])
    gen = _read_scalar(generated, ["prompt_id", "sample_key", "finish_type", "finish_matched_id"])
    tok_pid, gen_pid = tok.column("prompt_id"), gen.column("prompt_id")
    gen_scalars = gen.select(["prompt_id", "sample_key", "finish_type"]).combine_chunks()
    res.tokenized, res.generated = tok.num_rows, gen.num_rows
    if pc.count_distinct(tok_pid).as_py() != tok.num_rows:
        raise ConservationError(f"{tokenized}: prompt_id is not unique in the tokenized shard")

    # Join generated rows to tokenized rows.
    tok_index = pc.index_in(gen_pid, value_set=tok_pid.combine_chunks())
    known = tok_index.is_valid().to_numpy(zero_copy_only=False)
    tidx = tok_index.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    per_prompt = np.bincount(tidx[known], minlength=tok.num_rows)
    dup = known & (per_prompt[np.where(known, tidx, 0)] > 1)

    gen_rej_pids = _generate_rejected(generate_rejected)
    res.generate_rejected = len(gen_rej_pids)
    tok_gen_rejected = pc.is_in(tok_pid, value_set=gen_rej_pids).to_numpy(zero_copy_only=False)
    not_generated = np.flatnonzero((per_prompt == 0) & ~tok_gen_rejected)

    rejects = _Rejects(category, shard)
    gen_pid_np = gen_pid.to_numpy(zero_copy_only=False)
    gen_key_np = gen.column("sample_key").to_numpy(zero_copy_only=False)
    finish_np = gen.column("finish_type").to_numpy(zero_copy_only=False)
    matched_np = gen.column("finish_matched_id").to_pylist()
    tok_pid_np = tok_pid.to_numpy(zero_copy_only=False)
    tok_counts = tok.column("num_prompt_tokens").to_numpy(zero_copy_only=False)

    def gen_record(g, **extra):
        rec = {
            "prompt_id": gen_pid_np[g],
            "sample_key": gen_key_np[g],
            "finish_type": finish_np[g],
            "finish_matched_id": matched_np[g],
        }
        rec.update(extra)
        return rec

    def reject_invalid(gi, reason, expected, p_off, o_off, o_val):
        """A rejected row, with its reason's detail line, for each row of a batch that failed
        validation (reason >= 0)."""
        p_len, o_len = np.diff(p_off), np.diff(o_off)
        for i in np.flatnonzero(reason >= 0):
            code, g = REASONS[reason[i]], gi[i]
            ctx = {
                "count": int(per_prompt[tidx[g]]),
                "got": gen_key_np[g],
                "expected": expected[i],
                "output": int(o_len[i]),
                "vocab": rules.vocab_size,
                "last": int(o_val[o_off[i + 1] - 1]) if o_len[i] else None,
                "stops": list(rules.stop_ids),
                "think": rules.think_end_id,
                "total": int(p_len[i] + o_len[i]),
                "limit": rules.max_sequence_tokens,
            }
            record = gen_record(g, num_prompt_tokens=int(p_len[i]), num_output_tokens=int(o_len[i]))
            rejects.add(code, gen_pid_np[g], validate.describe(code, **ctx), record)

    for g in np.flatnonzero(~known):
        rejects.add(
            "unknown_prompt_id",
            gen_pid_np[g],
            validate.describe("unknown_prompt_id"),
            gen_record(g),
        )
    for t in not_generated:
        rejects.not_generated(
            tok_pid_np[t], {"prompt_id": tok_pid_np[t], "num_prompt_tokens": int(tok_counts[t])}
        )
    res.not_generated = len(not_generated)

    # Candidates: generated rows whose prompt is known, in prompt_id order (duplicates
    # included: validation rejects them with their own reason).
    cand = np.flatnonzero(known)
    cand_pid = pa.array(gen_pid_np[cand], pa.string())
    order = pc.sort_indices(
        pa.table({"p": cand_pid, "k": pa.array(gen_key_np[cand], pa.string())}),
        sort_keys=[("p", "ascending"), ("k", "ascending")],
    ).to_numpy()
    cand = cand[order]
    # A batch (and the output row group it becomes) ends at BATCH_ROWS candidates or with the
    # one that brings it to contracts.ROW_GROUP_TOKENS prompt + output tokens: the working set
    # is one bounded batch whatever the output length. Its kept rows hold no more tokens than
    # its candidates, so the writer cuts them into the same single row group.
    cand_tokens = (
        tok_counts[tidx[cand]].astype(np.int64) + _list_lengths(generated, "output_ids")[cand]
    )
    ends = contracts.row_group_ends(cand_tokens, BATCH_ROWS)
    batches_g = [cand[a:b] for a, b in zip([0, *ends], ends, strict=False)]
    batches_t = [tidx[b] for b in batches_g]

    # One pass: every batch is read once, validated, and its kept rows built and handed to a
    # writer thread (pyarrow encodes and compresses with the GIL released), which overlaps with
    # the next batch. The counts are only known at the end: they go into the file's key-value
    # metadata at close, and a conservation failure aborts the writer, so no output appears.
    tok_meta = contracts.read_metadata(tokenized)
    gen_meta = contracts.read_metadata(generated)
    meta = _file_meta(
        category,
        shard,
        {
            contracts.META_GENERATION_FINGERPRINT: gen_meta.get(
                contracts.META_GENERATION_FINGERPRINT, generation_fp
            )
        },
    )
    if contracts.META_TOKENIZER_FINGERPRINT in tok_meta:
        meta[contracts.META_TOKENIZER_FINGERPRINT] = tok_meta[contracts.META_TOKENIZER_FINGERPRINT]
    # Validation has checked every kept id against [0, vocab_size): bincount needs no check.
    token_counts = np.zeros(rules.vocab_size if counts_out else 0, dtype=np.int64)
    prompts_col = _RowGroupColumn(tokenized, "prompt_ids", batches_t)
    outputs_col = _RowGroupColumn(generated, "output_ids", batches_g)
    with (
        contracts.ParquetWriter(out, contracts.DATASET, "merge", meta) as writer,
        ThreadPoolExecutor(max_workers=1) as write_pool,
    ):
        pending = None
        for b, (gi, ti) in enumerate(zip(batches_g, batches_t, strict=True)):
            p_arr, o_arr = prompts_col.take(ti, b), outputs_col.take(gi, b)
            p_val, p_off = contracts.list_arrays(p_arr)
            o_val, o_off = contracts.list_arrays(o_arr)
            expected = np.array(keys.sample_keys(generation_fp, (p_val, p_off)), dtype=object)
            key_ok = expected == gen_key_np[gi]
            reason = validate.validate(
                rules, p_val, p_off, o_val, o_off, finish_np[gi], key_ok, dup[gi]
            )
            reject_invalid(gi, reason, expected, p_off, o_off, o_val)
            ok = reason < 0
            res.kept += int(ok.sum())
            if not ok.any():
                continue
            if not ok.all():  # the unfiltered arrays are released here
                keep = pa.array(ok)
                p_arr, o_arr = p_arr.filter(keep), o_arr.filter(keep)
                p_val, p_off = contracts.list_arrays(p_arr)
                o_val, o_off = contracts.list_arrays(o_arr)
            if counts_out:
                counted = o_val
                if count_max_length is not None:
                    window = draft_vocab.output_window(o_off, np.diff(p_off), count_max_length)
                    counted = o_val[window]
                # bincount casts to int64: counted a slice at a time, not a batch's worth
                for lo in range(0, len(counted), COUNT_VALUES):
                    token_counts += np.bincount(
                        counted[lo : lo + COUNT_VALUES], minlength=rules.vocab_size
                    )
                del counted
            table = _dataset_batch(p_off, p_val, o_off, o_val, gi[ok], gen_scalars, category, rules)
            del p_arr, o_arr, p_val, o_val  # the batch's inputs, before its write
            if pending is not None:
                pending.result()
            pending = write_pool.submit(writer.write, table)
            if table.nbytes > OVERLAP_BYTES:
                pending.result()
            del table
        if pending is not None:
            pending.result()
        del prompts_col, outputs_col

        res.reasons, res.rejected = rejects.reasons(), len(rejects.rows)
        what = f"merge {category}/{shard}"
        _check_tokenized(
            what, res.tokenized, res.kept, len(rejects.tokenized_prompts()),
            res.generate_rejected, res.generated,
        )  # fmt: skip
        writer.add_metadata(
            {
                **contracts.count_metadata(
                    res.generated + res.not_generated,
                    res.kept,
                    res.rejected,
                    what=what,
                    keys=contracts.MERGE_COUNT_KEYS,
                ),  # fmt: skip
                contracts.META_NOT_GENERATED: res.not_generated,
                contracts.META_GENERATE_REJECTED: res.generate_rejected,
                contracts.META_TOKENIZED_ROWS: res.tokenized,
            }
        )

    if counts_out:
        draft_vocab.write_counts(
            counts_out, token_counts, res.kept, category=category, shard=shard,
            max_length=count_max_length,
        )  # fmt: skip
    rejects.rows.sort(key=lambda r: (r["prompt_id"] or "", r["reason"], r["record"] or ""))
    rejects.write(rejected, _file_meta(category, shard))
    return res


def merge_conversation_shard(
    tokenized, generated, out, rejected, rules: Rules, generation_fp: str, category: str,
    shard: str, generate_rejected=None,
) -> MergeResult:  # fmt: skip
    """A `context: regenerated` shard (docs/multi-turn.md), the variant of merge_shard for
    conversations (same validation, rejected rows, dataset rows, metadata and conservation
    code): the generated turns (one row each, with the prompt the engine was sent) are
    validated like any sample; a conversation keeps its turns up to the first invalid one
    (later turns were built on it and are rejected with the same reason). A prefix-exact
    conversation becomes ONE row, its last kept turn's prompt + output, with loss_mask 1 over
    every kept turn's output; otherwise each kept turn is a row (prompt_id repeats; sample_key
    is unique).

    Counted in conversations (records_*: in = conversations generated + not_generated = kept,
    those with a dataset row, + rejected, those without; tokenized conversations = in +
    generate's rejected) and in turns (turns_*: generated turn rows = kept + rejected).

    Streamed: the token columns are read in batches of whole conversations (at most about
    CONVERSATION_BATCH_ROWS turn rows or contracts.ROW_GROUP_TOKENS tokens, input row groups
    released after their last batch), once
    to validate (only a reason and a reasoning count per turn are kept, so the counts that go
    into the file's metadata are known before its first row) and once to build the rows, which
    are cut into row groups as they come (contracts.RowGroupBuffer)."""
    res = MergeResult()
    tok_pids = _read_scalar(tokenized, ["prompt_id"]).column("prompt_id").to_pylist()
    gen = _read_scalar(
        generated, ["prompt_id", "sample_key", "finish_type", "turn", "prefix_exact"]
    ).combine_chunks()
    res.tokenized, res.generated = len(tok_pids), gen.num_rows
    gen_rej = set(_generate_rejected(generate_rejected).to_pylist())
    res.generate_rejected = len(gen_rej)
    pids = gen.column("prompt_id").to_pylist()
    exact = gen.column("prefix_exact").to_pylist()
    keys_ = gen.column("sample_key").to_pylist()
    turn_no = gen.column("turn").to_pylist()
    finish = gen.column("finish_type").to_pylist()
    by_conv: dict[str, list[int]] = {}
    for i, pid in enumerate(pids):
        by_conv.setdefault(pid, []).append(i)
    known = set(tok_pids)
    rejects = _Rejects(category, shard)

    # Batches of whole conversations (prompt_id order) that end once they hold
    # CONVERSATION_BATCH_ROWS turn rows or contracts.ROW_GROUP_TOKENS prompt + output tokens (a
    # turn's prompt holds the earlier turns: a conversation's tokens grow with the square of its
    # turns, so a row bound alone let 16-turn batches grow 4x over 4-turn ones): the token
    # columns are read a batch at a time, twice (validation, then the rows).
    turn_tokens_ = _list_lengths(generated, "turn_prompt_ids") + _list_lengths(
        generated, "output_ids"
    )
    batches: list[list[str]] = [[]]
    n_rows = n_tokens = 0
    for pid in sorted(p for p in by_conv if p in known):
        if n_rows >= CONVERSATION_BATCH_ROWS or n_tokens >= contracts.ROW_GROUP_TOKENS:
            batches.append([])
            n_rows = n_tokens = 0
        batches[-1].append(pid)
        n_rows += len(by_conv[pid])
        n_tokens += int(turn_tokens_[by_conv[pid]].sum())
    batch_rows = [np.array([i for pid in b for i in by_conv[pid]], np.int64) for b in batches]

    def turn_tokens(cols, rows, b):
        """(prompt values, offsets, output values, offsets) of generated rows `rows`."""
        p_val, p_off = contracts.list_arrays(cols[0].take(rows, b))
        o_val, o_off = contracts.list_arrays(cols[1].take(rows, b))
        return p_val, p_off, o_val, o_off

    def token_columns():
        return (
            _RowGroupColumn(generated, "turn_prompt_ids", batch_rows),
            _RowGroupColumn(generated, "output_ids", batch_rows),
        )

    keys_arr, finish_arr = np.array(keys_, dtype=object), np.array(finish, dtype=object)
    # Pass 1: every turn validated like any sample, its reasoning tokens counted (None without
    # think-end), as for a plain shard; only these per-turn numbers are kept.
    reason = np.full(gen.num_rows, validate.OK, np.int64)
    turn_reasoning = None
    cols = token_columns()
    for b, rows in enumerate(batch_rows):
        p_val, p_off, o_val, o_off = turn_tokens(cols, rows, b)
        expected = np.array(keys.sample_keys(generation_fp, (p_val, p_off)), dtype=object)
        reason[rows] = validate.validate(
            rules, p_val, p_off, o_val, o_off, finish_arr[rows], expected == keys_arr[rows]
        )
        all_off, all_ids, _ = concat_lists(p_off, p_val, o_off, o_val)
        still_open = validate.unterminated(
            all_ids, all_off, np.diff(p_off), rules.think_start_id, rules.think_end_id
        )
        counted, _ = validate.reasoning_counts(o_val, o_off, rules.think_end_id, still_open)
        if counted is not None:
            if turn_reasoning is None:
                turn_reasoning = np.zeros(gen.num_rows, np.int64)
            turn_reasoning[rows] = counted
    del cols

    def reasoning_of(i):
        return None if turn_reasoning is None else int(turn_reasoning[i])

    def reject(i, code, detail):
        rejects.add(code, pids[i], detail, {"sample_key": keys_[i], "turn": int(turn_no[i])})

    # What each conversation keeps (its turns up to the first invalid one): decided from the
    # reasons alone, so the counts are known before a row is written.
    good_turns: dict[str, list[int]] = {}
    kept_rows = exact_kept = 0
    for pid in sorted(by_conv):
        turns = by_conv[pid]
        if pid not in known:
            for i in turns:
                reject(i, "unknown_prompt_id", validate.describe("unknown_prompt_id"))
            continue
        good = []
        for j, i in enumerate(turns):
            if reason[i] != validate.OK:
                code = REASONS[reason[i]]
                reject(i, code, f"turn {j}: {code}")
                for later in turns[j + 1 :]:
                    reject(later, code, f"built on turn {j}, which was rejected ({code})")
                break
            good.append(i)
        if not good:
            continue
        good_turns[pid] = good
        if exact[good[0]]:
            exact_kept += 1
            kept_rows += 1
        else:
            kept_rows += len(good)
    kept_convs = len(good_turns)
    not_generated = sorted(known - set(by_conv) - gen_rej)
    for pid in not_generated:
        rejects.not_generated(pid)
    res.not_generated = len(not_generated)
    convs_in = len(by_conv) + res.not_generated
    what = f"merge {category}/{shard}"
    # tokenized conversations: kept, generated without a dataset row or not generated (merge
    # rejected them), or rejected by generate
    merge_rejected = len(known & set(by_conv)) - kept_convs + res.not_generated
    _check_tokenized(
        what, len(known), kept_convs, merge_rejected, len(gen_rej & known), res.generated
    )
    turns_rejected = sum(1 for r in rejects.rows if r["reason"] != "not_generated")
    res.kept, res.rejected = kept_rows, len(rejects.rows)
    res.reasons = rejects.reasons()
    meta = _file_meta(
        category,
        shard,
        {
            contracts.META_CONTEXT: contracts.CONTEXT_REGENERATED,
            # conversations: in = kept (a dataset row) + rejected (none)
            **contracts.count_metadata(
                convs_in,
                kept_convs,
                convs_in - kept_convs,
                what=what,
                keys=contracts.MERGE_COUNT_KEYS,
            ),  # fmt: skip
            contracts.META_NOT_GENERATED: str(res.not_generated),
            # turns: generated turn rows = kept (under the loss mask) + rejected
            **contracts.count_metadata(
                res.generated,
                res.generated - turns_rejected,
                turns_rejected,
                what=f"{what} turns",
                keys=contracts.TURN_COUNT_KEYS,
            ),  # fmt: skip
            # samples (rows): one per prefix-exact conversation, one per turn otherwise
            contracts.META_CONVERSATION_SAMPLES: str(exact_kept),
            contracts.META_TURN_SAMPLES: str(kept_rows - exact_kept),
        },
    )

    # Pass 2: the kept rows, batch by batch, cut into row groups as they come.
    scalars = gen.select(["prompt_id", "sample_key", "finish_type"])
    cols = token_columns()

    def dataset_rows(b: int, rows: np.ndarray) -> pa.Table | None:
        """The DATASET rows of batch b's kept conversations."""
        p_val, p_off, o_val, o_off = turn_tokens(cols, rows, b)
        local = {int(i): j for j, i in enumerate(rows)}
        all_off, all_ids, all_mask = concat_lists(p_off, p_val, o_off, o_val)

        def turn(i):
            j = local[i]
            return p_val[p_off[j] : p_off[j + 1]], o_val[o_off[j] : o_off[j + 1]]

        # (generated row of the sample, prompt + output ids, loss mask, output tokens,
        # reasoning tokens)
        out_rows: list[tuple[int, np.ndarray, np.ndarray, int, int | None]] = []
        for pid in batches[b]:
            good = good_turns.get(pid)
            if good is None:
                continue
            if exact[good[0]]:
                last_p, last_o = turn(good[-1])
                ids = np.concatenate([last_p, last_o])
                mask = np.zeros(len(ids), np.int8)
                n_out, n_reason = 0, 0 if rules.think_end_id is not None else None
                for i in good:
                    p, o = turn(i)
                    if not np.array_equal(ids[: len(p) + len(o)], np.concatenate([p, o])):
                        raise ConservationError(
                            f"{pid}: turn prompts of a prefix-exact conversation do not nest"
                        )
                    mask[len(p) : len(p) + len(o)] = 1
                    n_out += len(o)
                    if n_reason is not None:
                        n_reason += reasoning_of(i)
                out_rows.append((good[-1], ids, mask, n_out, n_reason))
            else:
                for i in good:
                    lo, hi = all_off[local[i]], all_off[local[i] + 1]
                    n_out = len(turn(i)[1])
                    out_rows.append((i, all_ids[lo:hi], all_mask[lo:hi], n_out, reasoning_of(i)))
        if not out_rows:
            return None
        lengths = np.array([len(r[1]) for r in out_rows], np.int64)
        off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        return _dataset_table(
            category,
            scalars.take(pa.array([r[0] for r in out_rows], pa.int64())),
            off,
            np.concatenate([r[1] for r in out_rows]),
            np.concatenate([r[2] for r in out_rows]),
            np.array([r[3] for r in out_rows], np.int64),
            None if turn_reasoning is None else np.array([r[4] for r in out_rows]),
        )

    with contracts.ParquetWriter(out, contracts.DATASET, "merge", meta) as writer:
        buffer = contracts.RowGroupBuffer(writer.write, "input_ids")
        for b, rows in enumerate(batch_rows):
            table = dataset_rows(b, rows)
            if table is not None:
                buffer.add(table)
        buffer.finish()
        writer.write_schema_if_empty()
        if writer.rows != kept_rows:
            raise ConservationError(f"{what}: {writer.rows} rows written, {kept_rows} expected")
    rejects.write(rejected, meta)
    return res


def _dataset_batch(p_off, p_val, o_off, o_val, g, gen_scalars, category, rules) -> pa.Table:
    """DATASET rows for generated rows `g` (all valid) and their prompt/output tokens.
    `gen_scalars` holds the generated shard's prompt_id, sample_key and finish_type columns."""
    off, ids, mask = concat_lists(p_off, p_val, o_off, o_val)
    p_len, o_len = np.diff(p_off), np.diff(o_off)
    still_open = validate.unterminated(ids, off, p_len, rules.think_start_id, rules.think_end_id)
    reasoning, _ = validate.reasoning_counts(o_val, o_off, rules.think_end_id, still_open)
    return _dataset_table(category, gen_scalars.take(pa.array(g)), off, ids, mask, o_len, reasoning)


def _dataset_table(category, scalars, off, ids, mask, o_len, reasoning) -> pa.Table:
    """DATASET rows: `scalars` (prompt_id, sample_key, finish_type of each row), input_ids and
    loss_mask flattened (`off` the row offsets), the output tokens of each row, and its
    reasoning tokens (None without a think-end token: null columns)."""
    n = scalars.num_rows
    off32 = pa.array(np.asarray(off).astype(np.int32))
    total = np.diff(off)
    o_len = np.asarray(o_len, np.int64)

    def int32_or_null(values):
        return pa.array(values.astype(np.int32) if values is not None else [None] * n, pa.int32())

    return pa.table(
        {
            "prompt_id": scalars.column("prompt_id"),
            "category": pa.array([category], pa.string()).take(pa.array(np.zeros(n, np.int64))),
            "sample_key": scalars.column("sample_key"),
            "input_ids": pa.ListArray.from_arrays(off32, pa.array(ids, pa.int32())),
            "loss_mask": pa.ListArray.from_arrays(off32, pa.array(mask, pa.int8())),
            "num_prompt_tokens": pa.array((total - o_len).astype(np.int32), pa.int32()),
            "num_output_tokens": pa.array(o_len.astype(np.int32), pa.int32()),
            "num_reasoning_tokens": int32_or_null(reasoning),
            "num_answer_tokens": int32_or_null(None if reasoning is None else o_len - reasoning),
            "num_total_tokens": pa.array(total.astype(np.int32), pa.int32()),
            "finish_type": scalars.column("finish_type"),
        }
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill merge", description=__doc__.split("\n")[0])
    parser.add_argument("--category", required=True)
    parser.add_argument("--shard", required=True)
    parser.add_argument("--tokenized", required=True)
    parser.add_argument("--generated", required=True)
    parser.add_argument("--generate-rejected", help="results/rejected/generate/{c}/{s}.parquet")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rejected", required=True)
    parser.add_argument(
        "--counts-out", help="results/token_counts/{c}/{s}.parquet: loss-token counts of the shard"
    )
    validate.add_config_arguments(parser)
    guards.add_limits_argument(parser)
    args = parser.parse_args(argv)
    sections = validate.load_config_arguments(args, "tokenmill merge")
    if sections is None:
        return 1
    ds, gen, tok = sections
    try:
        limit = guards.limit_for("merge", args.reject_limits)
    except ValueError as exc:
        print(f"tokenmill merge: {exc}", file=sys.stderr)
        return 1
    # The facts must come from the tokenizer the shard was tokenized with (Snakemake reruns
    # token-facts when the tokenizer changes; a merge run by hand has no such guard).
    shard_tokenizer = None
    if os.path.exists(args.tokenized):
        meta = contracts.read_metadata(args.tokenized)
        shard_tokenizer = meta.get(contracts.META_TOKENIZER_FINGERPRINT)
    try:
        facts = validate.facts_of_arguments(args, ds, gen, tok, shard_tokenizer)
        rules = validate.rules_from_facts(ds, facts)
    except ValueError as exc:
        print(f"tokenmill merge: {exc}", file=sys.stderr)
        return 1
    try:
        res = merge_shard(
            args.tokenized,
            args.generated,
            args.out,
            args.rejected,
            rules,
            keys.generation_fingerprint(gen),
            args.category,
            args.shard,
            generate_rejected=args.generate_rejected,
            counts_out=args.counts_out,
            count_max_length=ds.max_train_length,
        )
    except ConservationError as exc:
        print(f"tokenmill merge: {exc}", file=sys.stderr)
        return 1
    outputs = [p for p in (args.out, args.rejected, args.counts_out) if p]
    status = guards.enforce(
        outputs,
        "merge",
        args.category,
        res.kept + res.rejected,
        res.kept,
        args.rejected,
        limit,
        key=guards.limit_key("merge"),
        shard=args.shard,
    )
    if status:
        return status
    print(
        f"merge {args.category}/{args.shard}: tokenized={res.tokenized} generated={res.generated} "
        f"kept={res.kept} rejected={res.rejected} generate_rejected={res.generate_rejected} "
        f"reasons={contracts.canonical_json(res.reasons)}",
        file=sys.stderr,
    )
    return 0
