"""The run's one training folder per layout (tokenmill/hidden_states/training.py): rows of several
shards and categories numbered from 0 in declared order, row files as relative links into the
shard folders, rebuilt in place when shards change, checked link by link. The trainers' own
loaders read it in test_hidden_states_trainers.py; the Snakemake run in
test_hidden_states_workflow.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tool_env
from test_hidden_states import make_dataset, model8, stage_config  # noqa: F401

from tokenmill import contracts
from tokenmill.hidden_states import layout, training

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
# (category, shard, rows): two categories, one of them with two shards
SHARDS = (("c1", "000", 5), ("c1", "001", 4), ("c2", "000", 3))


def run_shard(tmp: Path, model: Path, category: str, shard: str, rows: int, seed: int):
    """One hidden_states job as the rule runs it; returns the shard's rows (input_ids)."""
    dataset = tmp / "dataset" / category / f"{shard}.parquet"
    dataset.parent.mkdir(parents=True, exist_ok=True)
    ids = make_dataset(dataset, rows, seed=seed)
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps(stage_config(model, layers=[1, 3, 5, 8])))
    out = tmp / "hidden_states" / category / shard
    cmd = [
        str(BIN / "tokenmill"), "hidden-states", "--category", category, "--shard", shard,
        "--dataset", str(dataset), "--out-dir", str(out), "--config-json", str(cfg),
        "--journal-dir", str(tmp / "journal"),
    ]  # fmt: skip
    p = subprocess.run(cmd, env=tool_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    return ids


@pytest.fixture(scope="module")
def shards(model8, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """Three stage-written shard folders under an absolute results path, and their rows."""
    tmp = tmp_path_factory.mktemp("hs_training")
    rows = {}
    for seed, (c, s, n) in enumerate(SHARDS):
        rows[(c, s)] = run_shard(tmp, model8, c, s, n, seed)
    return tmp, rows


def manifests(tmp: Path, which=SHARDS) -> list[Path]:
    return [tmp / "hidden_states" / c / s / layout.MANIFEST for c, s, _ in which]


def folder_cmd(out: Path, paths: list[Path], category: str | None = None):
    cmd = [str(BIN / "tokenmill"), "hidden-states-folder", "--out", str(out), *map(str, paths)]
    cmd += ["--category", category] if category else []
    return subprocess.run(cmd, env=tool_env(), capture_output=True, text=True, timeout=600)


def test_rows_of_every_shard_are_numbered_from_0_and_link_to_their_shard_file(shards):
    import datasets

    tmp, rows = shards
    out = tmp / "hidden_states" / "all"
    p = folder_cmd(out, manifests(tmp))
    assert p.returncode == 0, p.stdout + p.stderr
    m = contracts.HiddenStatesTrainingManifest.read(out / layout.MANIFEST)
    expected = [ids for c, s, _ in SHARDS for ids in rows[(c, s)]]
    assert m.rows == len(expected) == 12
    assert [(s.category, s.shard, s.first, s.rows) for s in m.shards] == [
        ("c1", "000", 0, 5), ("c1", "001", 5, 4), ("c2", "000", 9, 3),
    ]  # fmt: skip
    # every row file: a relative link to the shard's own file, the same bytes
    i = 0
    for c, s, n in SHARDS:
        for j in range(n):
            for lay in ("speculators", "specforge"):
                link = out / layout.row_path(lay, i)
                assert link.is_symlink() and not os.path.isabs(os.readlink(link))
                own = tmp / "hidden_states" / c / s / layout.row_path(lay, j)
                assert link.resolve() == own.resolve()
                assert link.read_bytes() == own.read_bytes()
            i += 1
    assert not (out / layout.row_path("speculators", i)).exists()
    # the rows folder: every shard's rows, in order
    ds = datasets.load_from_disk(str(out / "speculators"))
    assert [r.tolist() for r in ds["input_ids"]] == expected
    assert [int(x) for x in ds["seq_len"]] == [len(r) for r in expected]
    assert training.problems(out) == []
    # rebuilt from scratch elsewhere: the same rows files, byte for byte
    other = tmp / "hidden_states" / "all"
    before = {f.path: f.sha256 for f in m.rows_files}
    shutil.rmtree(other / "speculators")
    (other / layout.MANIFEST).unlink()
    assert folder_cmd(other, manifests(tmp)).returncode == 0
    again = contracts.HiddenStatesTrainingManifest.read(other / layout.MANIFEST)
    assert {f.path: f.sha256 for f in again.rows_files} == before


def test_a_rebuild_keeps_good_links_replaces_wrong_ones_and_drops_rows_past_the_end(shards):
    tmp, rows = shards
    out = tmp / "hidden_states" / "all"
    assert folder_cmd(out, manifests(tmp)).returncode == 0
    # a link pointed elsewhere and one removed: verify names both, a rebuild repairs them
    bad = out / layout.row_path("specforge", 3)
    bad.unlink()
    bad.symlink_to(os.readlink(out / layout.row_path("specforge", 4)))
    (out / layout.row_path("speculators", 7)).unlink()
    found = training.problems(out)
    assert any(f.startswith(f"link differs: {layout.row_path('specforge', 3)}") for f in found)
    assert f"missing link: {layout.row_path('speculators', 7)}" in found
    p = folder_cmd(out, manifests(tmp))
    assert p.returncode == 0 and "2 links made, 0 removed, rows folder kept" in p.stdout
    assert training.problems(out) == []
    # c1's second shard leaves the run (a lowered shard count): c2 moves up, the tail goes
    fewer = (SHARDS[0], SHARDS[2])
    p = folder_cmd(out, manifests(tmp, fewer))
    assert p.returncode == 0, p.stderr
    m = contracts.HiddenStatesTrainingManifest.read(out / layout.MANIFEST)
    assert m.rows == 8 and [s.first for s in m.shards] == [0, 5]
    assert "removed" in p.stdout and "rows folder written" in p.stdout
    assert not (out / layout.row_path("speculators", 8)).exists()
    assert not (out / layout.row_path("specforge", 8)).is_symlink()
    own = tmp / "hidden_states" / "c2" / "000" / layout.row_path("speculators", 0)
    assert (out / layout.row_path("speculators", 5)).resolve() == own.resolve()
    assert training.problems(out) == []
    # a shard rewritten after the build: the folder is stale until rebuilt
    shard_manifest = manifests(tmp, fewer)[1]
    shard_manifest.write_text(shard_manifest.read_text().replace('"rows"', '"rows" ', 1))
    assert any(f.startswith("stale: shard c2/000") for f in training.problems(out))


def test_shards_of_other_layer_ids_cannot_share_a_folder(shards, model8, tmp_path):  # noqa: F811
    tmp, _ = shards
    other = tmp_path / "run"
    (other / "hidden_states" / "c1").mkdir(parents=True)
    shutil.copytree(tmp / "hidden_states" / "c1" / "000", other / "hidden_states" / "c1" / "000")
    shutil.copytree(tmp / "hidden_states" / "c1" / "001", other / "hidden_states" / "c1" / "001")
    path = other / "hidden_states" / "c1" / "001" / layout.MANIFEST
    m = json.loads(path.read_text())
    m["layer_ids"] = [2, 4, 5, 8]
    path.write_text(json.dumps(m))
    p = folder_cmd(other / "hidden_states" / "all", manifests(other, SHARDS[:2]))
    assert p.returncode == 1
    assert "differ from the first shard's" in p.stderr and "Traceback" not in p.stderr


def test_a_category_folder_numbers_its_own_shards_from_0(shards):
    """hidden_states/c1/all/: c1's two shards only, rows 0..8, links one folder deeper into
    c1's shard folders; verify's check passes, and another category's shard is refused."""
    import datasets

    tmp, rows = shards
    out = tmp / "hidden_states" / "c1" / "all"
    p = folder_cmd(out, manifests(tmp, SHARDS[:2]), category="c1")
    assert p.returncode == 0, p.stdout + p.stderr
    m = contracts.HiddenStatesTrainingManifest.read(out / layout.MANIFEST)
    assert m.category == "c1" and m.rows == 9
    assert [(s.shard, s.first) for s in m.shards] == [("000", 0), ("001", 5)]
    i = 0
    for c, s, n in SHARDS[:2]:
        for j in range(n):
            for lay in ("speculators", "specforge"):
                link = out / layout.row_path(lay, i)
                target = os.readlink(link)
                assert not os.path.isabs(target) and f"/c1/{s}/" in f"/{target}"
                own = tmp / "hidden_states" / c / s / layout.row_path(lay, j)
                assert link.resolve() == own.resolve()
            i += 1
    ds = datasets.load_from_disk(str(out / "speculators"))
    assert [r.tolist() for r in ds["input_ids"]] == rows[("c1", "000")] + rows[("c1", "001")]
    assert training.problems(out) == []
    # a link into the other shard's file is caught, as in the run's folder
    link = out / layout.row_path("speculators", 0)
    link.unlink()
    link.symlink_to(os.readlink(out / layout.row_path("speculators", 5)))
    assert any(f.startswith("link differs: speculators/") for f in training.problems(out))
    assert folder_cmd(out, manifests(tmp, SHARDS[:2]), category="c1").returncode == 0
    assert training.problems(out) == []
    # c2's shard in c1's folder: refused, naming both
    p = folder_cmd(out, manifests(tmp), category="c1")
    assert p.returncode == 1 and "a shard of c2, not of c1" in p.stderr, p.stderr
