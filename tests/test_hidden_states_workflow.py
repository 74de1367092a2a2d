"""The hidden_states stage in a real Snakemake run: turned on in a copy of the finished demo run,
it runs one job per dataset shard and nothing upstream; `tokenmill plan` gives the bytes per
layout before it runs; the provenance lists every file it wrote and `tokenmill verify` checks
them (and catches a changed one), and the run's training folder links every row (verify
catches a link to the wrong row)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import copy_run, failed, snakemake, tool_env

from tokenmill import layout

BIN = Path(sys.executable).parent
# The demo run (shared, once per session) and this one: 11 model loads on a loaded CI machine.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]


def tokenmill(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "tokenmill"), *args],
        cwd=workdir,
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def hs_run(demo_workdir, tmp_path_factory):
    work = copy_run(demo_workdir, tmp_path_factory.mktemp("hs") / "demo")
    config = yaml.safe_load((work / "config.yaml").read_text())
    # The demo model has 2 layers: aux ids 0 and 1, then L = 2 (before the final norm); two
    # auxiliary layers are not an EAGLE-3 drafter's three, so the config says so.
    config["hidden_states"] = {"enabled": True, "layers": [0, 1, 2], "drafter": "other",
                               "layouts": ["speculators", "specforge"],
                               "category_folders": True}  # fmt: skip
    (work / "hs.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    plan = tokenmill(work, "plan", "--configfile", "hs.yaml", "--json")
    assert plan.returncode == 0, plan.stderr
    dry = snakemake(work, "--configfile", "hs.yaml", "-n")
    assert dry.returncode == 0, failed(dry)
    proc = snakemake(work, "--configfile", "hs.yaml", timeout=1500)
    assert proc.returncode == 0, failed(proc)
    return work, json.loads(plan.stdout), dry.stdout + dry.stderr


def test_only_the_new_jobs_and_the_reports_run(hs_run):
    work, _, dry = hs_run
    ran = {line.split()[0] for line in dry.split("Job stats:")[1].splitlines()[3:] if line.strip()}
    assert "extract_hidden_states" in ran
    assert not ran & {"prepare_prompts", "tokenize_prompts", "generate_shard", "merge_shard"}
    shards = sorted((work / "results" / "dataset").glob("*/*.parquet"))
    manifests = shard_manifests(work / "results")
    assert len(manifests) == len(shards) > 0
    assert "hidden_states_training_folder" in ran and "hidden_states_category_folder" in ran


def shard_manifests(results: Path, category: str = "*") -> list[Path]:
    """The shard folders' manifests (hidden_states/C/S/, S digits; not C/all/)."""
    return sorted((results / "hidden_states").glob(f"{category}/[0-9]*/manifest.json"))


def test_plan_bytes_match_what_was_written(hs_run):
    work, plan, _ = hs_run
    est = plan["hidden_states"]
    assert est["layer_ids"] == [0, 1, 2] and est["dtype"] == "float32"
    assert est["bytes_per_token"] == {"speculators": 3 * 64 * 4 + 8, "specforge": 3 * 64 * 4 + 16}
    results = work / "results"
    for row in est["categories"]:
        assert row["tokens_from"] == "merged shards"  # the demo run had merged already
        manifests = [json.loads(m.read_text()) for m in shard_manifests(results, row["category"])]
        assert row["tokens"] == sum(m["tokens"] for m in manifests)
        nrows = sum(m["rows"] for m in manifests)
        # the formula counts the tensors; each file adds its container's header and alignment
        # (safetensors: its JSON header; torch.save: a zip of 64-byte aligned records)
        for lay, prefix, overhead in (
            ("speculators", "speculators/hidden_states/", 1024),
            ("specforge", "specforge/", 4096),
        ):
            written = sum(
                f["size"] for m in manifests for f in m["files"] if f["path"].startswith(prefix)
            )
            assert row["bytes"][lay] <= written <= row["bytes"][lay] + overhead * nrows, lay


