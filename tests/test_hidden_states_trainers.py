"""The trainers' own code reads the hidden_states stage's output, real stored states (an 8-layer
float32 model's forward pass, no fake values): speculators' offline ArrowDataset over a shard's
speculators/ folder, SpecForge's OfflineManifestReader (eager validation) and feature loader
over its specforge/ folder. Then, on the first two rows, one forward pass of speculators'
EAGLE-3 draft (built by its trainer's own build_draft_model; its backward needs a GPU) and one
SpecForge EAGLE-3 training step, forward and backward (its draft built from the target's config
by its own providers), both with the draft vocabulary mapping the pipeline writes
(tokenmill.dataset.draft_vocab) from these rows. Each runs in its cached venv
(tests/{speculators,specforge}/ensure_venv.sh) via tests/{speculators,specforge}/
check_hidden_states.py, which say what is substituted on CPU.

The rows are the target's own greedy continuations of random prompts, as a generation run's are:
SpecForge trains only on positions where the target's prediction is in the draft vocabulary,
so on random ids its loss would be exactly 0."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from test_hidden_states import model8, run_stage, stage_config  # noqa: F401
from test_trainer_loaders import ensure

from tokenmill import contracts
from tokenmill.dataset import draft_vocab
from tokenmill.hidden_states import layout

pytestmark = [pytest.mark.trainers, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
DRAFT = 32  # draft vocabulary size
STEP_ROWS = 2  # rows of the forward / training step (CPU, kept small)


def make_generated_dataset(path: Path, model_dir: Path, n: int, seed: int = 3):
    """A merged dataset shard (contracts.DATASET) of n rows: a random prompt of 5..20 ids and
    the model's greedy continuation of 5..40 ids (the loss-masked part)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(seed)
    rows, out = [], []
    for i in range(n):
        p, m = rng.randint(5, 20), rng.randint(5, 40)
        prompt = [rng.randrange(700) for _ in range(p)]
        with torch.no_grad():
            gen = model.generate(
                torch.tensor([prompt]), max_new_tokens=m, min_new_tokens=m, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )[0].tolist()  # fmt: skip
        assert gen[:p] == prompt and len(gen) == p + m
        rows.append(
            dict(
                prompt_id=f"p{i}", category="c", sample_key=f"k{i}", input_ids=gen,
                loss_mask=[0] * p + [1] * m, num_prompt_tokens=p, num_output_tokens=m,
                num_reasoning_tokens=None, num_answer_tokens=None, num_total_tokens=p + m,
                finish_type="length",
            )
        )  # fmt: skip
        out.append((gen, [0] * p + [1] * m))
    table = pa.Table.from_pylist(rows, schema=contracts.DATASET)
    contracts.write_table(table, path, contracts.DATASET, "merge")
    return out


