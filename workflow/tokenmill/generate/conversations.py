"""The turn loop of a `context: regenerated` shard: every assistant turn of every conversation,
in order, each on top of the model's own earlier turns (docs/multi-turn.md).

One generate job runs a shard's conversations concurrently: turn k+1 of a conversation is
queued the moment turn k's answer is journaled (Client's `follow` hook), so the engine holds
as many requests as there are unfinished conversations (up to generation.concurrency).
Each turn is a sample like any other: its key is the sample key of its prompt ids, which hold
the model's own earlier answers, so

- a killed job resumes at the first unjournaled turn of each conversation (replay walks the
  journal turn by turn: turn 1's key, its answer, turn 2's prompt and key, ...); a journaled
  refusal that does not blame the prompt is asked again, as in a plain shard
  (journal.Index.ask_again);
- an edited turn changes the conversation's prompt_id (and possibly its shard) and the prompt
  ids from that turn on: the turns before it hit the journal, the rest are generated again.

Prompts are built from ids (tokenization/conversations.py): prefix-exact conversations by
concatenation, others with apply_chat_template of the conversation carrying the model's
answers. Only the latter needs the tokenizer here: the one case in which the generate job
imports transformers (loaded once, on the first such conversation).

Output (contracts.GENERATED_TURNS): one row per generated turn, (prompt_id, turn) order, with
the turn's prompt ids and why the conversation stopped; a conversation whose first turn was
refused is a rejected row. Once every conversation ended, the shard's keys are known (every
turn's) and its journal is compacted like a plain shard's (`compact`): records of other keys go
to the stale file, which replay searches for a turn missing elsewhere.

Memory follows the conversations in flight, not the shard (issue 19 item 5): a turn's prompt
is spilled to an unnamed scratch file beside the output once its answer is journaled, a
conversation that ended holds nothing but its turns' keys and places, and the output is
written from the journal and the scratch file in row groups, as a plain shard's is
(`benchmarks/bench_conversation_memory.py`, figures in docs/multi-turn.md).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill import contracts, keys
from tokenmill.generate import journal
from tokenmill.generate.client import OK, REASONS, REJECTED, Item
from tokenmill.generate.job import (
    FETCH_ROWS,
    Job,
    OutputFrame,
    commit_compaction,
    common_meta,
    finish_timing,
    generate,
    open_job,
    rejected_row,
    resolve_stop_ids,
)
from tokenmill.settings import GenerationSettings, TokenizerSettings, thaw
from tokenmill.tokenization import conversations as conv

log = logging.getLogger("tokenmill.generate")


class TurnItem(Item):
    """An Item whose prompt ids are held as int32 (4 bytes a token, not a Python list's ~36),
    or read from the tokenized shard (a first turn), and become a list only when the request
    is built."""

    def __init__(self, prompt_id: str, key: str, prompt, seed: int | None):
        self.prompt_id, self.key, self.seed = prompt_id, key, seed
        self._prompt = prompt  # an int32 array, or a callable that gives one

    @property
    def prompt_ids(self) -> list[int]:
        return self.ids().tolist()

    def ids(self) -> np.ndarray:
        p = self._prompt
        return p() if callable(p) else p


class TurnPrompts:
    """Every answered turn's prompt ids, spilled to an unnamed scratch file as the turn is
    answered and read back when the output is written: memory holds only a turn's place in it
    (the prompts of a shard grow with the square of its turns; the output needs them all)."""

    def __init__(self, directory):
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._f = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 (closed by close())
        self._end = 0

    def put(self, prompt: np.ndarray) -> tuple[int, int]:
        data = np.ascontiguousarray(prompt, dtype="<i4").tobytes()
        at = self._end
        os.pwrite(self._f.fileno(), data, at)
        self._end += len(data)
        return at, len(prompt)

    def get(self, place: tuple[int, int]) -> np.ndarray:
        at, n = place
        return np.frombuffer(os.pread(self._f.fileno(), 4 * n, at), dtype="<i4")

    def close(self) -> None:
        self._f.close()


class Conversations:
    """The conversations of one shard and where each one stands.

    Memory follows the conversations in flight, not the shard: the tokenized shard stays in
    Arrow (a row is read when its conversation needs it); a conversation still going holds its
    next prompt (int32) and, when not prefix-exact, its answers so far (to render the next
    prompt); a turn's prompt goes to `TurnPrompts` (or nowhere, without one) once its answer is
    journaled, and its record is read back from the journal when the output is written. What
    stays per answered turn is its key and its prompt's place in the scratch file."""

    def __init__(self, path, fingerprint: str, seed_policy: str, stop_ids, tok_cfg, basedir,
                 prompt_at_fault, spill=None):  # fmt: skip
        meta = contracts.read_metadata(path)
        # Not memory-mapped: mapped pages of the file would count in the job's RSS.
        table = pq.ParquetFile(path, memory_map=False).read()
        self.prompt_ids = table.column("prompt_id").to_pylist()
        self.prefix_exact = table.column("prefix_exact").to_pylist()
        self.num_turns = table.column("num_turns").to_pylist()
        self._table = table.drop_columns(["prompt_id", "prefix_exact", "num_turns"])
        self.fingerprint, self.seed_policy = fingerprint, seed_policy
        self.stop_ids = list(stop_ids)
        te = meta.get(contracts.META_THINK_END_ID)
        self.think_end_id = int(te) if te else None
        mpt = meta.get(contracts.META_MAX_PROMPT_TOKENS)
        self.max_prompt_tokens = int(mpt) if mpt else None
        self.tok_cfg, self.basedir = tok_cfg, basedir
        # The engine's rule for which journaled refusals are final (journal.Index.ask_again).
        self.prompt_at_fault = prompt_at_fault
        self.spill: TurnPrompts | None = spill
        self._tokenizer = None
        n = len(self.prompt_ids)
        # Per answered turn: its key and its prompt's place in `spill` (None without one).
        self.turn_keys: list[list[str]] = [[] for _ in range(n)]
        self.turn_places: list[list[tuple[int, int] | None]] = [[] for _ in range(n)]
        self.end: list[str | None] = [None] * n
        # The last turn's record of a conversation a refusal or an engine error ended.
        self.failed: dict[int, dict] = {}
        # The next turn's prompt of a conversation past its first turn (None: not held).
        self.prompt: list[np.ndarray | None] = [None] * n
        self.answers: dict[int, list[np.ndarray]] = {}  # not prefix-exact, still going
        self.waiting: dict[str, list[int]] = {}  # key -> conversations waiting for it
        self.items: dict[str, Item] = {}  # key -> the item of a turn not answered yet
        self.from_journal = 0
        self.turns_ok = 0

    def row(self, c: int) -> dict:
        """Conversation c's tokenized row (prompt_ids, turn_segments, tool_call_ids, messages,
        tools), read from the Arrow table."""
        return self._table.slice(c, 1).to_pylist()[0]

    def __len__(self) -> int:
        return len(self.prompt_ids)

    # -- prompts
    def tokenizer(self):
        if self._tokenizer is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            from tokenmill.tokenization.tokenizer import load_tokenizer  # heavy: only here

            self._tokenizer = load_tokenizer(self.tok_cfg, self.basedir)
        return self._tokenizer

    def needs_tokenizer(self) -> bool:
        """Whether a conversation still going will need the tokenizer for its next prompt
        (one that is not prefix-exact re-renders the messages with the model's answers)."""
        return any(
            not exact and end is None
            for exact, end in zip(self.prefix_exact, self.end, strict=True)
        )

    def current_prompt(self, c: int) -> np.ndarray:
        """The prompt of conversation c's next turn: a first prompt is read from the tokenized
        shard each time (not held), a later one is held until its answer came."""
        p = self.prompt[c]
        if p is None:
            col = self._table.column("prompt_ids")
            p = np.asarray(col[c].values.to_numpy(zero_copy_only=False), dtype=np.int32)
        return p

    def _next_prompt(self, c: int, prompt: np.ndarray, out: list[int], k: int) -> np.ndarray:
        if self.prefix_exact[c]:
            seg = self._table.column("turn_segments")[c][k].as_py()
            return np.concatenate([prompt, np.asarray(out + seg, dtype=np.int32)])
        row, tok = self.row(c), self.tokenizer()
        answers = {}
        for j, ids in enumerate(self.answers[c]):
            tool = row["tool_call_ids"][j]
            # A tool-call turn continues only when the model's ids equal the dataset's: its
            # message (with tool_calls) renders to those ids, no parser needed.
            answers[j] = (
                None
                if tool is not None
                else conv.model_message(tok, ids.tolist(), self.stop_ids, self.think_end_id)
            )
        messages = conv.messages_with_answers(json.loads(row["messages"]), answers)
        kwargs = thaw(self.tok_cfg.chat_template_kwargs)
        ids = conv.render(tok, messages, conv.load_json(row["tools"]), True, kwargs)
        return np.asarray(ids, dtype=np.int32)

    def _item(self, c: int) -> Item:
        prompt = self.current_prompt(c)
        key = keys.sample_key(self.fingerprint, prompt)
        seed = keys.sampling_seed(key) if self.seed_policy == "per_sample" else None
        if self.prompt[c] is None:  # a first turn: read again when the request is built
            return TurnItem(self.prompt_ids[c], key, lambda: self.current_prompt(c), seed)
        return TurnItem(self.prompt_ids[c], key, prompt, seed)

    # -- progress
    def advance(self, c: int, key: str, rec: dict) -> None:
        """Turn len(turn_keys[c]) of conversation c was answered by `rec` (journaled, or an
        engine error): record its key and prompt, then end the conversation (releasing what it
        held) or set its next prompt."""
        k = len(self.turn_keys[c])
        prompt = self.current_prompt(c)
        self.turn_keys[c].append(key)
        self.turn_places[c].append(self.spill.put(prompt) if self.spill is not None else None)
        if rec["status"] != OK:
            self._end(c, conv.END_REJECTED if rec["status"] == REJECTED else conv.END_ERROR)
            self.failed[c] = {"status": rec["status"], "message": rec.get("message"),
                              "num_prompt_tokens": len(prompt)}  # fmt: skip
            return
        self.turns_ok += 1
        out = list(rec["output_ids"])
        tool = self._table.column("tool_call_ids")[c][k].as_py()
        if not out or out[-1] not in self.stop_ids:
            self._end(c, conv.END_TRUNCATED)
        elif k + 1 >= self.num_turns[c]:
            self._end(c, conv.END_COMPLETE)
        elif tool is not None and out != list(tool):
            self._end(c, conv.END_TOOL_DIVERGED)
        else:
            if not self.prefix_exact[c]:
                self.answers.setdefault(c, []).append(np.asarray(out, dtype=np.int32))
            nxt = self._next_prompt(c, prompt, out, k)
            if self.max_prompt_tokens and len(nxt) > self.max_prompt_tokens:
                self._end(c, conv.END_TOO_LONG)
            else:
                self.prompt[c] = nxt

    def _end(self, c: int, why: str) -> None:
        self.end[c] = why
        self.prompt[c] = None
        self.answers.pop(c, None)

    def replay(self, index: journal.Index, search_stale=None) -> None:
        """Walk the journal turn by turn (one fetch per turn depth); what is not journaled for
        good (a refusal that does not blame the prompt is asked again, as in a plain shard)
        becomes the pending items. `search_stale(index, keys)`: look for missing keys among the
        records the shard's compaction set aside."""
        frontier = list(range(len(self)))
        while frontier:
            items = {c: self._item(c) for c in frontier}
            ks = [it.key for it in items.values()]
            if search_stale is not None:
                search_stale(index, [k for k in ks if not index.has(k)])
            again = index.ask_again(ks, self.prompt_at_fault)
            have = [c for c in frontier if index.done(items[c].key, again)]
            for c in frontier:
                if c not in have:
                    self._wait(c, items[c])
            if not have:
                break
            frontier = []
            for start in range(0, len(have), FETCH_ROWS):  # records decoded a batch at a time
                part = have[start : start + FETCH_ROWS]
                ks = list(dict.fromkeys(items[c].key for c in part))
                recs = dict(zip(ks, journal.table_to_records(index.fetch(ks)), strict=True))
                for c in part:
                    self.from_journal += 1
                    self.advance(c, items[c].key, recs[items[c].key])
                    if self.end[c] is None:
                        frontier.append(c)
            del items

    def _wait(self, c: int, item: Item) -> Item | None:
        """Conversation c waits for item's answer; returns the item when it is new."""
        first = item.key not in self.waiting
        self.waiting.setdefault(item.key, []).append(c)
        if first:
            self.items[item.key] = item
            return item
        return None

    def pending(self) -> list[Item]:
        """Items of turns not answered yet (the engine restart loop asks again)."""
        return list(self.items.values())

    def follow(self, rec: dict, index: journal.Index | None = None) -> list[Item]:
        """An answer came back: advance the conversations that waited for it and return the
        next turns to send (a next turn already journaled is taken from the journal)."""
        self.items.pop(rec["key"], None)
        out: list[Item] = []
        todo = [(c, rec["key"], rec) for c in self.waiting.pop(rec["key"], [])]
        while todo:
            c, key, r = todo.pop()
            self.advance(c, key, r)
            if self.end[c] is not None:
                continue
            item = self._item(c)
            if (
                index is not None
                and item.key not in self.waiting
                and index.done(item.key, index.ask_again([item.key], self.prompt_at_fault))
            ):
                fetched = journal.table_to_records(index.fetch([item.key]))[0]
                self.from_journal += 1
                todo.append((c, item.key, fetched))
                continue
            new = self._wait(c, item)
            if new is not None:
                out.append(new)
        return out

    # -- output
    def order(self) -> list[int]:
        """Conversations in output order (prompt_id)."""
        return sorted(range(len(self)), key=self.prompt_ids.__getitem__)

    def answered_keys(self) -> list[str]:
        """Every turn's key, output order (prompt_id, turn), each once."""
        return list(dict.fromkeys(k for c in self.order() for k in self.turn_keys[c]))

    def turns_left(self) -> int:
        """Turns not answered yet of the conversations still going (at most: a conversation
        can end early)."""
        return sum(
            n - len(ks)
            for n, ks, end in zip(self.num_turns, self.turn_keys, self.end, strict=True)
            if end is None
        )

    def counts(self) -> dict:
        ends = collections.Counter(e or "unfinished" for e in self.end)
        return {
            "conversations": len(self),
            "prefix_exact_conversations": sum(1 for e in self.prefix_exact if e),
            "turns_total": sum(self.num_turns),
            "turns_answered": sum(len(ks) for ks in self.turn_keys),
            "turns_generated_ok": self.turns_ok,
            "turns_from_journal": self.from_journal,
            "conversation_ends": dict(sorted(ends.items())),
        }

    def ok_turns(self, c: int) -> int:
        """How many of conversation c's answered turns were answered (the rest: its last, when
        a refusal or an engine error ended it)."""
        return len(self.turn_keys[c]) - (1 if c in self.failed else 0)

    def write(self, job: Job, frame: OutputFrame) -> tuple[int, int]:
        """Generated turns and rejected conversations, prompt_id order, in job.args.out and
        job.args.rejected, streamed: the turns' records are read from the journal and their
        prompts from the scratch file FETCH_ROWS turns at a time, and cut into row groups
        (contracts.RowGroupBuffer, bounded in rows and in prompt tokens). Returns (turn rows,
        rejected rows). Every conversation is counted once: kept (one or more turn rows) or
        rejected (its first turn was refused)."""
        index = job.index
        gen_w = contracts.ParquetWriter(
            job.args.out, contracts.GENERATED_TURNS, "generate", frame.metadata
        )
        rej_w = contracts.ParquetWriter(
            job.args.rejected, contracts.REJECTED, "generate", frame.metadata
        )
        kept = 0
        with gen_w, rej_w:
            gen_buf = contracts.RowGroupBuffer(gen_w.write, "turn_prompt_ids")
            rej_buf = contracts.RowGroupBuffer(rej_w.write, None)
            batch: list[tuple[int, int]] = []  # (conversation, turn)
            rejected: list[dict] = []

            def flush():
                if batch:
                    gen_buf.add(self._turn_rows(index, batch))
                    batch.clear()
                if rejected:
                    rej_buf.add(contracts.rejected_table(rejected))
                    rejected.clear()

            for c in self.order():
                if self.end[c] is None:
                    raise RuntimeError(f"conversation {self.prompt_ids[c]} did not finish")
                n_ok = self.ok_turns(c)
                if not n_ok:
                    last = self.failed[c]
                    record = {"sample_key": self.turn_keys[c][-1], "turn": 0,
                              "num_prompt_tokens": last["num_prompt_tokens"]}  # fmt: skip
                    reason = REASONS.get(last["status"], REASONS[REJECTED])
                    rejected.append(
                        rejected_row(job, reason, last["message"], self.prompt_ids[c], record)
                    )
                    if len(rejected) >= FETCH_ROWS:
                        flush()
                    continue
                kept += 1
                for k in range(n_ok):
                    batch.append((c, k))
                    if len(batch) >= FETCH_ROWS:
                        flush()
            flush()
            for buf, writer in ((gen_buf, gen_w), (rej_buf, rej_w)):
                buf.finish()
                writer.write_schema_if_empty()
            frame.check(kept, rej_w.rows)
            # counted in conversations, known only now: written at close
            for writer in (gen_w, rej_w):
                writer.add_metadata(
                    {contracts.META_KEPT: kept, contracts.META_REJECTED: rej_w.rows}
                )
        return gen_w.rows, rej_w.rows

    def _turn_rows(self, index: journal.Index, batch: list[tuple[int, int]]) -> pa.Table:
        """GENERATED_TURNS rows of (conversation, turn) pairs: the record from the journal,
        the prompt from the scratch file."""
        ks = [self.turn_keys[c][k] for c, k in batch]
        uniq = list(dict.fromkeys(ks))
        table = index.fetch(uniq)
        if len(uniq) != len(ks):
            pos = {key: j for j, key in enumerate(uniq)}
            table = table.take(pa.array([pos[key] for key in ks], pa.int64()))
        prompts = [self.spill.get(self.turn_places[c][k]) for c, k in batch]
        offsets = np.zeros(len(prompts) + 1, np.int32)
        np.cumsum([len(p) for p in prompts], out=offsets[1:])
        values = np.concatenate(prompts) if prompts else np.zeros(0, np.int32)
        cols = {name: table.column(name) for name in contracts.GENERATED.names
                if name not in ("prompt_id", "sample_key")}  # fmt: skip
        cols["prompt_id"] = pa.array([self.prompt_ids[c] for c, _ in batch], pa.string())
        cols["sample_key"] = pa.array(ks, pa.string())
        cols["turn"] = pa.array([k for _, k in batch], pa.int32())
        cols["turn_prompt_ids"] = pa.ListArray.from_arrays(
            pa.array(offsets), pa.array(values, pa.int32())
        )
        cols["prefix_exact"] = pa.array([self.prefix_exact[c] for c, _ in batch], pa.bool_())
        cols["conversation_end"] = pa.array([self.end[c] for c, _ in batch], pa.string())
        return pa.table({name: cols[name] for name in contracts.GENERATED_TURNS.names})


async def run(
    args, gen: GenerationSettings, tok_cfg: TokenizerSettings, meta: dict, t0: float | None = None
) -> int:
    """`tokenmill generate` for a conversation shard: the job core (generate/job.py) with the
    turn loop as its frontier."""
    # Every record of the shard's journal files is indexed: a turn's key is known only once
    # the turn before it was answered.
    job = open_job(args, gen, tok_cfg, meta, t0, lambda shard, pre_rejected: None)
    index, sj = job.index, job.sj
    spill = None
    try:
        stop_ids, _ = resolve_stop_ids(gen, tok_cfg, args.basedir, job.shard.metadata)
        spill = TurnPrompts(Path(args.out).parent)
        convs = Conversations(
            args.tokenized, job.fingerprint, gen.seed_policy, stop_ids, tok_cfg,
            args.basedir, job.api.prompt_at_fault, spill,
        )  # fmt: skip
        convs.replay(index, sj.search_stale)
        missing = convs.pending()
        if missing and convs.needs_tokenizer():
            # Loaded now, in the start-up, not at the first answer that needs it: the
            # generation window (generation_s, the tok/s of the statistics) is the engine's.
            t_tok = time.monotonic()
            convs.tokenizer()
            job.clock["tokenizer_s"] = time.monotonic() - t_tok
        job.clock["replayed"] = time.monotonic()
        job.counts.update(
            conversations=len(convs), from_journal=convs.from_journal,
            to_generate_now=len(missing),
        )  # fmt: skip
        meta.update(
            common_meta(job), context=contracts.CONTEXT_REGENERATED,
            journal={"dir": str(args.journal_dir), "compaction": None},
        )  # fmt: skip
        if missing:
            await generate(
                job, missing, frontier=convs.pending, follow=lambda rec: convs.follow(rec, index)
            )
        del missing
        t_write = time.monotonic()
        context = {contracts.META_CONTEXT: contracts.CONTEXT_REGENERATED}
        frame = OutputFrame(job, len(convs), context, counts=False)
        turns, rejected = convs.write(job, frame)
        index.close()  # compaction deletes the JSONL files it read
        meta["journal"]["compaction"] = compact(
            sj, convs.answered_keys(), args.category, job.shard.num_shards
        )
        job.counts.update(convs.counts(), kept_turns=turns, rejected=rejected)
        job.counts.setdefault("requested", 0)
        finish_timing(job, t_write)
        log.info("shard %s/%s done: %s", args.category, args.shard,
                 json.dumps(job.counts, sort_keys=True))  # fmt: skip
    finally:
        index.close()
        if spill is not None:
            spill.close()
    return 0


def compact(sj: journal.ShardJournal, turn_keys: list[str], category: str, num_shards):
    """Fold the shard's journal into {shard}.parquet as a plain shard does (prompts.write):
    once every conversation ended, the shard's keys are known (every turn's); records of other
    keys (edited conversations, older settings) go to the stale file."""
    index = sj.open(set(turn_keys))
    try:
        sj.search_stale(index, set(turn_keys) - index.entries.keys())
        if not sj.needs_compaction(index):
            return None
        compaction = journal.Compaction(sj, index, category)
        try:
            have = [k for k in turn_keys if index.has(k)]  # engine errors are not journaled
            for start in range(0, len(have), FETCH_ROWS):
                compaction.add(index.fetch(have[start : start + FETCH_ROWS]))
        except BaseException:
            compaction.abort()
            raise
        return commit_compaction(compaction, num_shards)
    finally:
        index.close()
