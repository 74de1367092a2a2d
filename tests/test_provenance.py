"""provenance, verify, reproduce checks: contents, secrets, tampering, reruns."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
from test_merge import build_tokenizer, gen_row, write_generated
from test_stats import CONFIG, build_results

import tokenmill
from tokenmill import contracts
from tokenmill.provenance import manifest as provenance
from tokenmill.provenance import verify

SECRET = "sk-test-0123456789abcdef"


def setup_run(tmp_path, monkeypatch):
    base = tmp_path
    r = build_results(base)
    build_tokenizer(base / "tok")
    (base / "data").mkdir()
    (base / "data" / "chat.jsonl").write_text('{"conversations": []}\n')
    (base / "data" / "code.jsonl").write_text('{"instruction": "x"}\n')
    config = copy.deepcopy(CONFIG)
    config["journal_dir"] = "results/journal"
    config["generation"]["api_key_env"] = "TOKENMILL_TEST_API_KEY"
    monkeypatch.setenv("TOKENMILL_TEST_API_KEY", SECRET)
    (base / "config.yaml").write_text("results_dir: results\n")
    # a journal (excluded) and a meta file that leaks the key in several places
    (r / "journal" / "chat").mkdir(parents=True)
    (r / "journal" / "chat" / "000.jsonl").write_text("{}\n")
    meta_path = r / "generated" / "chat" / "000.meta.json"
    meta = json.loads(meta_path.read_text())
    meta.update(
        {
            "engine_argv": ["sglang", "--api-key", SECRET, "--port", "1"],
            "server_info": {"api_key": SECRET, "note": f"Bearer {SECRET}"},
        }
    )
    meta_path.write_text(json.dumps(meta))
    return base, r, config


def run_provenance(base, r, config):
    out = r / "provenance.json"
    rc = provenance.main(
        [
            "--results-dir",
            str(r),
            "--config-json",
            json.dumps(config),
            "--configfiles",
            str(base / "config.yaml"),
            "--out",
            str(out),
            "--basedir",
            str(base),
        ]
    )
    assert rc == 0
    return out


def test_provenance_contents_and_secret_scrubbing(tmp_path, monkeypatch):
    base, r, config = setup_run(tmp_path, monkeypatch)
    out = run_provenance(base, r, config)
    text = out.read_text()
    assert SECRET not in text
    m = json.loads(text)
    assert m["schema"] == "tokenmill.provenance/1"
    assert m["generation"]["api_key_env"] == "TOKENMILL_TEST_API_KEY"
    # every file under results except the journal and provenance itself, with correct hashes
    expected = sorted(
        p.relative_to(r).as_posix()
        for p in r.rglob("*")
        if p.is_file() and "journal" not in p.parts and p.name != "provenance.json"
    )
    assert [e["path"] for e in m["outputs"]] == expected
    for e in m["outputs"]:
        p = r / e["path"]
        assert e["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
        assert e["size"] == p.stat().st_size
        if p.suffix == ".parquet":
            assert e["rows"] == pq.ParquetFile(p).metadata.num_rows
    assert {e["path"] for e in m["inputs"]["chat"]} == {"data/chat.jsonl"}
    assert (
        m["inputs"]["chat"][0]["sha256"]
        == hashlib.sha256((base / "data" / "chat.jsonl").read_bytes()).hexdigest()
    )
    tok_files = {e["path"] for e in m["tokenizer"]["files"]}
    assert "tok/tokenizer.json" in tok_files
    assert m["tokenizer"]["fingerprints"] == ["tokfp-123"]
    assert m["model"] == {"id": "tiny/model", "revision": None, "engine": "sglang"}
    assert m["config"]["files"][0]["path"].endswith("config.yaml")
    assert m["software"]["packages"]["pyarrow"] and "sglang" in m["software"]["packages"]
    assert m["software"]["packages"]["tokenmill"] == tokenmill.__version__
    assert m["workflow"] == {"git_commit": None, "dirty": None}  # tmp_path is no git checkout
    assert {j["slurm_job_id"] for j in m["jobs"]} == {"42"}
    assert m["times"]["start"] == "2024-01-01T00:00:00+00:00"
    chat_meta = next(e for e in m["engine"] if (e["category"], e["shard"]) == ("chat", "000"))
    assert chat_meta["meta"]["engine_argv"] == ["sglang", "--api-key", "<redacted>", "--port", "1"]
    assert chat_meta["meta"]["server_info"]["api_key"] == "<redacted>"
    assert len(m["generated_samples"]["generated/chat/000.parquet"]) == 2
    # The draft vocabulary and the token counts: listed like every output, and summarized.
    listed = {e["path"] for e in m["outputs"]}
    assert {"dataset/vocab_mapping/d2t-3.npy", "dataset/vocab_mapping/t2d-3.npy"} <= listed
    assert {"token_counts/chat/000.parquet", "token_counts/_all.parquet"} <= listed
    mapping = json.loads((r / "dataset/vocab_mapping/vocab_mapping.json").read_text())
    assert m["draft_vocab"] == mapping and m["draft_vocab"]["draft_size"] == 3
    assert m["token_counts"]["token_counts/_all.parquet"] == 9
    assert m["token_counts"]["token_counts/chat.parquet"] == 6
    assert len(m["token_counts"]) == 3 + 2 + 1  # 3 shards, 2 categories, overall


def test_verify_pass_and_tamper(tmp_path, monkeypatch, capsys):
    base, r, config = setup_run(tmp_path, monkeypatch)
    out = run_provenance(base, r, config)
    assert verify.main([str(out)]) == 0
    assert "OK" in capsys.readouterr().out
    # copy elsewhere, tamper with one file, add one: named plainly
    target = r / "dataset" / "chat" / "000.parquet"
    data = bytearray(target.read_bytes())
    data[100] ^= 0xFF
    target.write_bytes(bytes(data))
    (r / "stray.txt").write_text("x")
    (r / "export" / "code" / "000.jsonl").unlink()
    assert verify.main([str(out), str(r)]) == 1
    text = capsys.readouterr().out
    assert "sha256 differs: dataset/chat/000.parquet" in text
    assert "missing: export/code/000.jsonl" in text
    assert "warning: unexpected extra file: stray.txt" in text
    (r / "stats").mkdir(exist_ok=True)
    (r / "dataset" / "code" / "000.parquet").write_bytes(b"short")
    assert verify.main([str(out), str(r)]) == 1
    assert "size differs: dataset/code/000.parquet" in capsys.readouterr().out
    # The draft vocabulary and a token-counts file: a changed mapping or count is named.
    d2t = r / "dataset" / "vocab_mapping" / "d2t-3.npy"
    d2t.write_bytes(d2t.read_bytes()[:-1] + bytes([d2t.read_bytes()[-1] ^ 1]))
    (r / "token_counts" / "code" / "000.parquet").unlink()
    assert verify.main([str(out), str(r)]) == 1
    text = capsys.readouterr().out
    assert "sha256 differs: dataset/vocab_mapping/d2t-3.npy" in text
    assert "missing: token_counts/code/000.parquet" in text


def test_provenance_is_read_as_its_typed_record(tmp_path, monkeypatch, capsys):
    """verify, compare and reproduce-config read provenance.json strictly: what the writer
    wrote reads back equal, and an unknown key or another schema version is one line naming
    it, not a guess."""
    from tokenmill.provenance import reproduce

    base, r, config = setup_run(tmp_path, monkeypatch)
    out = run_provenance(base, r, config)
    m = contracts.Provenance.read(out)
    assert json.loads(provenance.dumps(m, config)) == json.loads(out.read_text())
    assert m.jobs[0].slurm_job_id == "42" and m.outputs[0].sha256
    raw = json.loads(out.read_text())
    capsys.readouterr()  # the setup's own lines
    for change, named in (
        ({"outputs": [{**raw["outputs"][0], "sha": "x"}]}, "unknown key 'sha'"),
        ({"schema": "tokenmill.provenance/0"}, "'tokenmill.provenance/0'"),
        ({"times": {"start": None}}, "missing key 'end'"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({**raw, **change}))
        assert verify.main([str(bad), str(r)]) == 1
        err = capsys.readouterr().err.strip()
        assert named in err and len(err.splitlines()) == 1, err
        assert reproduce.main([str(bad), "--out", str(tmp_path / "repro.yaml")]) == 1
        assert named in capsys.readouterr().err
    assert not (tmp_path / "repro.yaml").exists()


def test_check_reproducible(tmp_path, monkeypatch):
    base, r, config = setup_run(tmp_path, monkeypatch)
    m = contracts.Provenance.read(run_provenance(base, r, config))
    assert provenance.check_reproducible(m, config, base) == []
    (base / "data" / "chat.jsonl").write_text('{"conversations": [1]}\n')
    (base / "tok" / "tokenizer.json").write_text("{}")
    other = copy.deepcopy(config)
    other["generation"]["revision"] = "abc123"
    problems = provenance.check_reproducible(m, other, base)
    assert "input of chat data/chat.jsonl: sha256 differs" in problems
    assert "tokenizer file tok/tokenizer.json: sha256 differs" in problems
    assert any(
        p.startswith("model: manifest tiny/model@None, config tiny/model@abc123") for p in problems
    )


def test_compare_outputs_identical_and_altered(tmp_path, monkeypatch):
    base, r, config = setup_run(tmp_path, monkeypatch)
    out = run_provenance(base, r, config)
    m = contracts.Provenance.read(out)
    rep = provenance.compare_outputs(m, r)
    assert rep["ok"] and rep["byte_identical_stages"]["different"] == []
    assert len(rep["byte_identical_stages"]["identical"]) == 5  # 2 prompts + 3 tokenized
    assert rep["generated_samples"] | {"files": None} == {
        "total": 4,
        "identical": 4,
        "different": 0,
        "missing": 0,
        "files": None,
    }
    # a rerun where one sample came out differently and a tokenized shard changed
    tokenized = {"a": [5, 6, 3], "b": [7, 3]}
    write_generated(
        r / "generated" / "chat" / "000.parquet",
        [gen_row("a", tokenized["a"], [8, 4, 9, 2]), gen_row("b", tokenized["b"], [9, 2])],
    )
    from test_merge import write_tokenized

    write_tokenized(r / "tokenized" / "code" / "000.parquet", {"x": [6]}, "code", "000")
    report_path = tmp_path / "report.json"
    rc = provenance.main(
        ["--compare", str(out), "--results-dir", str(r), "--out", str(report_path)]
    )
    assert rc == 1
    rep = json.loads(report_path.read_text())
    assert rep["byte_identical_stages"]["different"] == ["tokenized/code/000.parquet"]
    s = rep["generated_samples"]
    assert (s["total"], s["identical"], s["different"]) == (4, 3, 1)
    assert Path(report_path).exists()


def test_absolute_paths_for_sources_tokenizer_and_model(tmp_path, monkeypatch):
    """Clusters use /models/... and /scratch/...: absolute paths are recorded as the config
    gives them (they used to fail the last rule after all data was written), and a checkout
    with the same files can reproduce the manifest."""
    base, r, config = setup_run(tmp_path, monkeypatch)
    config = copy.deepcopy(config)
    config["tokenizer"]["path"] = str(base / "tok")
    config["generation"]["model"] = str(base / "tok")
    config["categories"]["chat"]["sources"] = [str(base / "data" / "*.jsonl")]
    config["categories"]["code"]["sources"] = [str(base / "data" / "code.jsonl")]
    m = contracts.Provenance.read(run_provenance(base, r, config))
    assert {e.path for e in m.inputs["chat"]} == {
        str(base / "data" / "chat.jsonl"),
        str(base / "data" / "code.jsonl"),
    }
    assert str(base / "tok" / "tokenizer.json") in {e.path for e in m.tokenizer.files}
    assert m.model.id == str(base / "tok")
    assert provenance.check_reproducible(m, config, "/nonexistent-basedir") == []
