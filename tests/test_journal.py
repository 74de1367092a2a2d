"""Journal (crash-safe append-only records) and generation keys."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

from tokenmill import keys
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
