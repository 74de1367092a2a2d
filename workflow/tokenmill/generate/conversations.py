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
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time

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


class Conversations:
    """The conversations of one shard and where each one stands."""

    def __init__(self, path, fingerprint: str, seed_policy: str, stop_ids, tok_cfg, basedir,
                 prompt_at_fault):  # fmt: skip
        meta = contracts.read_metadata(path)
        self.rows = pq.read_table(path).to_pylist()
        self.fingerprint, self.seed_policy = fingerprint, seed_policy
        self.stop_ids = list(stop_ids)
        te = meta.get(contracts.META_THINK_END_ID)
        self.think_end_id = int(te) if te else None
        mpt = meta.get(contracts.META_MAX_PROMPT_TOKENS)
        self.max_prompt_tokens = int(mpt) if mpt else None
        self.tok_cfg, self.basedir = tok_cfg, basedir
        # The engine's rule for which journaled refusals are final (journal.Index.ask_again).
        self.prompt_at_fault = prompt_at_fault
        self._tokenizer = None
        n = len(self.rows)
        self.turns: list[list[dict]] = [[] for _ in range(n)]  # {"prompt", "key", "rec"}
        self.end: list[str | None] = [None] * n
        self.prompt: list[list[int]] = [r["prompt_ids"] for r in self.rows]  # the next turn's
        self.waiting: dict[str, list[int]] = {}  # key -> conversations waiting for it
        self.items: dict[str, Item] = {}  # key -> the item of a turn not answered yet
        self.from_journal = 0

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
            not row["prefix_exact"] and end is None
            for row, end in zip(self.rows, self.end, strict=True)
        )

    def _next_prompt(self, c: int) -> list[int]:
        row, done = self.rows[c], self.turns[c]
        k = len(done) - 1
        if row["prefix_exact"]:
            return done[k]["prompt"] + list(done[k]["rec"]["output_ids"]) + row["turn_segments"][k]
        tok = self.tokenizer()
        answers = {}
        for j, t in enumerate(done):
            tool = row["tool_call_ids"][j]
            # A tool-call turn continues only when the model's ids equal the dataset's: its
            # message (with tool_calls) renders to those ids, no parser needed.
            answers[j] = (
                None
                if tool is not None
                else conv.model_message(tok, t["rec"]["output_ids"], self.stop_ids,
                                        self.think_end_id)
            )  # fmt: skip
        messages = conv.messages_with_answers(json.loads(row["messages"]), answers)
        kwargs = thaw(self.tok_cfg.chat_template_kwargs)
        return conv.render(tok, messages, conv.load_json(row["tools"]), True, kwargs)

    def _item(self, c: int) -> Item:
        prompt = self.prompt[c]
        key = keys.sample_key(self.fingerprint, prompt)
        seed = keys.sampling_seed(key) if self.seed_policy == "per_sample" else None
        return Item(self.rows[c]["prompt_id"], key, prompt, seed)

    # -- progress
    def advance(self, c: int, key: str, rec: dict) -> None:
        """Turn len(turns[c]) of conversation c was answered by `rec`: record it, then end the
        conversation or set its next prompt."""
        row = self.rows[c]
        k = len(self.turns[c])
        if rec["status"] != OK:
            self.end[c] = conv.END_REJECTED if rec["status"] == REJECTED else conv.END_ERROR
            self.turns[c].append({"prompt": self.prompt[c], "key": key, "rec": rec})
            return
        self.turns[c].append({"prompt": self.prompt[c], "key": key, "rec": rec})
        out = list(rec["output_ids"])
        tool = row["tool_call_ids"][k]
        if not out or out[-1] not in self.stop_ids:
            self.end[c] = conv.END_TRUNCATED
        elif k + 1 >= row["num_turns"]:
            self.end[c] = conv.END_COMPLETE
        elif tool is not None and out != list(tool):
            self.end[c] = conv.END_TOOL_DIVERGED
        else:
            nxt = self._next_prompt(c)
            if self.max_prompt_tokens and len(nxt) > self.max_prompt_tokens:
                self.end[c] = conv.END_TOO_LONG
            else:
                self.prompt[c] = nxt

    def replay(self, index: journal.Index, search_stale=None) -> None:
        """Walk the journal turn by turn (one fetch per turn depth); what is not journaled for
        good (a refusal that does not blame the prompt is asked again, as in a plain shard)
        becomes the pending items. `search_stale(index, keys)`: look for missing keys among the
        records the shard's compaction set aside."""
        frontier = list(range(len(self.rows)))
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
            ks = list(dict.fromkeys(items[c].key for c in have))
            recs = dict(zip(ks, journal.table_to_records(index.fetch(ks)), strict=True))
            frontier = []
            for c in have:
                self.from_journal += 1
                self.advance(c, items[c].key, recs[items[c].key])
                if self.end[c] is None:
                    frontier.append(c)

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
    def keys(self) -> list[str]:
        """Every turn's key, output order (prompt_id, turn), each once."""
        order = sorted(range(len(self.rows)), key=lambda i: self.rows[i]["prompt_id"])
        return list(dict.fromkeys(t["key"] for c in order for t in self.turns[c]))

    def counts(self) -> dict:
        ends = collections.Counter(e or "unfinished" for e in self.end)
        turns = sum(len(t) for t in self.turns)
        ok_turns = sum(1 for ts in self.turns for t in ts if t["rec"]["status"] == OK)
        exact = sum(1 for r in self.rows if r["prefix_exact"])
        return {
            "conversations": len(self.rows),
            "prefix_exact_conversations": exact,
            "turns_total": sum(r["num_turns"] for r in self.rows),
            "turns_answered": turns,
            "turns_generated_ok": ok_turns,
            "turns_from_journal": self.from_journal,
            "conversation_ends": dict(sorted(ends.items())),
        }

    def write(self, job: Job, frame: OutputFrame) -> tuple[int, int]:
        """Generated turns and rejected conversations, prompt_id order, in job.args.out and
        job.args.rejected. Returns (turn rows, rejected rows). Every conversation is counted
        once: kept (one or more turn rows) or rejected (its first turn was refused)."""
        gen_rows, rej_rows = [], []
        kept = 0
        for c in sorted(range(len(self.rows)), key=lambda i: self.rows[i]["prompt_id"]):
            row, end = self.rows[c], self.end[c]
            ok = [t for t in self.turns[c] if t["rec"]["status"] == OK]
            if end is None:
                raise RuntimeError(f"conversation {row['prompt_id']} did not finish")
            if not ok:
                last = self.turns[c][-1]
                record = {"sample_key": last["key"], "turn": 0,
                          "num_prompt_tokens": len(last["prompt"])}  # fmt: skip
                reason = REASONS.get(last["rec"]["status"], REASONS[REJECTED])
                detail = last["rec"].get("message")
                rej_rows.append(rejected_row(job, reason, detail, row["prompt_id"], record))
                continue
            kept += 1
            for k, t in enumerate(ok):
                r = t["rec"]
                gen_rows.append(
                    {**{name: r.get(name) for name in contracts.GENERATED.names},
                     "prompt_id": row["prompt_id"], "sample_key": t["key"], "turn": k,
                     "turn_prompt_ids": t["prompt"], "prefix_exact": row["prefix_exact"],
                     "conversation_end": end}
                )  # fmt: skip
        frame.check(kept, len(rej_rows))
        schema = contracts.GENERATED_TURNS
        contracts.write_table(
            pa.Table.from_pylist(gen_rows, schema=schema), job.args.out, schema, "generate",
            frame.metadata,
        )  # fmt: skip
        contracts.write_table(
            contracts.rejected_table(rej_rows), job.args.rejected, contracts.REJECTED,
            "generate", frame.metadata,
        )  # fmt: skip
        return len(gen_rows), len(rej_rows)


