"""Tests for the prepare stage: sources, the CLI, counts, determinism, sampling, sample data."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from tokenmill import contracts
from tokenmill.contracts import PROMPTS, REJECTED, read_metadata
from tokenmill.prepare import formats
from tokenmill.prepare import stage as prep
from tokenmill.prepare.sources import SourceError, iter_source
from tokenmill.settings import load_section

ROOT = Path(__file__).resolve().parent.parent


def write_jsonl(path: Path, records) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def qa(i: int, answer: str = "a") -> dict:
    return {"instruction": f"question {i}", "input": "", "output": answer}


def run_cli(tmp_path, category: dict, basedir=None, name="cat", tag="", reject_limits=None):
    out = tmp_path / f"out{tag}" / f"{name}.parquet"
    rej = tmp_path / f"rej{tag}" / f"{name}.parquet"
    argv = ["--category", name, "--category-config", json.dumps(category)]
    argv += ["--out", str(out), "--rejected", str(rej), "--basedir", str(basedir or tmp_path)]
    if reject_limits is not None:
        argv += ["--reject-limits", json.dumps(reject_limits)]
    rc = prep.main(argv)
    return rc, out, rej


def read(path):
    return pq.read_table(path).to_pylist()


def check_counts(out, rej):
    meta = read_metadata(out)
    assert meta == read_metadata(rej) | {"tokenmill.stage": "prepare"}
    kept, rejected = pq.read_metadata(out).num_rows, pq.read_metadata(rej).num_rows
    assert int(meta["tokenmill.kept"]) == kept
    assert int(meta["tokenmill.rejected"]) == rejected
    assert int(meta["tokenmill.records_in"]) == kept + rejected
    return meta


# ---------------------------------------------------------------------------------------------
# Bundled sample data (the categories of config.yaml)

PLANTED = {
    "function_calling": {
        "sample/data/glaive/glaive_sample.jsonl:21": "invalid_tool_json",
        "sample/data/glaive/glaive_sample.jsonl:34": "empty_conversation",
        "sample/data/glaive/glaive_sample.jsonl:42": "roles_out_of_order",
    },
    "code": {
        "sample/data/code/code_sample.jsonl:12": "missing_field",
        "sample/data/code/code_sample.jsonl:28": "unparseable",
    },
    "chat": {
        "sample/data/chat/chat_sample.json#10": "unknown_role",
        "sample/data/chat/chat_sample.json#31": "empty_conversation",
    },
    "agent": {"sample/data/agent/agent_sample.parquet#30": "invalid_tool_json"},
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_sample_data_only_planted_rejections(tmp_path, name):
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    rc, out, rej = run_cli(tmp_path, config["categories"][name], basedir=ROOT, name=name)
    assert rc == 0
    rejected = {r["source"]: r["reason"] for r in read(rej)}
    assert rejected == PLANTED[name]
    meta = check_counts(out, rej)
    assert meta["tokenmill.category"] == name
    prompts = read(out)
    assert len(prompts) >= 25
    assert [p["prompt_id"] for p in prompts] == sorted(p["prompt_id"] for p in prompts)
    for p in prompts:
        messages = json.loads(p["messages"])
        assert messages[-1]["role"] in ("user", "tool")  # turns=last: ends before the answer
    assert pq.read_schema(out).remove_metadata() == PROMPTS
    assert pq.read_schema(rej).remove_metadata() == REJECTED
    if name in ("function_calling", "agent"):
        assert any(p["tools"] for p in prompts)
        assert any('"tool_calls"' in p["messages"] for p in prompts)


def test_agent_parquet_is_reproducible(tmp_path):
    script = ROOT / "sample/data/agent/make_agent.py"
    # Write to a copy of the script's folder so the bundled file is not touched.
    copy = tmp_path / "make_agent.py"
    copy.write_text(script.read_text())
    subprocess.run([sys.executable, str(copy)], check=True, capture_output=True, timeout=60)
    bundled = ROOT / "sample/data/agent/agent_sample.parquet"
    assert (tmp_path / "agent_sample.parquet").read_bytes() == bundled.read_bytes()


# ---------------------------------------------------------------------------------------------
# Determinism and counts


def test_cli_reruns_are_byte_identical(tmp_path):
    cat = {"sources": ["sample/data/glaive/*.jsonl"], "format": "glaive", "turns": "all"}
    rc1, out1, rej1 = run_cli(tmp_path, cat, basedir=ROOT, tag="1")
    rc2, out2, rej2 = run_cli(tmp_path, cat, basedir=ROOT, tag="2")
    assert rc1 == rc2 == 0
    assert out1.read_bytes() == out2.read_bytes()
    assert rej1.read_bytes() == rej2.read_bytes()
    meta = check_counts(out1, rej1)
    # turns=all counts candidate prompts: more than the records read
    assert int(meta["tokenmill.records_in"]) > int(meta["tokenmill.source_records"])


def test_turns_first_and_all_counts(tmp_path):
    conv = {
        "conversations": [
            {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"},
            {"from": "human", "value": "q2"},
            {"from": "gpt", "value": "a2"},
        ]
    }
    src = tmp_path / "c.json"
    src.write_text(json.dumps({"data": [conv, {"conversations": []}]}))
    for turns, n in [("first", 1), ("last", 1), ("all", 2)]:
        cat = {"sources": ["c.json"], "format": "sharegpt", "turns": turns}
        rc, out, rej = run_cli(tmp_path, cat, tag=turns)
        assert rc == 0
        prompts = read(out)
        assert len(prompts) == n
        meta = check_counts(out, rej)
        assert meta["tokenmill.records_in"] == str(n + 1)
        assert meta["tokenmill.source_records"] == "2"
        assert [r["source"] for r in read(rej)] == ["c.json#2"]


def test_duplicates_keep_first_in_source_order(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", [qa(1), qa(2, answer="other answer")])
    write_jsonl(tmp_path / "a.jsonl", [qa(2), qa(3)])
    cat = {"sources": ["*.jsonl"], "format": "instruction"}
    rc, out, rej = run_cli(tmp_path, cat)
    assert rc == 0
    assert sorted(p["source"] for p in read(out)) == ["a.jsonl:1", "a.jsonl:2", "b.jsonl:1"]
    (dup,) = read(rej)
    assert dup["reason"] == "duplicate_prompt"
    assert dup["source"] == "b.jsonl:2"
    assert "a.jsonl:1" in dup["detail"]
    assert dup["prompt_id"] in {p["prompt_id"] for p in read(out)}
    assert json.loads(dup["record"])["output"] == "other answer"
    check_counts(out, rej)


def test_rejected_rows_follow_source_order(tmp_path):
    records = [qa(i) for i in range(12)]
    records[1] = "{broken"
    records[10] = {"input": "no instruction"}
    records[11] = qa(0)  # duplicate of line 1
    write_jsonl(tmp_path / "x.jsonl", records)
    rc, out, rej = run_cli(tmp_path, {"sources": ["x.jsonl"], "format": "instruction"})
    rows = read(rej)
    assert [(r["source"], r["reason"]) for r in rows] == [
        ("x.jsonl:2", "unparseable"),
        ("x.jsonl:11", "missing_field"),
        ("x.jsonl:12", "duplicate_prompt"),
    ]
    assert rows[0]["record"] == "{broken"
    assert all(r["stage"] == "prepare" and r["category"] == "cat" for r in rows)


def test_max_prompts_is_seeded_and_edit_stable(tmp_path):
    records = [qa(i) for i in range(40)]
    write_jsonl(tmp_path / "d.jsonl", records)
    cat = {"sources": ["d.jsonl"], "format": "instruction", "max_prompts": 10, "sample_seed": 7}
    _, out, rej = run_cli(tmp_path, cat, tag="a")
    before = {p["prompt_id"]: p["source"] for p in read(out)}
    assert len(before) == 10
    over = [r for r in read(rej) if r["reason"] == "over_max_prompts"]
    assert len(over) == 30
    check_counts(out, rej)

    # Edit one record at a time (selected ones and others): the rest keep their membership.
    # Top-N by hash rank: at most one other prompt moves (the one at the boundary).
    lines = sorted(int(s.split(":")[1]) for s in before.values())[:3] + [40]
    for k, line in enumerate(lines):
        edited = list(records)
        edited[line - 1] = {"instruction": f"edited question {k} {'x' * k}", "input": ""}
        write_jsonl(tmp_path / "d.jsonl", edited)
        _, out2, _ = run_cli(tmp_path, cat, tag=f"b{k}")
        after = {p["prompt_id"]: p["source"] for p in read(out2)}
        old = {pid for pid, s in before.items() if s == f"d.jsonl:{line}"}
        new = {pid for pid, s in after.items() if s == f"d.jsonl:{line}"}
        changed = (set(before) - old) ^ (set(after) - new)
        assert len(changed) <= 1, (line, len(changed))

    write_jsonl(tmp_path / "d.jsonl", records)
    _, out3, _ = run_cli(tmp_path, dict(cat, sample_seed=8), tag="c")
    assert {p["prompt_id"] for p in read(out3)} != set(before)


def test_all_rejected_still_writes_both_files(tmp_path, capsys):
    write_jsonl(tmp_path / "bad.jsonl", ["nope", "[1, 2]"])
    # the guard (reject_limits.prepare) fails a category that keeps nothing, leaving no file
    rc, out, rej = run_cli(tmp_path, {"sources": ["bad.jsonl"], "format": "messages"})
    assert rc == 1 and not out.exists() and not rej.exists()
    assert "stage prepare: 2 of 2 rejected (100.0%): nothing kept" in capsys.readouterr().err
    # with the guard off, both files are written
    # (the rules pass the run's whole config; a command given the section alone reads it too)
    off = {"reject_limits": {"prepare": {"max_fraction": 1.0}}}
    rc, out, rej = run_cli(
        tmp_path, {"sources": ["bad.jsonl"], "format": "messages"}, reject_limits=off
    )
    assert rc == 0
    assert read(out) == []
    assert [r["reason"] for r in read(rej)] == ["unparseable", "unparseable"]
    check_counts(out, rej)


def reference_prepare(category: str, cat: dict, basedir: Path):
    """The stage's rules held in memory, written with whole-table writes: what the streaming
    stage must reproduce byte for byte (dedup keeps the first in source order, max_prompts
    keeps the best sample ranks, prompts sorted by prompt_id, rejections in source order)."""
    kept, first_key, rejected = {}, {}, []
    opts, seed, limit = cat.get("format_options"), cat.get("sample_seed", 0), cat["max_prompts"]

    def reject(key, reason, detail, rec, pid=None):
        rejected.append((key, dict(stage="prepare", category=category, reason=reason,
                                   detail=detail, source=rec.location, prompt_id=pid,
                                   record=rec.raw)))  # fmt: skip

    for n, rec in enumerate(iter_source({"path": cat["sources"][0]}, basedir)):
        if rec.data is None:
            reject((n, 0), "unparseable", rec.error, rec)
            continue
        try:
            prompts = formats.to_prompts(rec.data, cat["format"], opts, None, cat["turns"])
        except formats.RecordError as exc:
            reject((n, 0), exc.reason, exc.detail, rec)
            continue
        for turn, (pid, messages, tools) in enumerate(prompts):
            if pid in kept:
                reject((n, turn), "duplicate_prompt", f"same prompt as {kept[pid][0]['source']}",
                       rec, pid)  # fmt: skip
                continue
            kept[pid] = (prep.prompt_row(pid, rec.location, messages, tools), rec)
            first_key[pid] = (n, turn)
    if limit is not None and len(kept) > limit:
        for pid in sorted(kept, key=lambda p: prep.sample_rank(seed, p))[limit:]:
            detail = f"not among the {limit} prompts chosen with sample_seed {seed}"
            reject(first_key[pid], "over_max_prompts", detail, kept.pop(pid)[1], pid)
    prompts = pa.Table.from_pylist([kept[p][0] for p in sorted(kept)], schema=PROMPTS)
    rows = [row for _, row in sorted(rejected, key=lambda kr: kr[0])]
    return prompts, contracts.rejected_table(rows)


@pytest.mark.parametrize("flush_bytes", [prep.BUCKET_FLUSH_BYTES, 4096])
@pytest.mark.parametrize("max_prompts", [None, 9000])
def test_streaming_output_is_byte_identical_to_whole_tables(
    tmp_path, monkeypatch, flush_bytes, max_prompts
):
    """20,000 prompts (three row groups) with duplicates, unparseable lines and several turns
    per record: the streamed files equal whole-table writes of the same rows, byte for byte,
    also when the kept prompts reach their buckets in many small pieces."""
    monkeypatch.setattr(prep, "BUCKET_FLUSH_BYTES", flush_bytes)
    records = []
    for i in range(10_000):
        j = i - 3 if i % 40 == 39 else i  # a duplicate record
        conv = [
            {"role": "user", "content": f"q{j}"},
            {"role": "assistant", "content": "a"},
            {"role": "user", "content": f"again {j}"},
            {"role": "assistant", "content": "b"},
        ]
        records.append("{broken" if i % 97 == 0 else {"messages": conv})
    write_jsonl(tmp_path / "d.jsonl", records)
    cat = {"sources": ["d.jsonl"], "format": "messages", "turns": "all",
           "max_prompts": max_prompts, "sample_seed": 5}  # fmt: skip
    rc, out, rej = run_cli(tmp_path, cat)
    assert rc == 0
    prompts, rejected = reference_prepare("cat", load_section(cat, "categories.cat").raw, tmp_path)
    assert prompts.num_rows > 2 * contracts.ROW_GROUP_SIZE or max_prompts
    meta = read_metadata(out)
    extra = {
        k: v for k, v in meta.items() if k not in ("tokenmill.stage", "tokenmill.schema_version")
    }
    contracts.write_table(prompts, tmp_path / "ref.parquet", PROMPTS, "prepare", extra)
    contracts.write_table(rejected, tmp_path / "ref_rej.parquet", REJECTED, "prepare", extra)
    assert pq.read_table(out).equals(prompts)
    assert pq.read_table(rej).equals(rejected)
    assert out.read_bytes() == (tmp_path / "ref.parquet").read_bytes()
    assert rej.read_bytes() == (tmp_path / "ref_rej.parquet").read_bytes()
    assert not list(out.parent.glob(".*")), "spill files left behind"


def test_unreadable_source_mid_stream_leaves_no_file(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [qa(i) for i in range(3000)])
    (tmp_path / "b.jsonl").write_bytes(b'{"instruction": "\xff\xfe"}\n')
    cat = {"sources": ["a.jsonl", "b.jsonl"], "format": "instruction"}
    rc, out, rej = run_cli(tmp_path, cat)
    assert rc == 1 and not out.exists() and not rej.exists()
    assert not list(out.parent.iterdir()), "spill files left behind"


# ---------------------------------------------------------------------------------------------
# Sources


def test_source_locations_and_blank_lines(tmp_path):
    write_jsonl(tmp_path / "s.jsonl", [qa(1), "", qa(2)])
    (tmp_path / "s.json").write_text(json.dumps([qa(3), "not an object"]))
    recs = list(iter_source({"path": "s.*"}, tmp_path))
    assert [r.location for r in recs] == ["s.json#1", "s.json#2", "s.jsonl:1", "s.jsonl:3"]
    assert recs[1].data is None and recs[1].error


def test_parquet_nested_columns(tmp_path):
    msgs = [{"role": "user", "content": "hi", "tool_calls": None}]
    table = pa.table({"messages": [msgs, [{"role": "user", "content": "yo", "tool_calls": None}]]})
    pq.write_table(table, tmp_path / "n.parquet")
    rc, out, rej = run_cli(tmp_path, {"sources": ["n.parquet"], "format": "messages"})
    assert rc == 0
    assert sorted(p["source"] for p in read(out)) == ["n.parquet#1", "n.parquet#2"]
    assert json.loads(read(out)[0]["messages"])[0].keys() == {"role", "content"}


def test_hub_source_location(monkeypatch):
    datasets = pytest.importorskip("datasets")
    calls = []

    def fake_load(name, config=None, split=None, revision=None):
        calls.append((name, config, split, revision))
        return datasets.Dataset.from_list([qa(1), qa(2)])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    spec = {"hub": "org/data", "config": "cfg", "split": "test", "revision": "abc"}
    recs = list(iter_source(spec))
    assert [r.location for r in recs] == ["hub:org/data/cfg:test#1", "hub:org/data/cfg:test#2"]
    assert calls == [("org/data", "cfg", "test", "abc")]
    assert recs[1].data["instruction"] == "question 2"


@pytest.mark.parametrize(
    "name, content",
    [
        ("missing.jsonl", None),
        ("corrupt.parquet", b"PAR1 this is not parquet"),
        ("notjson.json", b"this is { not json"),
        ("scalar.json", b"42"),
        ("data.csv", b"a,b\n1,2\n"),
    ],
)
def test_unreadable_source_is_a_clear_error(tmp_path, capsys, name, content):
    if content is not None:
        (tmp_path / name).write_bytes(content)
    with pytest.raises(SourceError, match=name.split(".")[0]):
        list(iter_source({"path": name}, tmp_path))
    rc, out, rej = run_cli(tmp_path, {"sources": [name], "format": "messages"})
    assert rc == 1
    assert name in capsys.readouterr().err
    assert not out.exists() and not rej.exists()


# ---------------------------------------------------------------------------------------------
# Config handling and hooks


def test_category_config_file_defaults_and_bad_config(tmp_path, capsys):
    write_jsonl(tmp_path / "q.jsonl", [qa(1)])
    cfg = tmp_path / "cat.json"
    cfg.write_text(json.dumps({"sources": [{"path": "q.jsonl"}], "format": "instruction"}))
    out, rej = tmp_path / "o.parquet", tmp_path / "r.parquet"
    argv = ["--category", "c", "--category-config", str(cfg), "--out", str(out)]
    argv += ["--rejected", str(rej), "--basedir", str(tmp_path)]
    assert prep.main(argv) == 0
    assert len(read(out)) == 1
    rc, _, _ = run_cli(tmp_path, {"sources": ["q.jsonl"], "format": "yaml"})
    assert rc == 1
    assert "format" in capsys.readouterr().err


def test_hook_format_via_cli(tmp_path):
    write_jsonl(tmp_path / "h.jsonl", [{"question": "q?", "answer": "a"}, {"answer": "no q"}])
    cat = {
        "sources": [str(tmp_path / "h.jsonl")],
        "format": "hook",
        "hook": "sample.hooks:qa_to_messages",
    }
    rc, out, rej = run_cli(tmp_path, cat, basedir=ROOT)
    assert rc == 0
    assert json.loads(read(out)[0]["messages"]) == [{"role": "user", "content": "q?"}]
    (bad,) = read(rej)
    assert bad["reason"] == "hook_error" and "KeyError" in bad["detail"]
    assert bad["source"] == f"{tmp_path / 'h.jsonl'}:2"  # absolute paths stay absolute


def test_tokenmill_command_entry_point(tmp_path):
    write_jsonl(tmp_path / "q.jsonl", [qa(1)])
    cmd = [sys.executable, "-m", "tokenmill", "prepare", "--category", "c"]
    cmd += ["--category-config", json.dumps({"sources": ["q.jsonl"], "format": "instruction"})]
    cmd += ["--out", str(tmp_path / "o.parquet"), "--rejected", str(tmp_path / "r.parquet")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 kept, 0 rejected" in proc.stderr


def test_opencodeinstruct_layout(tmp_path, capsys):
    """OpenCodeInstruct's question is in `input` (no instruction column): with
    {instruction: input, input: null} each prompt holds the question once; without
    `input: null` the category is refused, naming the option, instead of doubling prompts."""
    question = "Write a function that returns the n-th Fibonacci number."
    record = {"id": "x1", "input": question, "output": "def fib(n): ...", "domain": "generic"}
    write_jsonl(tmp_path / "oci.jsonl", [record])
    cat = {"sources": ["oci.jsonl"], "format": "instruction"}
    opts = {"instruction": "input", "input": None}
    rc, out, _ = run_cli(tmp_path, cat | {"format_options": opts})
    assert rc == 0
    (row,) = read(out)
    assert json.loads(row["messages"]) == [{"role": "user", "content": question}]

    rc, out, _ = run_cli(tmp_path, cat | {"format_options": {"instruction": "input"}}, tag="2")
    assert rc == 1 and not out.exists()
    assert "format_options.input" in capsys.readouterr().err
