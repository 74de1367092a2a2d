"""Journal (crash-safe append-only records) and generation keys."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tokenmill import contracts, keys
from tokenmill.generate import journal

GEN = {
    "engine": "sglang",
    "mode": "managed",
    "model": "org/model",
    "revision": None,
    "launch": {
        "command": ["python", "-m", "sglang.launch_server", "--tp", "8", "--port", "{port}"]
    },
    "sampling": {"max_new_tokens": 64, "temperature": 0.7},
    "stop_tokens": ["<|im_end|>"],
    "seed_policy": "none",
    "concurrency": 8,
}


def _rec(key, status="ok", **kw):
    return {"key": key, "status": status, "prompt_id": "p", "output_ids": [1, 2], **kw}


def test_roundtrip_and_only_wanted_keys(tmp_path):
    with journal.JournalWriter(tmp_path, "cat", "000") as w:
        for i in range(5):
            w.append(_rec(f"{i:032x}"))
    found, stats = journal.load(tmp_path, "cat", {f"{i:032x}" for i in (1, 3, 9)})
    assert sorted(found) == [f"{i:032x}" for i in (1, 3)]
    assert found[f"{1:032x}"]["output_ids"] == [1, 2]
    assert stats == {"files": 1, "lines": 5, "torn": 0}


def test_torn_and_corrupt_lines_are_dropped(tmp_path):
    with journal.JournalWriter(tmp_path, "cat", "000") as w:
        for i in range(3):
            w.append(_rec(f"{i:032x}"))
        path = w.path
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    # corrupt line 0's payload (checksum no longer matches), tear the last line (no newline)
    bad0 = lines[0].replace(b"[1,2]", b"[1,3]")
    path.write_bytes(bad0 + lines[1] + lines[2][:-7])
    found, stats = journal.load(tmp_path, "cat", {f"{i:032x}" for i in range(3)})
    assert sorted(found) == [f"{1:032x}"]
    assert stats["torn"] == 2


def test_reads_all_files_of_category_and_result_beats_rejection(tmp_path):
    k = "a" * 32
    with journal.JournalWriter(tmp_path, "cat", "001") as w:
        w.append(_rec(k, status="rejected", message="too long"))
    with journal.JournalWriter(tmp_path, "cat", "002") as w:  # the prompt moved shard
        w.append(_rec(k))
    with journal.JournalWriter(tmp_path, "other", "001") as w:
        w.append(_rec("b" * 32))
    found, stats = journal.load(tmp_path, "cat", {k, "b" * 32})
    assert stats["files"] == 2
    assert found[k]["status"] == "ok"
    assert "b" * 32 not in found


def test_key_first_even_if_given_later_and_empty_writer_leaves_no_file(tmp_path):
    w = journal.JournalWriter(tmp_path, "cat", "000")
    w.append({"status": "ok", "key": "c" * 32})
    w.close()
    assert w.path.read_bytes().startswith(b'{"key":"' + b"c" * 32)
    empty = journal.JournalWriter(tmp_path, "cat", "000")
    empty.close()
    assert not empty.path.exists()


def test_records_survive_sigkill(tmp_path):
    code = (
        "import os, signal\n"
        "from tokenmill.generate import journal\n"
        f"w = journal.JournalWriter({str(tmp_path)!r}, 'cat', '000', fsync_interval_s=3600)\n"
        "for i in range(100):\n"
        "    w.append({'key': format(i, '032x'), 'status': 'ok', 'output_ids': [i]})\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -9
    found, _ = journal.load(tmp_path, "cat", {format(i, "032x") for i in range(100)})
    assert len(found) == 100


def test_fingerprint_ignores_output_irrelevant_flags_only():
    fp = keys.generation_fingerprint(GEN)
    same = {**GEN, "concurrency": 99, "launch": {"command": GEN["launch"]["command"][:-2]}}
    same["launch"]["command"] += ["--port=1234", "--log-level", "debug", "--enable-metrics"]
    assert keys.generation_fingerprint(same) == fp
    for change in (
        {"sampling": {"max_new_tokens": 64, "temperature": 0.8}},
        {"stop_tokens": ["<|im_end|>", 2]},
        {"seed_policy": "per_sample"},
        {"revision": "abc"},
        {"model": "org/other"},
        {"launch": {"command": ["python", "-m", "sglang.launch_server", "--tp", "4"]}},
    ):
        assert keys.generation_fingerprint({**GEN, **change}) != fp, change


def test_sample_key_and_seed():
    fp = keys.generation_fingerprint(GEN)
    k = keys.sample_key(fp, [1, 2, 3])
    assert len(k) == 32 and int(k, 16) >= 0
    assert keys.sample_key(fp, np.array([1, 2, 3], dtype=np.int32)) == k
    assert keys.sample_key(fp, [1, 2, 4]) != k
    assert keys.sample_key("0" * 64, [1, 2, 3]) != k
    seed = keys.sampling_seed(k)
    assert 0 <= seed < 2**63 and seed == int(k[:15], 16)


def test_journal_file_name_is_per_attempt(tmp_path):
    a = journal.JournalWriter(tmp_path, "cat", "007")
    b = journal.JournalWriter(tmp_path, "cat", "007")
    assert a.path != b.path
    assert a.path.name.startswith("007.") and f".{os.getpid()}." in a.path.name
    a.close()
    b.close()


# ---------------------------------------------------------------------------------------------
# Compacted records, row groups, the layout and its migration


def test_records_roundtrip_through_a_compacted_table():
    recs = [
        _rec("a" * 32, attempts=2, finish_message={"type": "stop"}, latency_s=0.25, x=[1, "y"]),
        {"key": "b" * 32, "status": "rejected", "prompt_id": "q", "message": "too long"},
    ]
    table = journal.records_to_table(recs)
    assert table.schema == journal.JOURNAL
    assert table.column("output_ids").to_pylist() == [[1, 2], None]
    assert journal.table_to_records(table) == recs


def test_row_groups_end_at_rows_or_tokens():
    import pyarrow as pa

    got = []
    buf = contracts.RowGroupBuffer(got.append, "output_ids", max_rows=4, max_tokens=10)
    for lengths in ([3, 3], [3, 1, 1], [20], [1, 1, 1, 1, 1]):
        buf.add(pa.table({"output_ids": [[7] * n for n in lengths]}))
    buf.finish()
    sizes = [[len(x) for x in t.column("output_ids").to_pylist()] for t in got]
    # 3+3+3 reaches 10 only with the 4th row; the 20-token row closes a group on its own
    assert sizes == [[3, 3, 3, 1], [1, 20], [1, 1, 1, 1], [1]]


def _hex(i: int) -> str:
    return f"{i * 2654435761 % 2**64:016x}{i:016x}"


def _layout_journal(tmp_path, n_shards: int, n: int = 60) -> dict[str, dict]:
    """Records of n prompts journaled the way an n_shards layout does: JSONL for some shards,
    a compacted file for shard 000, a rejection among them."""
    from tokenmill.tokenization import shards

    by_key = {}
    writers = {}
    compacted = []
    for i in range(n):
        pid = _hex(i)
        shard = shards.shard_name(shards.shard_of(pid, n_shards))
        rec = _rec(f"{i:032x}", prompt_id=pid, output_ids=[i, 2])
        if i % 13 == 4:
            rec = {"key": f"{i:032x}", "status": "rejected", "prompt_id": pid, "message": "no"}
        by_key[rec["key"]] = rec
        if shard == "000":
            compacted.append(rec)
            continue
        if shard not in writers:
            writers[shard] = journal.JournalWriter(tmp_path, "cat", shard)
        writers[shard].append(rec)
    for w in writers.values():
        w.close()
    import pyarrow.parquet as pq

    pq.write_table(journal.records_to_table(compacted), tmp_path / "cat" / "000.parquet")
    return by_key


def _by_shard(records: dict, n_shards: int) -> dict[str, set[str]]:
    from tokenmill.tokenization import shards

    out: dict[str, set[str]] = {}
    for key, rec in records.items():
        out.setdefault(shards.shard_name(shards.shard_of(rec["prompt_id"], n_shards)), set()).add(
            key
        )
    return out


def test_changed_shard_count_moves_each_record_to_its_shard_once(tmp_path):
    records = _layout_journal(tmp_path, 2)
    # a journal from before the layout file: its records already sit in their shards
    first = journal.ensure_layout(tmp_path, "cat", 2)
    assert first["records_moved"] == 0 and first["files_moved"] == 0
    assert journal.ensure_layout(tmp_path, "cat", 2) is None  # one small file read, no lock

    stats = journal.ensure_layout(tmp_path, "cat", 3)
    assert stats["from_shards"] == 2 and stats["to_shards"] == 3
    assert stats["records_moved"] > 0
    for shard, wanted in _by_shard(records, 3).items():
        found, _ = journal.load(tmp_path, "cat", set(records), shard=shard)
        assert set(found) == wanted, shard
        assert all(found[k] == records[k] for k in wanted)
    assert journal.ensure_layout(tmp_path, "cat", 3) is None  # paid once
    manifest = journal.read_manifest(tmp_path / "cat")
    assert manifest["num_shards"] == 3 and len(manifest["migrations"]) == 2


MIGRATE_KILLED_AT = """
import os, signal, sys
root, n = sys.argv[1], int(sys.argv[2])
seen = [0]