async def run(
    args, gen: GenerationSettings, tok_cfg: TokenizerSettings, meta: dict, t0: float | None = None
) -> int:
    """`tokenmill generate` for a conversation shard: the job core (generate/job.py) with the
    turn loop as its frontier."""
    # Every record of the shard's journal files is indexed: a turn's key is known only once
    # the turn before it was answered.
    job = open_job(args, gen, tok_cfg, meta, t0, lambda shard, pre_rejected: None)
    index, sj = job.index, job.sj
    try:
        stop_ids, _ = resolve_stop_ids(gen, tok_cfg, args.basedir, job.shard.metadata)
        convs = Conversations(
            args.tokenized, job.fingerprint, gen.seed_policy, stop_ids, tok_cfg,
            args.basedir, job.api.prompt_at_fault,
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
            conversations=len(convs.rows), from_journal=convs.from_journal,
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
        t_write = time.monotonic()
        context = {contracts.META_CONTEXT: contracts.CONTEXT_REGENERATED}
        frame = OutputFrame(job, len(convs.rows), context, counts=False)
        turns, rejected = convs.write(job, frame)
        index.close()  # compaction deletes the JSONL files it read
        meta["journal"]["compaction"] = compact(
            sj, convs.keys(), args.category, job.shard.num_shards
        )
        job.counts.update(convs.counts(), kept_turns=turns, rejected=rejected)
        job.counts.setdefault("requested", 0)
        finish_timing(job, t_write)
        log.info("shard %s/%s done: %s", args.category, args.shard,
                 json.dumps(job.counts, sort_keys=True))  # fmt: skip
    finally:
        index.close()
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