def test_provenance_lists_every_file_and_verify_checks_them(hs_run, tmp_path):
    work, _, _ = hs_run
    results = work / "results"
    prov = json.loads((results / "provenance.json").read_text())
    listed = {e["path"] for e in prov["outputs"]}
    files = [p for p in (results / "hidden_states").rglob("*") if p.is_file()]
    written = {p.relative_to(results).as_posix() for p in files if not p.is_symlink()}
    links = {p.relative_to(results).as_posix() for p in files if p.is_symlink()}
    assert written and written <= listed and not links & listed
    rows = sum(m["rows"] for d, m in prov["hidden_states"].items())
    # every GPU job is in `jobs`: generate's, then the stage's, each with its GPU-hours
    stages = [(j["stage"], j["category"], j["shard"]) for j in prov["jobs"]]
    shards = [tuple(d.split("/")[1:]) for d in prov["hidden_states"]]
    assert stages == [("generate", *x) for x in shards] + [("hidden_states", *x) for x in shards]
    assert all(j["gpu_hours"] == 0 and j["attempts"] >= 1 for j in prov["jobs"])  # CPU here
    assert sum(1 for p in written if p.endswith(".safetensors")) == rows
    # the training folders, the run's and each category's: every shard's rows, numbered from 0,
    # as links (checked by verify)
    per_category = {}
    for d, m in prov["hidden_states"].items():
        per_category[d.split("/")[1]] = per_category.get(d.split("/")[1], 0) + m["rows"]
    wanted = {None: rows} | per_category
    assert {p for p in links if p.endswith(".safetensors")} == {
        f"hidden_states/{'all' if c is None else c + '/all'}/speculators/hidden_states/"
        f"hs_{i}.safetensors"
        for c, n in wanted.items()
        for i in range(n)
    }
    for c in wanted:
        folder = "hidden_states/all" if c is None else f"hidden_states/{c}/all"
        assert f"{folder}/manifest.json" in listed
        assert f"{folder}/speculators/data-00000-of-00001.arrow" in listed
    ok = tokenmill(work, "verify", "results/provenance.json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    copy = copy_run(results, tmp_path / "results")
    victim = sorted(p for p in (copy / "hidden_states").rglob("hs_0.safetensors")
                    if not p.is_symlink())[0]  # fmt: skip
    data = bytearray(victim.read_bytes())
    data[-1] ^= 1  # one bit of one value
    victim.write_bytes(bytes(data))
    link = copy / "hidden_states" / "all" / "specforge" / "rows_0-2000" / "data_1.ckpt"
    target = link.readlink()
    link.unlink()
    link.symlink_to(str(target).replace("data_1.ckpt", "data_0.ckpt"))  # the wrong row
    bad = tokenmill(work, "verify", "results/provenance.json", str(copy))
    assert bad.returncode == 1
    assert f"sha256 differs: {victim.relative_to(copy).as_posix()}" in bad.stdout
    assert "hidden_states/all: link differs: specforge/rows_0-2000/data_1.ckpt" in bad.stdout


def test_verify_repair_then_a_rerun_recomputes_only_the_changed_row(hs_run, tmp_path):
    """A row file changed at its own size: a rerun alone checks sizes and keeps it, so
    `tokenmill verify --repair` finds it and removes it with its shard's manifest; the same
    snakemake command then recomputes that one row and verify passes."""
    work = copy_run(hs_run[0], tmp_path / "run")
    results = work / "results"
    shard = shard_manifests(results)[0].parent
    victim = shard / "specforge" / "rows_0-2000" / "data_1.ckpt"
    good = victim.read_bytes()
    data = bytearray(good)
    data[-100] ^= 1
    victim.write_bytes(bytes(data))
    again = snakemake(work, "--configfile", "hs.yaml", "-n")
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr
    fixed = tokenmill(work, "verify", "--repair", "results/provenance.json")
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    rel = shard.relative_to(results).as_posix()
    assert f"repair: {rel}: 1 row file(s) removed with the shard's manifest.json" in fixed.stdout
    assert not victim.exists() and not (shard / "manifest.json").exists()
    proc = snakemake(work, "--configfile", "hs.yaml")
    assert proc.returncode == 0, failed(proc)
    lay = layout.Layout(str(results), str(work / "journal"))
    log = Path(lay.attempt_log("hidden_states", shard.parent.name, shard.name)).read_text()
    assert "already done, 1 to compute" in log
    assert victim.read_bytes() == good
    ok = tokenmill(work, "verify", "results/provenance.json")
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_turning_category_folders_off_retires_them_and_nothing_is_recomputed(hs_run, tmp_path):
    work = copy_run(hs_run[0], tmp_path / "run")
    results = work / "results"
    config = yaml.safe_load((work / "hs.yaml").read_text())
    config["hidden_states"]["category_folders"] = False
    (work / "off.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    categories = sorted(config["categories"])
    assert all((results / "hidden_states" / c / "all" / "manifest.json").is_file()
               for c in categories)  # fmt: skip
    proc = snakemake(work, "--configfile", "off.yaml")
    assert proc.returncode == 0, failed(proc)
    out = proc.stdout + proc.stderr
    assert "extract_hidden_states" not in out and "hidden_states_training_folder" not in out
    for c in categories:
        assert not (results / "hidden_states" / c / "all").exists(), c
        assert (results / "retired" / "hidden_states" / c / "all" / "manifest.json").is_file()
    assert (results / "hidden_states" / "all" / "manifest.json").is_file()
    prov = json.loads((results / "provenance.json").read_text())
    assert not [e["path"] for e in prov["outputs"] if e["path"].endswith("/all/manifest.json")
                and e["path"] != "hidden_states/all/manifest.json"]  # fmt: skip
    ok = tokenmill(work, "verify", "results/provenance.json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