def write_mapping(rows, vocab_size: int, out: Path) -> tuple[np.ndarray, np.ndarray]:
    """The draft vocabulary the pipeline writes for these rows (loss-masked counts, top DRAFT):
    d2t-N.npy / t2d-N.npy for speculators, vocab_mapping.pt for SpecForge."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in rows:
        np.add.at(counts, np.asarray(ids)[np.asarray(mask) == 1], 1)
    d2t, t2d = draft_vocab.build_mapping(counts, DRAFT, target_vocab_size=vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    draft_vocab.write_speculators(out, d2t, t2d)
    draft_vocab.write_specforge(out, d2t, t2d)
    return d2t, t2d


@pytest.fixture(scope="module")
def stage_out(model8, tmp_path_factory):  # noqa: F811 - the fixture imported above
    tmp = tmp_path_factory.mktemp("hs_trainers")
    rows = make_generated_dataset(tmp / "000.parquet", model8, 12)
    out = tmp / "out"
    run_stage(tmp, stage_config(model8), tmp / "000.parquet", out, tmp / "journal")
    vocab = json.loads((model8 / "config.json").read_text())["vocab_size"]
    mapping = write_mapping(rows, vocab, tmp / "mapping")
    return out, [ids for ids, _ in rows], tmp / "mapping", mapping


def run_checker(trainer: str, spec: dict, tmp: Path):
    import torch

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": ""}
    env["HF_HOME"] = str(tmp / "hf-home")
    env["CUDA_VISIBLE_DEVICES"] = ""
    spec = {**spec, "out": str(tmp)}
    p = subprocess.run(
        [ensure(trainer), str(REPO / "tests" / trainer / "check_hidden_states.py"),
         json.dumps(spec)],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp,
    )  # fmt: skip
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-6000:])
    assert f"{trainer}: ok" in p.stdout
    return torch.load(tmp / "loaded.pt", weights_only=False)


def test_speculators_loads_every_row_and_runs_its_eagle3_forward(stage_out, model8, tmp_path):  # noqa: F811
    import torch
    from safetensors.torch import load_file

    out, rows, mapping_dir, (d2t, t2d) = stage_out
    spec = {
        "data": str(out / "speculators"), "model": str(model8), "rows": STEP_ROWS,
        "d2t": str(mapping_dir / f"d2t-{DRAFT}.npy"), "t2d": str(mapping_dir / f"t2d-{DRAFT}.npy"),
    }  # fmt: skip
    loaded = run_checker("speculators", spec, tmp_path)
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
    # its EAGLE-3 draft, built by its trainer's code on the target's config, one forward pass
    fwd = torch.load(tmp_path / "forward.pt", weights_only=False)
    print("speculators forward:", {k: v for k, v in fwd.items() if k not in ("d2t", "t2d")})
    manifest = json.loads((out / "manifest.json").read_text())
    assert fwd["speculator_type"] == "eagle3"
    assert fwd["target_layer_ids"] == manifest["layer_ids"][:-1]  # its aux ids = the stored ones
    assert fwd["rows"] == STEP_ROWS and fwd["tokens"] == sum(len(r) for r in rows[:STEP_ROWS])
    assert fwd["draft_vocab_size"] == DRAFT
    assert torch.equal(fwd["d2t"], torch.from_numpy(d2t))  # the pipeline's mapping, as loaded
    assert torch.equal(fwd["t2d"], torch.from_numpy(t2d))
    assert math.isfinite(fwd["loss"]) and fwd["loss"] > 0


def test_specforge_reads_every_file_and_runs_a_training_step(stage_out, model8, tmp_path):  # noqa: F811
    import torch

    out, rows, mapping_dir, _ = stage_out
    spec = {
        "data": str(out / "specforge"), "model": str(model8), "rows": STEP_ROWS,
        "mapping": str(mapping_dir / "vocab_mapping.pt"),
    }  # fmt: skip
    loaded = run_checker("specforge", spec, tmp_path)
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
    # one EAGLE-3 training step on the first rows: finite loss, finite non-zero gradients
    step = torch.load(tmp_path / "step.pt", weights_only=False)
    print("specforge step:", {k: v for k, v in step.items() if k not in ("grads", "trainable")})
    assert step["rows"] == STEP_ROWS and step["draft_vocab_size"] == DRAFT
    assert step["tokens"] == STEP_ROWS * max(len(r) for r in rows[:STEP_ROWS])  # padded batch
    assert math.isfinite(step["loss"]) and step["loss"] > 0
    assert all(math.isfinite(p) for p in step["plosses"])
    grads = step["grads"]
    assert set(grads) == set(step["trainable"])  # every trainable parameter got a gradient
    assert all(finite for finite, _ in grads.values())
    assert grads["draft_model.fc.weight"][1] > 0 and grads["draft_model.lm_head.weight"][1] > 0
    assert sum(norm > 0 for _, norm in grads.values()) >= len(grads) - 1


@pytest.fixture(scope="module")
def training_shards(model8, tmp_path_factory):  # noqa: F811
    """Three shards of two categories (12 rows), as the stage writes them."""
    from test_hidden_states_training import SHARDS, run_shard

    tmp = tmp_path_factory.mktemp("hs_training_trainers")
    rows = {}
    for seed, (c, s, n) in enumerate(SHARDS):
        rows[(c, s)] = run_shard(tmp, model8, c, s, n, seed)
    return tmp, rows


@pytest.fixture(scope="module", params=["all", "c1"])
def training_folder(request, training_shards):
    """The run's training folder over all three shards (12 rows), or category c1's over its
    two (9 rows)."""
    from test_hidden_states_training import SHARDS, folder_cmd, manifests

    tmp, by_shard = training_shards
    category = None if request.param == "all" else request.param
    which = [x for x in SHARDS if category in (None, x[0])]
    rows = [ids for c, s, _ in which for ids in by_shard[(c, s)]]
    out = tmp / "hidden_states" / ("all" if category is None else f"{category}/all")
    p = folder_cmd(out, manifests(tmp, which), category=category)
    assert p.returncode == 0, p.stdout + p.stderr
    return out, rows


def test_speculators_reads_every_row_of_the_training_folder(training_folder, tmp_path):
    import torch
    from safetensors.torch import load_file

    out, rows = training_folder
    loaded = run_checker("speculators", {"data": str(out / "speculators")}, tmp_path)
    assert len(loaded) == len(rows) == (12 if out.parent.name == "hidden_states" else 9)
    for i, item in enumerate(loaded):  # row i of the run, its states from its shard's file
        assert item["input_ids"].tolist() == rows[i]
        hs = load_file(out / layout.speculators_path(i))["hidden_states"]
        assert torch.equal(item["hidden_states"], hs[:, :-1].flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], hs[:, -1])


def test_specforge_reads_every_row_of_the_training_folder(training_folder, tmp_path):
    out, rows = training_folder
    loaded = run_checker("specforge", {"data": str(out / "specforge")}, tmp_path)
    assert len(loaded) == len(rows) == (12 if out.parent.name == "hidden_states" else 9)
    by_row = {int(Path(p).name.split("_")[1].split(".")[0]): v for p, v in loaded.items()}
    assert sorted(by_row) == list(range(len(rows)))  # the folder's numbering, as links
    for i, ids in enumerate(rows):
        assert by_row[i]["tensors"]["input_ids"].tolist() == ids


def test_specforge_reads_the_gzipped_rows_as_the_plain_ones(stage_out, model8, tmp_path):  # noqa: F811
    """layout specforge-gzip: SpecForge's own reader and feature loader read every .ckpt.gz,
    and its tensors are the plain layout's, exactly."""
    import torch

    out, rows, _, _ = stage_out
    gz_out = tmp_path / "gz"
    config = stage_config(model8, layouts=["specforge-gzip"])
    run_stage(tmp_path, config, out.parent / "000.parquet", gz_out, tmp_path / "journal")
    loaded = run_checker("specforge", {"data": str(gz_out / "specforge")}, tmp_path)
    assert len(loaded) == len(rows)
    for i in range(len(rows)):
        got = loaded[str((gz_out / layout.row_path("specforge-gzip", i)).resolve())]
        plain = torch.load(out / layout.specforge_path(i), weights_only=True)
        assert set(got["tensors"]) == set(plain)
        for k, v in plain.items():
            assert torch.equal(got["tensors"][k], v), (i, k)
