"""Conversation shards stream (issue 19 item 5): the turn loop holds the prompts of the
conversations in flight only, and merge writes a conversation shard by row group."""

from __future__ import annotations

import json
from pathlib import Path

import fake_sglang
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill import contracts, engines
from tokenmill.dataset import merge, validate
from tokenmill.engines.launch import free_port
from tokenmill.generate import conversations, journal

STOP = 2


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

    monkeypatch.setattr(merge, "CONVERSATION_BATCH_ROWS", 50)
    streamed = merged("streamed")
    assert streamed.num_row_groups > 3
    for i in range(streamed.num_row_groups):
        lengths = np.diff(
            streamed.read_row_group(i, columns=["input_ids"])[0].combine_chunks().offsets
        )
        assert lengths[:-1].sum() < 4096, (i, lengths)
    monkeypatch.setattr(merge, "CONVERSATION_BATCH_ROWS", 1 << 30)
    monkeypatch.setattr(contracts, "ROW_GROUP_TOKENS", 1 << 30)
    whole = merged("whole")
    assert whole.num_row_groups == 1
    assert streamed.read().equals(whole.read())
    assert streamed.schema_arrow.metadata == whole.schema_arrow.metadata
