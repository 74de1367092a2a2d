"""`tokenmill merge`: one tokenized + one generated shard -> one validated training shard.

    input_ids = prompt_ids + output_ids
    loss_mask = [0] * len(prompt_ids) + [1] * len(output_ids)   (the matched stop token included)

Output columns (contracts.DATASET, results/dataset/{category}/{shard}.parquet, sorted by
prompt_id): prompt_id, category, sample_key, input_ids list<int32>, loss_mask list<int8>,
num_prompt_tokens, num_output_tokens, num_reasoning_tokens / num_answer_tokens (output tokens
up to and including the first dataset.think_end_token / the rest; an output that never closed a
thinking block that was open is all reasoning (validate.unterminated); null when think_end_token
is null), num_total_tokens, finish_type.

Prompt and conversation shards (`context: regenerated`, docs/multi-turn.md) take one path: the
generated rows are turns of records (_Turns). A prompt shard's rows are records of one turn,
sent their tokenized prompt; a conversation shard's rows are the turns of its conversations,
each sent its own turn_prompt_ids. A record keeps its turns up to the first invalid one, and a
prefix-exact conversation's kept turns fold into one row (loss_mask 1 over every turn's output).

Rows that fail validation (validate.py, one reason code each), duplicate and unknown generated
rows, and tokenized prompts that were neither generated nor rejected by generate
(`not_generated`) go to results/rejected/merge/{category}/{shard}.parquet. The rejected row's
`record` holds the sample's scalar fields as canonical JSON (the tokens stay in the generated
shard). Conservation, checked on every run (the command fails with the counts otherwise):

    tokenized prompts = kept prompts (with a dataset row) + distinct tokenized prompts
                        rejected by merge and not kept + prompts rejected by generate
                        (--generate-rejected)

With `counts_out` (`--counts-out`, the `merge_shard` rule always gives it), the same pass also
counts the loss-masked tokens of the kept rows (loss_mask = 1 is exactly the output part, so
one np.bincount per batch over the output ids) and writes them in draft_vocab's counts format
to results/token_counts/{category}/{shard}.parquet, so an incremental rebuild recounts only the
shards it re-merges. With dataset.max_train_length L, only the ids in the first L positions of
each row (prompt + output) are counted: the trainers cut rows to their sequence length first.

File key-value metadata (the counts are added at close; read them with
contracts.read_metadata): tokenmill.records_in (generated records + not_generated prompts, i.e.
everything merge accounts for), records_kept, records_rejected (in = kept + rejected),
tokenmill.record_reasons (each rejected record's reason), tokenmill.turns_in/_kept/_rejected
(generated rows), tokenmill.conversation_samples / turn_samples (rows folded from a
conversation / rows of one turn), tokenmill.not_generated, tokenmill.generate_rejected,
tokenmill.tokenized_rows, the context (if any) and the tokenizer and generation fingerprints
carried over from the input shards.

Everything is vectorized over flattened token arrays and streamed in one pass, in batches of
whole records that end at contracts.ROW_GROUP_SIZE rows or with the record that brings them to
contracts.ROW_GROUP_TOKENS prompt + output tokens (_record_batches; the output lengths
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


def _record_batches(tokens: np.ndarray, record: np.ndarray, max_rows: int) -> list[int]:
    """Where the batches of sorted candidate rows end (exclusive): contracts.row_group_ends
    over whole records (a record's rows are contiguous), so that a batch holds every turn of
    each of its records. A batch ends at `max_rows` rows (or after one record, if that alone is
    more) or with the record that brings it to contracts.ROW_GROUP_TOKENS tokens; a prompt
    shard's records are single rows, so its batches are row_group_ends' own."""
    n = len(tokens)
    if n == 0:
        return []
    starts = np.flatnonzero(np.r_[True, record[1:] != record[:-1]])
    bounds = np.r_[starts, n]
    cum_tokens = np.cumsum(np.add.reduceat(np.asarray(tokens, np.int64), starts))
    cum_rows = bounds[1:]  # rows up to and including each record
    ends, first, base_tokens, base_rows = [], 0, 0, 0
    while first < len(starts):
        over = int(np.searchsorted(cum_tokens, base_tokens + contracts.ROW_GROUP_TOKENS, "left"))
        fit = int(np.searchsorted(cum_rows, base_rows + max_rows, "right"))
        last = max(first + 1, min(fit, over + 1, len(starts)))
        ends.append(int(bounds[last]))
        base_tokens, base_rows, first = int(cum_tokens[last - 1]), int(cum_rows[last - 1]), last
    return ends


@dataclass
class _Turns:
    """The generated rows of one shard as turns of records (docs/multi-turn.md), with the
    prompt each turn was sent. A prompt shard's rows are records of one turn each, sent their
    tokenized prompt (`prompt_ids` of the tokenized shard); a conversation shard's rows
    (contracts.GENERATED_TURNS) are the turns of the conversation their prompt_id names, each
    sent its own `turn_prompt_ids`, and a prefix-exact conversation's kept turns fold into one
    dataset row. Arrays are per generated row."""

    pid: np.ndarray  # object: prompt_id
    key: np.ndarray  # object: sample_key
    finish: np.ndarray  # object: finish_type
    matched: list  # finish_matched_id
    turn: np.ndarray  # int64, 0 for a prompt shard
    fold: np.ndarray  # bool: the record's kept turns become one row (prefix-exact)
    record: np.ndarray  # int64: the record each row belongs to
    has_turns: bool  # the shard is a conversation shard (rows name their turn)
    prompt_file: str | os.PathLike
    prompt_column: str
    scalars: pa.Table  # prompt_id, sample_key, finish_type (the dataset row's own columns)

    @classmethod
    def read(cls, tokenized, generated) -> _Turns:
        names = pq.ParquetFile(generated).schema_arrow.names
        has_turns = "turn_prompt_ids" in names
        scalar_cols = ["prompt_id", "sample_key", "finish_type", "finish_matched_id"]
        gen = _read_scalar(generated, scalar_cols + (["turn", "prefix_exact"] if has_turns else []))
        gen = gen.combine_chunks()
        n = gen.num_rows
        pid = gen.column("prompt_id").to_numpy(zero_copy_only=False)
        if has_turns:
            turn = gen.column("turn").to_numpy(zero_copy_only=False).astype(np.int64)
            fold = gen.column("prefix_exact").to_numpy(zero_copy_only=False).astype(bool)
            record = np.unique(pid, return_inverse=True)[1].astype(np.int64) if n else turn
        else:
            turn, fold, record = np.zeros(n, np.int64), np.zeros(n, bool), np.arange(n)
        return cls(
            pid=pid,
            key=gen.column("sample_key").to_numpy(zero_copy_only=False),
            finish=gen.column("finish_type").to_numpy(zero_copy_only=False),
            matched=gen.column("finish_matched_id").to_pylist(),
            turn=turn,
            fold=fold,
            record=record,
            has_turns=has_turns,
            prompt_file=generated if has_turns else tokenized,
            prompt_column="turn_prompt_ids" if has_turns else "prompt_ids",
            scalars=gen.select(["prompt_id", "sample_key", "finish_type"]),
        )


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
    """Merge one shard, prompt or conversation shard alike (_Turns); raises ConservationError
    when the counts do not add up. With `counts_out`, also writes the loss-token counts of the
    kept rows there; with `count_max_length` (dataset.max_train_length), only those in the
    first that many positions of each row (the trainers' cut).

    Every generated row (a turn) is validated alone; a record keeps its turns up to the first
    invalid one (later turns were built on it and are rejected with the same reason). Each kept
    turn is a dataset row, except that a prefix-exact conversation's kept turns fold into ONE
    row, its last kept turn's prompt + output with loss_mask 1 over every kept turn's output.
    Counted in records (records_*: in = records generated + not_generated = kept, those with a
    dataset row, + rejected, those without; record_reasons: the reason of each rejected
    record's first rejected turn) and in turns (turns_*: generated rows = kept + rejected)."""
    res = MergeResult()
    tok = _read_scalar(tokenized, ["prompt_id", "num_prompt_tokens"])
    turns = _Turns.read(tokenized, generated)
    tok_pid = tok.column("prompt_id").combine_chunks()
    res.tokenized, res.generated = tok.num_rows, len(turns.pid)
    if pc.count_distinct(tok_pid).as_py() != tok.num_rows:
        raise ConservationError(f"{tokenized}: prompt_id is not unique in the tokenized shard")

    # Join generated rows to tokenized rows; a turn given twice is a duplicate (both rows).
    gen_pid = pa.array(turns.pid, pa.string())
    tok_index = pc.index_in(gen_pid, value_set=tok_pid)
    known = tok_index.is_valid().to_numpy(zero_copy_only=False)
    tidx = tok_index.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64)
    turn_id = tidx * (int(turns.turn.max(initial=0)) + 1) + turns.turn
    _, inverse, counts = np.unique(turn_id, return_inverse=True, return_counts=True)
    given = counts[inverse.reshape(-1)]  # how many rows give each row's turn
    dup = known & (given > 1)

    tok_gen_rejected = pc.is_in(tok_pid, value_set=_generate_rejected(generate_rejected))
    tok_gen_rejected = tok_gen_rejected.to_numpy(zero_copy_only=False)
    res.generate_rejected = int(tok_gen_rejected.sum())
    asked = np.zeros(tok.num_rows, bool)
    asked[tidx[known]] = True
    not_generated = np.flatnonzero(~asked & ~tok_gen_rejected)
    tok_pid_np = tok_pid.to_numpy(zero_copy_only=False)
    tok_counts = tok.column("num_prompt_tokens").to_numpy(zero_copy_only=False)

    rejects = _Rejects(category, shard)
    record_reasons: collections.Counter = collections.Counter()

    def gen_record(g, **extra):
        rec = {
            "prompt_id": turns.pid[g],
            "sample_key": turns.key[g],
            "finish_type": turns.finish[g],
            "finish_matched_id": turns.matched[g],
        }
        if turns.has_turns:
            rec["turn"] = int(turns.turn[g])
        rec.update(extra)
        return rec

    def reject_invalid(gi, reason, expected, p_off, o_off, o_val):
        """A rejected row, with its reason's detail line, for each row of a batch that failed
        validation (reason >= 0)."""
        p_len, o_len = np.diff(p_off), np.diff(o_off)
        for i in np.flatnonzero(reason >= 0):
            code, g = REASONS[reason[i]], gi[i]
            ctx = {
                "count": int(given[g]),
                "got": turns.key[g],
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
            rejects.add(code, turns.pid[g], validate.describe(code, **ctx), record)

    unknown = np.flatnonzero(~known)
    for g in unknown:
        rejects.add(
            "unknown_prompt_id",
            turns.pid[g],
            validate.describe("unknown_prompt_id"),
            gen_record(g),
        )
    record_reasons["unknown_prompt_id"] += len(np.unique(turns.record[unknown]))
    for t in not_generated:
        rejects.not_generated(
            tok_pid_np[t], {"prompt_id": tok_pid_np[t], "num_prompt_tokens": int(tok_counts[t])}
        )
    res.not_generated = len(not_generated)
    record_reasons["not_generated"] += res.not_generated

    # Candidates: generated rows whose prompt is known, in (prompt_id, turn, sample_key) order
    # (duplicates included: validation rejects them with their own reason), so a record's turns
    # are contiguous and in order.
    cand = np.flatnonzero(known)
    order = pc.sort_indices(
        pa.table(
            {
                "p": gen_pid.take(pa.array(cand)),
                "t": pa.array(turns.turn[cand]),
                "k": pa.array(turns.key[cand], pa.string()),
            }
        ),
        sort_keys=[("p", "ascending"), ("t", "ascending"), ("k", "ascending")],
    ).to_numpy()
    cand = cand[order]
    # A batch (and the output row group it becomes) holds whole records and ends at BATCH_ROWS
    # candidates or with the record that brings it to contracts.ROW_GROUP_TOKENS prompt +
    # output tokens (_record_batches): the working set is one bounded batch whatever the output
    # length or the number of turns. Its kept rows are one row group (they hold no more tokens
    # than its candidates; cut by rows alone, a conversation would end in a tiny row group).
    if turns.has_turns:
        prompt_tokens = _list_lengths(generated, turns.prompt_column)[cand]
    else:
        prompt_tokens = tok_counts[tidx[cand]].astype(np.int64)
    cand_tokens = prompt_tokens + _list_lengths(generated, "output_ids")[cand]
    ends = _record_batches(cand_tokens, turns.record[cand], BATCH_ROWS)
    batches_g = [cand[a:b] for a, b in zip([0, *ends], ends, strict=False)]
    prompt_rows = [b if turns.has_turns else tidx[b] for b in batches_g]

    # One pass: every batch is read once, validated, and its kept rows built and handed to a
    # writer thread (pyarrow encodes and compresses with the GIL released), which overlaps with
    # the next batch. The counts are only known at the end: they go into the file's key-value
    # metadata at close, and a conservation failure aborts the writer, so no output appears.
    tok_meta = contracts.read_metadata(tokenized)
    gen_meta = contracts.read_metadata(generated)
    meta = _file_meta(category, shard)
    if contracts.META_CONTEXT in gen_meta:
        meta[contracts.META_CONTEXT] = gen_meta[contracts.META_CONTEXT]
    meta[contracts.META_GENERATION_FINGERPRINT] = gen_meta.get(
        contracts.META_GENERATION_FINGERPRINT, generation_fp
    )
    if contracts.META_TOKENIZER_FINGERPRINT in tok_meta:
        meta[contracts.META_TOKENIZER_FINGERPRINT] = tok_meta[contracts.META_TOKENIZER_FINGERPRINT]
    # Validation has checked every kept id against [0, vocab_size): bincount needs no check.
    token_counts = np.zeros(rules.vocab_size if counts_out else 0, dtype=np.int64)
    prompts_col = _RowGroupColumn(turns.prompt_file, turns.prompt_column, prompt_rows)
    outputs_col = _RowGroupColumn(generated, "output_ids", batches_g)
    records_kept = partly_kept = folded_rows = turns_kept = 0
    with (
        contracts.ParquetWriter(out, contracts.DATASET, "merge", meta) as writer,
        ThreadPoolExecutor(max_workers=1) as write_pool,
    ):
        pending = None
        for b, (gi, pi) in enumerate(zip(batches_g, prompt_rows, strict=True)):
            p_arr, o_arr = prompts_col.take(pi, b), outputs_col.take(gi, b)
            p_val, p_off = contracts.list_arrays(p_arr)
            o_val, o_off = contracts.list_arrays(o_arr)
            expected = np.array(keys.sample_keys(generation_fp, (p_val, p_off)), dtype=object)
            key_ok = expected == turns.key[gi]
            reason = validate.validate(
                rules, p_val, p_off, o_val, o_off, turns.finish[gi], key_ok, dup[gi]
            )
            reject_invalid(gi, reason, expected, p_off, o_off, o_val)
            ok = _cut_after_first_invalid(gi, reason, turns, rejects)
            starts = np.flatnonzero(np.r_[True, turns.record[gi[1:]] != turns.record[gi[:-1]]])
            any_ok = np.logical_or.reduceat(ok, starts)
            records_kept += int(any_ok.sum())
            partly_kept += int((any_ok & ~np.logical_and.reduceat(ok, starts)).sum())
            for s in starts[~any_ok]:  # a record without a kept turn: its first turn's reason
                record_reasons[REASONS[reason[s]]] += 1
            turns_kept += int(ok.sum())
            if not ok.any():
                continue
            if not ok.all():  # the unfiltered arrays are released here
                keep = pa.array(ok)
                p_arr, o_arr = p_arr.filter(keep), o_arr.filter(keep)
                p_val, p_off = contracts.list_arrays(p_arr)
                o_val, o_off = contracts.list_arrays(o_arr)
            if counts_out:
                # every kept turn's output is under the loss mask of exactly one dataset row,
                # at the same positions (a folded turn's prompt + output opens its row)
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
            table, folded = _dataset_batch(
                p_off, p_val, o_off, o_val, gi[ok], turns, category, rules
            )
            folded_rows += folded
            res.kept += table.num_rows
            del p_arr, o_arr, p_val, o_val  # the batch's inputs, before its write
            if pending is not None:
                pending.result()
            pending = write_pool.submit(writer.write, table, one_row_group=True)
            if table.nbytes > OVERLAP_BYTES:
                pending.result()
            del table
        if pending is not None:
            pending.result()
        del prompts_col, outputs_col
        # no rows: a file without row groups (Hugging Face datasets cannot read an empty one)

        res.reasons, res.rejected = rejects.reasons(), len(rejects.rows)
        what = f"merge {category}/{shard}"
        # a tokenized prompt is kept (a dataset row), or rejected by merge (rejected rows and
        # none kept) or by generate
        _check_tokenized(
            what, res.tokenized, records_kept, len(rejects.tokenized_prompts()) - partly_kept,
            res.generate_rejected, res.generated,
        )  # fmt: skip
        records_in = len(np.unique(turns.record)) + res.not_generated
        turns_rejected = res.rejected - res.not_generated
        writer.add_metadata(
            {
                # records: in = kept (a dataset row) + rejected (none)
                **contracts.count_metadata(
                    records_in,
                    records_kept,
                    records_in - records_kept,
                    what=what,
                    keys=contracts.MERGE_COUNT_KEYS,
                ),  # fmt: skip
                contracts.META_RECORD_REASONS: contracts.canonical_json(
                    dict(sorted((k, v) for k, v in record_reasons.items() if v))
                ),
                contracts.META_NOT_GENERATED: res.not_generated,
                contracts.META_GENERATE_REJECTED: res.generate_rejected,
                contracts.META_TOKENIZED_ROWS: res.tokenized,
                # turns: generated rows = kept (under the loss mask) + rejected
                **contracts.count_metadata(
                    res.generated,
                    turns_kept,
                    turns_rejected,
                    what=f"{what} turns",
                    keys=contracts.TURN_COUNT_KEYS,
                ),  # fmt: skip
                # samples (rows): one per folded (prefix-exact) record, one per turn otherwise
                contracts.META_CONVERSATION_SAMPLES: folded_rows,
                contracts.META_TURN_SAMPLES: res.kept - folded_rows,
            }
        )

    if counts_out:
        draft_vocab.write_counts(
            counts_out, token_counts, res.kept, category=category, shard=shard,
            max_length=count_max_length,
        )  # fmt: skip
    rejects.rows.sort(key=lambda r: (r["prompt_id"] or "", r["reason"], r["record"] or ""))
    rejects_meta = _file_meta(category, shard)
    if contracts.META_CONTEXT in meta:
        rejects_meta[contracts.META_CONTEXT] = meta[contracts.META_CONTEXT]
    rejects.write(rejected, rejects_meta)
    return res


def _cut_after_first_invalid(gi, reason, turns: _Turns, rejects: _Rejects) -> np.ndarray:
    """The kept rows of a batch (bool): valid, and no earlier turn of their record invalid.
    A valid turn after an invalid one was built on it: it is rejected with that turn's
    reason. (A prompt shard's records are single rows: nothing is cut.)"""
    bad = reason >= 0
    rec = turns.record[gi]
    new = np.r_[True, rec[1:] != rec[:-1]]
    local = np.cumsum(new) - 1  # the batch's record of each row
    first_bad = np.full(int(local[-1]) + 1 if len(local) else 0, len(gi), np.int64)
    bad_at = np.flatnonzero(bad)
    np.minimum.at(first_bad, local[bad_at], bad_at)
    built_on = ~bad & (np.arange(len(gi)) > first_bad[local])
    for i in np.flatnonzero(built_on):
        j = first_bad[local[i]]
        code, g = REASONS[reason[j]], gi[i]
        detail = f"built on turn {int(turns.turn[gi[j]])}, which was rejected ({code})"
        record = {"sample_key": turns.key[g], "turn": int(turns.turn[g])}
        rejects.add(code, turns.pid[g], detail, record)
    return ~bad & ~built_on


def _dataset_batch(p_off, p_val, o_off, o_val, g, turns: _Turns, category, rules):
    """(DATASET rows, folded rows) for kept generated rows `g` (in record and turn order) and
    their prompt/output tokens: a row per turn, except that the turns of a folding record
    (prefix-exact) become one row, its last turn's prompt + output with loss_mask 1 over every
    turn's output (their prompts nest: checked)."""
    off, ids, mask = concat_lists(p_off, p_val, o_off, o_val)
    p_len, o_len = np.diff(p_off), np.diff(o_off)
    still_open = validate.unterminated(ids, off, p_len, rules.think_start_id, rules.think_end_id)
    reasoning, _ = validate.reasoning_counts(o_val, o_off, rules.think_end_id, still_open)
    n_out = o_len.astype(np.int64)
    emit = np.ones(len(g), bool)
    fold = turns.fold[g]
    folded = 0
    if fold.any():
        rec = turns.record[g]
        starts = np.flatnonzero(np.r_[True, rec[1:] != rec[:-1]])
        for a, z in zip(starts, np.r_[starts[1:], len(g)], strict=True):
            if not fold[a]:
                continue
            folded += 1
            last = z - 1
            row = ids[off[last] : off[last + 1]]
            for j in range(a, last):
                n = int(p_len[j] + o_len[j])
                if not np.array_equal(row[:n], ids[off[j] : off[j + 1]]):
                    raise ConservationError(
                        f"{turns.pid[g[j]]}: the turn prompts of a prefix-exact conversation "
                        "do not nest"
                    )
                mask[off[last] + p_len[j] : off[last] + n] = 1
                n_out[last] += o_len[j]
                if reasoning is not None:
                    reasoning[last] += reasoning[j]
                emit[j] = False
    if not emit.all():
        values = np.repeat(emit, np.diff(off))
        ids, mask = ids[values], mask[values]
        off = np.r_[0, np.cumsum(np.diff(off)[emit])].astype(np.int64)
        g, n_out = g[emit], n_out[emit]
        reasoning = None if reasoning is None else reasoning[emit]
    table = _dataset_table(
        category, turns.scalars.take(pa.array(g)), off, ids, mask, n_out, reasoning
    )
    return table, folded


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
