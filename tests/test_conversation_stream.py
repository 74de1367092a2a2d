"""Conversation shards stream (issue 19 item 5): the turn loop holds the prompts of the
conversations in flight only, and merge writes a conversation shard by row group."""

from __future__ import annotations

import json
from pathlib import Path

import fake_sglang
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill import contracts, engines, keys
from tokenmill.dataset import merge, validate
from tokenmill.engines.launch import free_port
from tokenmill.generate import conversations, journal

STOP = 2
THINK_END = 4


def conversation_shard(path: Path, n: int, turns: int) -> None:
    """n distinct prefix-exact conversations of `turns` turns (ids >= 1000: not small ints)."""
    rows = []
    for c in range(n):
        prompt = [1000 + c, *range(1100, 1140)]
        rows.append({
            "prompt_id": f"{c:032x}", "prompt_ids": prompt, "num_prompt_tokens": len(prompt),
            "num_turns": turns, "prefix_exact": True,
            "turn_segments": [[1005, 1006, 1100 + k, 1007] for k in range(turns - 1)],
            "tool_call_ids": [None] * turns, "messages": "[]", "tools": None,
        })  # fmt: skip
    meta = {contracts.META_CONTEXT: "regenerated", contracts.META_MAX_PROMPT_TOKENS: "100000"}
    schema = contracts.TOKENIZED_CONVERSATIONS
    contracts.write_table(pa.Table.from_pylist(rows, schema=schema), path, schema, "tokenize", meta)