def killing(fn):
    def inner(*a, **k):
        if str(a[0]).startswith(root):
            seen[0] += 1
            if seen[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
        return fn(*a, **k)
    return inner

os.replace, os.unlink = killing(os.replace), killing(os.unlink)
from tokenmill.generate import journal
journal.ensure_layout(root, "cat", 3)
"""


def test_migration_survives_a_kill_at_every_step(tmp_path):
    import shutil

    records = _layout_journal(tmp_path / "j", 2)
    journal.ensure_layout(tmp_path / "j", "cat", 2)
    snapshot = tmp_path / "snapshot"
    shutil.copytree(tmp_path / "j", snapshot)
    steps = 0
    for n in range(1, 30):
        shutil.rmtree(tmp_path / "j")
        shutil.copytree(snapshot, tmp_path / "j")
        argv = [sys.executable, "-c", MIGRATE_KILLED_AT, str(tmp_path / "j"), str(n)]
        rc = subprocess.run(argv, capture_output=True, timeout=60).returncode
        if rc == 0:
            break
        assert rc == -9
        steps += 1
        found, _ = journal.load(tmp_path / "j", "cat", set(records))  # the whole category
        assert set(found) == set(records), f"records lost by a kill at step {n}"
        journal.ensure_layout(tmp_path / "j", "cat", 3)  # the next job finishes the move
        for shard, wanted in _by_shard(records, 3).items():
            found, _ = journal.load(tmp_path / "j", "cat", set(records), shard=shard)
            assert set(found) == wanted, (n, shard)
    else:
        raise AssertionError("the migration never completed")
    # three new files, the two files they replace, the layout file: each was a kill point
    assert steps == 6, steps
