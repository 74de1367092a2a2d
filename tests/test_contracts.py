"""contracts: the metadata keys, the rejected-row constructor, the conservation check and the
list-array helper that every stage shares; model: the config.json vocabulary size."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from tokenmill import contracts, model


def test_metadata_keys_keep_their_values():
    """The keys are on disk in every file written so far: their values never change."""
    assert contracts.COUNT_KEYS == (
        "tokenmill.records_in",
        "tokenmill.kept",
        "tokenmill.rejected",
    )
    assert contracts.MERGE_COUNT_KEYS == (
        "tokenmill.records_in",
        "tokenmill.records_kept",
        "tokenmill.records_rejected",
    )
    assert contracts.META_STOP_TOKEN_IDS == "tokenmill.stop_token_ids"
    assert contracts.META_JOURNAL_RECORDS_IN == "tokenmill.journal_records_in"
    assert contracts.META_SOURCE_RECORDS == "tokenmill.source_records"
    assert contracts.META_COUNTS_SCOPE == "tokenmill.counts_scope"
    keys = [v for k, v in vars(contracts).items() if k.startswith("META_")]
    assert len(keys) == len(set(keys)), "two constants name one key"
    assert all(k.startswith("tokenmill.") for k in keys)


def test_rejected_row_is_the_one_constructor():
    row = contracts.rejected_row(
        "merge", "chat", "too_long", "13 > 12", "chat/000", "p", {"b": 1, "a": [2]}
    )
    assert row == {
        "stage": "merge",
        "category": "chat",
        "reason": "too_long",
        "detail": "13 > 12",
        "source": "chat/000",
        "prompt_id": "p",
        "record": '{"a":[2],"b":1}',  # canonical JSON
    }
    raw = contracts.rejected_row("prepare", "chat", "bad_json", record='{"b": 1')  # text: as is
    assert raw["record"] == '{"b": 1' and raw["prompt_id"] is None
    table = contracts.rejected_table([row, raw])
    assert table.schema == contracts.REJECTED and table.num_rows == 2
    with pytest.raises(ValueError, match="reason"):
        contracts.rejected_row("merge", "chat", "")


def test_conservation_and_count_metadata():
    contracts.check_conservation("tokenize chat/000", 5, 3, 2)
    with pytest.raises(
        contracts.ConservationError, match=r"tokenize chat/000: .*in=5 != kept=3 \+ rejected=1"
    ):
        contracts.check_conservation("tokenize chat/000", 5, 3, 1)
    assert contracts.count_metadata(5, 3, 2) == {
        "tokenmill.records_in": "5",
        "tokenmill.kept": "3",
        "tokenmill.rejected": "2",
    }
    merge_meta = contracts.count_metadata(5, 3, 2, keys=contracts.MERGE_COUNT_KEYS)
    assert merge_meta["tokenmill.records_kept"] == "3"
    with pytest.raises(contracts.ConservationError, match="merge x"):
        contracts.count_metadata(5, 3, 3, what="merge x")


def test_list_arrays():
    col = pa.array([[1, 2], None, [3, 4, 5], [], [6]], pa.list_(pa.int32()))
    values, offsets = contracts.list_arrays(col)
    assert values.dtype == np.dtype("<i4") and values.tolist() == [1, 2, 3, 4, 5, 6]
    assert offsets.tolist() == [0, 2, 2, 5, 5, 6]  # null: an empty row
    values, offsets = contracts.list_arrays(col.slice(2, 2))
    assert (values.tolist(), offsets.tolist()) == ([3, 4, 5], [0, 3, 3])
    chunked = pa.chunked_array([col.slice(0, 2), col.slice(2)])
    assert contracts.list_arrays(chunked)[0].tolist() == [1, 2, 3, 4, 5, 6]
    mask = pa.array([[0, 1]], pa.list_(pa.int8()))
    assert contracts.list_arrays(mask, dtype=None)[0].dtype == np.int8
    empty_values, empty_offsets = contracts.list_arrays(col.slice(0, 0))
    assert empty_values.size == 0 and len(empty_offsets) == 1


def test_model_vocab_size(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": 123}))
    assert model.model_vocab_size("m", tmp_path) == (123, str(tmp_path / "m" / "config.json"))
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 9}}))
    assert model.model_vocab_size("mm", tmp_path)[0] == 9
    assert model.model_vocab_size("nobody/nothing", tmp_path)[0] is None
    assert model.model_vocab_size(None)[0] is None


def test_row_groups_end_at_rows_or_with_the_row_that_reaches_the_tokens(tmp_path, monkeypatch):
    import pyarrow.parquet as pq

    lengths = [3, 3, 3, 1, 1, 20, 1, 1, 1, 1, 1]
    # 3+3+3 reaches 10 only with the 4th row; the 20-token row closes a group; then 4 rows
    assert contracts.row_group_ends(np.array(lengths), 4, 10) == [4, 6, 10, 11]
    assert contracts.row_group_ends(np.zeros(9, np.int64), 4, 10) == [4, 8, 9]
    assert contracts.row_group_ends(np.zeros(0, np.int64), 4, 10) == []
    # Every writer of a contract cuts the same way, whatever the batches it is handed.
    monkeypatch.setattr(contracts, "ROW_GROUP_SIZE", 4)
    monkeypatch.setattr(contracts, "ROW_GROUP_TOKENS", 10)
    rows = [
        {"prompt_id": f"p{i}", "sample_key": "k", "output_ids": [7] * n}
        for i, n in enumerate(lengths)
    ]
    cols = {f.name: [r.get(f.name) for r in rows] for f in contracts.GENERATED}
    table = pa.table(cols, schema=contracts.GENERATED)
    path = tmp_path / "g.parquet"
    contracts.write_table(table, path, contracts.GENERATED, "generate")
    pf = pq.ParquetFile(path)
    sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
    assert sizes == [4, 2, 4, 1]
    got = []
    buf = contracts.RowGroupBuffer(got.append, "output_ids")
    for part in (table.slice(0, 5), table.slice(5, 1), table.slice(6)):
        buf.add(part)
    buf.finish()
    assert [t.num_rows for t in got] == sizes
    # Rows without token lists (prompts, rejected rows) are cut at ROW_GROUP_SIZE rows only.
    assert contracts.row_tokens(pa.table({"prompt_id": ["a", "b"]})).tolist() == [0, 0]