def non_exact_shards(tmp: Path, conversations: int, turns: int, output_len: int):
    """(tokenized, generated): a conversation shard (prefix_exact false) and its generated turn
    rows, as a template that drops earlier turns' reasoning makes them: turn k's prompt is the
    first prompt plus, for each earlier turn, a 4-token segment and the answer part of its
    output; outputs are reasoning, THINK_END, answer, STOP. Keys as generate computes them.
    (bench_conversation_memory.py --template non-exact measures merge on it.)"""
    tok_rows, gen_rows = [], []
    output_len = max(output_len, 8)
    for c in range(conversations):
        pid = f"{c:032x}"
        first = [1000 + c % 500, 1000 + c // 500 % 500, *range(10, 60)]
        tok_rows.append({
            "prompt_id": pid, "prompt_ids": first, "num_prompt_tokens": len(first),
            "num_turns": turns, "prefix_exact": False, "turn_segments": None,
            "tool_call_ids": [None] * turns, "messages": "[]", "tools": None,
        })  # fmt: skip
        prompt = list(first)
        for k in range(turns):
            answer = [300 + (c + k) % 200] * (output_len // 4)
            output = [200 + k % 50] * (output_len - len(answer) - 2) + [THINK_END, *answer, STOP]
            gen_rows.append({
                "prompt_id": pid, "output_ids": output, "finish_type": "stop",
                "finish_matched_id": STOP, "turn": k, "turn_prompt_ids": list(prompt),
                "prefix_exact": False,
                "conversation_end": "last_turn" if k == turns - 1 else "continues",
            })  # fmt: skip
            prompt += [5, 6, 100 + k % 100, 7, *answer, STOP]
    meta = {contracts.META_CONTEXT: "regenerated", contracts.META_MAX_PROMPT_TOKENS: "100000000"}
    tokenized, generated = tmp / "000.parquet", tmp / "generated.parquet"
    schema = contracts.TOKENIZED_CONVERSATIONS
    contracts.write_table(pa.Table.from_pylist(tok_rows, schema=schema), tokenized, schema,
                          "tokenize", meta)  # fmt: skip
    prompts = pa.array([r["turn_prompt_ids"] for r in gen_rows], pa.list_(pa.int32()))
    for row, key in zip(gen_rows, keys.sample_keys("fp-non-exact", prompts), strict=True):
        row["sample_key"] = key
    meta = {contracts.META_CONTEXT: "regenerated",
            contracts.META_GENERATION_FINGERPRINT: "fp-non-exact"}  # fmt: skip
    schema = contracts.GENERATED_TURNS
    contracts.write_table(pa.Table.from_pylist(gen_rows, schema=schema), generated, schema,
                          "generate", meta)  # fmt: skip
    return tokenized, generated


def test_a_turns_prompt_is_not_held_once_answered(tmp_path):
    """The real runner (replay, follow, the journal), answers taken last-in first-out so that
    one conversation is in flight at a time: at every answer at most that one conversation
    holds a prompt; every turn's prompt is read back exactly from the scratch file; after the
    last answer the runner holds no prompt, answer or item."""
    n, turns = 40, 6
    path = tmp_path / "conv.parquet"
    conversation_shard(path, n, turns)
    api = engines.for_config({"engine": "sglang"})
    spill = conversations.TurnPrompts(tmp_path)
    convs = conversations.Conversations(
        path, "fp", "none", [STOP], None, ".", api.prompt_at_fault, spill
    )
    sj = journal.ShardJournal(tmp_path / "journal", "mt", "000")
    index = sj.open(None)
    convs.replay(index)
    stack = convs.pending()[::-1]
    assert len(stack) == n
    writer, append = sj.writer(index)
    sent: dict[str, list[int]] = {}
    with writer:
        while stack:
            item = stack.pop()
            sent[item.key] = item.prompt_ids
            out = [1200 + (sum(item.prompt_ids) + i) % 500 for i in range(30)] + [STOP]
            rec = {"key": item.key, "status": "ok", "prompt_id": item.prompt_id,
                   "output_ids": out, "finish_type": "stop"}  # fmt: skip
            append(rec)
            stack.extend(convs.follow(rec, index)[::-1])
            holding = [c for c in range(n) if convs.prompt[c] is not None]
            assert len(holding) <= 1, holding
            assert not convs.answers
    index.close()
    assert convs.end == [conversations.conv.END_COMPLETE] * n
    assert all(p is None for p in convs.prompt)
    assert not convs.items and not convs.waiting and not convs.answers
    assert sum(len(k) for k in convs.turn_keys) == n * turns == len(sent)
    for c in range(n):
        got = [spill.get(place).tolist() for place in convs.turn_places[c]]
        assert got == [sent[k] for k in convs.turn_keys[c]]
        assert all(got[k + 1][: len(got[k])] == got[k] for k in range(turns - 1))
    spill.close()


def test_generate_and_merge_write_a_conversation_shard_by_row_group(tmp_path, monkeypatch):
    """A real generate (the CLI's code in this process, the stand-in server) and merge, with
    row groups bounded at 4,096 tokens and merge reading 50 turn rows at a time: both files
    have many row groups, none over the bound by more than its last row, and merge's rows are
    those of a merge that reads and writes the shard in one piece."""
    from tokenmill.generate import stage

    n, turns = 120, 4
    tokenized = tmp_path / "000.parquet"
    conversation_shard(tokenized, n, turns)
    port = free_port()
    server = fake_sglang.start(port, "--output-len", "40")
    try:
        gen = {
            "engine": "sglang", "mode": "external", "model": "fake/model", "revision": None,
            "external": {"urls": [f"http://127.0.0.1:{port}"]},
            "sampling": {"max_new_tokens": 64, "temperature": 0.0}, "stop_tokens": [STOP],
            "seed_policy": "none", "concurrency": 16, "request_timeout_s": 60,
            "retry": {"max_attempts": 3, "backoff_initial_s": 0.05, "backoff_max_s": 0.5},
            "progress_interval_s": 3600,
        }  # fmt: skip
        generated = tmp_path / "generated.parquet"
        argv = [
            "--generation-config", json.dumps(gen), "--tokenizer-config", '{"path": "unused"}',
            "--category", "mt", "--shard", "000", "--tokenized", str(tokenized),
            "--out", str(generated), "--rejected", str(tmp_path / "grej.parquet"),
            "--meta", str(tmp_path / "meta.json"), "--journal-dir", str(tmp_path / "journal"),
            "--log-dir", str(tmp_path / "logs"),
        ]  # fmt: skip
        monkeypatch.setattr(contracts, "ROW_GROUP_TOKENS", 4096)
        assert stage.main(argv) == 0
    finally:
        server.kill()
        server.wait(timeout=10)
    g = pq.ParquetFile(generated)
    assert g.metadata.num_rows == n * turns and g.num_row_groups > 3
    t = g.read()
    assert t.column("turn").to_pylist() == list(range(turns)) * n
    assert t.column("prompt_id").to_pylist() == sorted(t.column("prompt_id").to_pylist())

    rules = validate.Rules(vocab_size=4096, stop_ids=(STOP,))
    fp = contracts.read_metadata(generated)[contracts.META_GENERATION_FINGERPRINT]

    def merged(name: str) -> pq.ParquetFile:
        out, rej = tmp_path / f"{name}.parquet", tmp_path / f"{name}.rej.parquet"
        res = merge.merge_shard(tokenized, generated, out, rej, rules, fp, "mt", "000")
        assert (res.kept, res.rejected) == (n, 0)
        return pq.ParquetFile(tmp_path / f"{name}.parquet")

    monkeypatch.setattr(merge, "BATCH_ROWS", 50)
    streamed = merged("streamed")
    assert streamed.num_row_groups > 3
    for i in range(streamed.num_row_groups):
        lengths = np.diff(
            streamed.read_row_group(i, columns=["input_ids"])[0].combine_chunks().offsets
        )
        assert lengths[:-1].sum() < 4096, (i, lengths)
    monkeypatch.setattr(merge, "BATCH_ROWS", 1 << 30)
    monkeypatch.setattr(contracts, "ROW_GROUP_TOKENS", 1 << 30)
    whole = merged("whole")
    assert whole.num_row_groups == 1
    assert streamed.read().equals(whole.read())
    assert streamed.schema_arrow.metadata == whole.schema_arrow.metadata


def test_merge_reads_a_non_prefix_exact_shard_in_token_bounded_batches(tmp_path, monkeypatch):
    """Turn rows of a template that is not prefix-exact hold their whole prompt (tokens grow
    with the square of the turns): merge's batches end at contracts.ROW_GROUP_TOKENS tokens, not
    only at BATCH_ROWS rows, and the rows and loss-token counts are those of a
    merge that reads the shard in one piece."""
    from tokenmill.dataset import draft_vocab

    tokenized, generated = non_exact_shards(tmp_path, 40, 8, 64)
    rules = validate.Rules(vocab_size=2048, stop_ids=(STOP,), think_end_id=THINK_END,
                           max_sequence_tokens=1 << 20)  # fmt: skip
    batch_tokens = []
    take = merge._RowGroupColumn.take

    def spy(self, rows, batch_no):
        out = take(self, rows, batch_no)
        if self.column == "turn_prompt_ids":
            batch_tokens.append(int(pa.compute.sum(pa.compute.list_value_length(out)).as_py()))
        return out

    def merged(name: str):
        out = tmp_path / f"{name}.parquet"
        res = merge.merge_shard(tokenized, generated, out, tmp_path / f"{name}.rej.parquet",
                                rules, "fp-non-exact", "mt", "000",
                                counts_out=tmp_path / f"{name}.counts.parquet")  # fmt: skip
        assert (res.kept, res.rejected) == (40 * 8, 0)
        return pq.read_table(out), pq.read_table(tmp_path / f"{name}.counts.parquet")

    monkeypatch.setattr(merge._RowGroupColumn, "take", spy)
    monkeypatch.setattr(contracts, "ROW_GROUP_TOKENS", 4096)
    streamed, streamed_counts = merged("streamed")
    longest = max(
        sum(len(p) for p in conv)
        for conv in [pq.read_table(generated).column("turn_prompt_ids").to_pylist()[i : i + 8]
                     for i in range(0, 320, 8)]
    )  # fmt: skip
    # one pass (validation and rows together) in batches of whole conversations: each below
    # the bound plus one conversation, and more than one batch
    assert len(batch_tokens) > 4 and max(batch_tokens) < 4096 + longest, batch_tokens
    monkeypatch.setattr(contracts, "ROW_GROUP_TOKENS", 1 << 30)
    batch_tokens.clear()
    whole, whole_counts = merged("whole")
    assert len(batch_tokens) == 1  # one batch, read once
    assert streamed.equals(whole) and streamed_counts.equals(whole_counts)
    counts, rows = draft_vocab.count_dataset(tmp_path / "whole.parquet", 2048, batch_size=7)
    assert rows == 320 and int(counts.sum()) == int(
        sum(sum(m) for m in whole.column("loss_mask").to_pylist())
    )
