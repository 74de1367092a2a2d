"""The trainers' own loaders read the hidden_states stage's output, real stored states (an
8-layer float32 model's forward pass, no fake values): speculators' offline ArrowDataset over a
shard's speculators/ folder, SpecForge's OfflineManifestReader (eager validation) and feature
loader over its specforge/ folder. Each runs in its cached venv (tests/{speculators,specforge}/
ensure_venv.sh) via tests/{speculators,specforge}/check_hidden_states.py.

Not covered here: a SpecForge forward/backward step and a speculators EAGLE-3 forward on these
states (docs/hidden-states.md, "Not built yet")."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from test_hidden_states import make_dataset, model8, run_stage, stage_config  # noqa: F401
from test_trainer_loaders import ensure

from tokenmill.hidden_states import layout

pytestmark = [pytest.mark.trainers, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def stage_out(model8, tmp_path_factory):  # noqa: F811 - the fixture imported above
    tmp = tmp_path_factory.mktemp("hs_trainers")
    rows = make_dataset(tmp / "000.parquet", 12, seed=3)
    out = tmp / "out"
    run_stage(tmp, stage_config(model8), tmp / "000.parquet", out, tmp / "journal")
    return out, rows


def run_checker(trainer: str, data: Path, tmp: Path):
    import torch

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ""}
    env["HF_HOME"] = str(tmp / "hf-home")
    env["CUDA_VISIBLE_DEVICES"] = ""
    spec = {"data": str(data), "out": str(tmp)}
    p = subprocess.run(
        [ensure(trainer), str(REPO / "tests" / trainer / "check_hidden_states.py"),
         json.dumps(spec)],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-6000:])
    assert f"{trainer}: ok" in p.stdout
    return torch.load(tmp / "loaded.pt", weights_only=False)


def test_speculators_loads_every_row_with_its_own_loader(stage_out, tmp_path):
    import torch
    from safetensors.torch import load_file

    out, rows = stage_out
    loaded = run_checker("speculators", out / "speculators", tmp_path)
    assert len(loaded) == len(rows)
    for i, item in enumerate(loaded):
        ours = load_file(out / layout.speculators_path(i))
        hs = ours["hidden_states"]
        assert item["input_ids"].tolist() == rows[i]
        # its aux input: the first three layers flattened; its verifier state: the last (pre-norm)
        assert torch.equal(item["hidden_states"], hs[:, :-1].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], hs[:, -1])
        assert (
            item["loss_mask"].tolist()
            == torch.load(out / layout.specforge_path(i), weights_only=True)["loss_mask"].tolist()
        )


def test_specforge_reads_every_file_with_its_own_reader(stage_out, tmp_path):
    import torch

    out, rows = stage_out
    loaded = run_checker("specforge", out / "specforge", tmp_path)
    assert len(loaded) == len(rows)
    for i, ids in enumerate(rows):
        path = str((out / layout.specforge_path(i)).resolve())
        got = loaded[path]
        ours = torch.load(path, weights_only=True)
        assert got["num_tokens"] == len(ids)
        assert got["specs"]["aux_hidden_state"][0] == (1, len(ids), 3 * 64)
        assert got["specs"]["hidden_state"][0] == (1, len(ids), 64)
        for k, v in ours.items():
            assert torch.equal(got["tensors"][k], v), (i, k)
