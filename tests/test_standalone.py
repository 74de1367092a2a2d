"""The dataset folder stands alone: `results/dataset/provenance.json` (written with the run's
provenance.json) lists every file of the folder with its sha256 and carries the config, the
tokenizer, model and engine identity, so a copy of that folder alone can be verified
(`tokenmill verify FOLDER`, naming a tampered file) and reproduced (`tokenmill
reproduce-config FOLDER/provenance.json`).

The unit tests build a small results folder (test_stats.build_results). The end-to-end
reproduction from a copy of the folder alone, in a fresh checkout with no journal, is
tests/test_workflow.py::test_reproduce_from_provenance_matches_byte_for_byte.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

from helpers import BIN, tool_env
from test_provenance import setup_run

from tokenmill.provenance import manifest as provenance
from tokenmill.provenance import verify


def write_both(base, r, config):
    rc = provenance.main(
        [
            "--results-dir",
            str(r),
            "--config-json",
            json.dumps(config),
            "--configfiles",
            str(base / "config.yaml"),
            "--out",
            str(r / "provenance.json"),
            "--dataset-out",
            str(r / "dataset" / "provenance.json"),
            "--basedir",
            str(base),
        ]
    )
    assert rc == 0
    return json.loads((r / "provenance.json").read_text()), json.loads(
        (r / "dataset" / "provenance.json").read_text()
    )


def test_dataset_manifest_lists_the_folder_and_carries_the_identity(tmp_path, monkeypatch):
    base, r, config = setup_run(tmp_path, monkeypatch)
    run, ds = write_both(base, r, config)
    folder = r / "dataset"
    files = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != "provenance.json"
    )
    assert files and [e["path"] for e in ds["outputs"]] == files
    for e in ds["outputs"]:
        assert e["sha256"] == hashlib.sha256((folder / e["path"]).read_bytes()).hexdigest()
    assert ds["scope"] == "dataset" and ds["run_outputs"] == run["outputs"]
    for key in ("config", "tokenizer", "model", "generation", "engine", "inputs", "software"):
        assert ds[key] == run[key], key
    # The run's manifest does not list the dataset's (both are written by one command).
    assert "dataset/provenance.json" not in {e["path"] for e in run["outputs"]}
    # No secret in the dataset's manifest either.
    assert "sk-test" not in (folder / "provenance.json").read_text()


def test_verify_a_copy_of_the_dataset_folder_alone(tmp_path, monkeypatch, capsys):
    base, r, config = setup_run(tmp_path, monkeypatch)
    write_both(base, r, config)
    copy = tmp_path / "published"
    shutil.copytree(r / "dataset", copy)
    assert verify.main([str(copy)]) == 0
    assert "OK:" in capsys.readouterr().out
    victim = copy / "code" / "000.parquet"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\1")
    assert verify.main([str(copy)]) == 1
    assert "code/000.parquet" in capsys.readouterr().out
    # The run's manifest still verifies the whole results folder (no warning for the
    # dataset's own manifest).
    assert verify.main([str(r / "provenance.json"), str(r)]) == 0
    assert "warning" not in capsys.readouterr().out
    # A folder without a manifest says so.
    (tmp_path / "empty").mkdir()
    assert verify.main([str(tmp_path / "empty")]) == 1


def tokenmill(cwd, *args):
    return subprocess.run(
        [str(BIN / "tokenmill"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env=tool_env(),
    )
