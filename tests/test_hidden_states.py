"""The hidden_states stage (tokenmill/hidden_states/, docs/hidden-states.md): its config, the
values it stores against a Hugging Face forward pass, its two layouts, exactly-once files across
SIGKILLs, and the plan's byte estimate. The Snakemake run (provenance, verify) is in
test_hidden_states_workflow.py."""

from __future__ import annotations

import copy
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from helpers import tool_env

from tokenmill import contracts
from tokenmill import layout as run_layout
from tokenmill.config import ConfigError, check_config, outputs_config
from tokenmill.hidden_states import job, layout
from tokenmill.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LAYERS = 8  # the test model: >= 6 layers, float32
LONG_ROWS = (1000, 1600)  # tokens of the rows the exactness bound is stated on


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def model8(tmp_path_factory) -> Path:
    """A tiny random-weight Qwen2 LM with 8 layers in float32, on the demo's tokenizer."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tokenmill.testing.tiny_model import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("model8")
    tok = build_tiny_tokenizer(out)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    # Values of order 1 (std 0.02, as HF's init): a batched float32 forward then differs from
    # batch 1 by rounding only (a few 1e-7); norm weights away from 1, so the norm shows.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            else:
                p.uniform_(0.5, 1.5)  # norm weights away from 1
    model.save_pretrained(out)
    return out


def make_dataset(
    path: Path,
    n: int,
    seed: int = 0,
    vocab: int = 700,
    lengths: tuple[int, int] = (5, 60),
    long_rows: int = 0,
) -> list[list[int]]:
    """A merged dataset shard (contracts.DATASET) of n rows of random ids (5..60 by default),
    the last `long_rows` of them 1,000..1,600 ids long."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        length = rng.randint(*(LONG_ROWS if i >= n - long_rows else lengths))
        p = rng.randint(1, length - 1)
        ids = [rng.randrange(vocab) for _ in range(length)]
        rows.append(
            dict(
                prompt_id=f"p{i}",
                category="c",
                sample_key=f"k{i}",
                input_ids=ids,
                loss_mask=[0] * p + [1] * (length - p),
                num_prompt_tokens=p,
                num_output_tokens=length - p,
                num_reasoning_tokens=None,
                num_answer_tokens=None,
                num_total_tokens=length,
                finish_type="stop",
            )
        )
    table = pa.Table.from_pylist(rows, schema=contracts.DATASET)
    contracts.write_table(table, path, contracts.DATASET, "merge")
    return [r["input_ids"] for r in rows]


def stage_config(model: Path, **hidden_states) -> dict:
    """A stage config writing both layouts unless `layouts` is given."""
    hidden_states = {"layouts": ["speculators", "specforge"], **hidden_states}
    return {
        "tokenizer": {"path": str(model)},
        "categories": {"c": {"sources": ["x"], "format": "messages"}},
        "generation": {"model": str(model)},
        "hidden_states": {"enabled": True, **hidden_states},
    }


def stage_cmd(tmp: Path, config: dict, dataset: Path, out: Path, journal: Path) -> list[str]:
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps(config))
    return [
        str(BIN / "tokenmill"), "hidden-states", "--category", "c", "--shard", "000",
        "--dataset", str(dataset), "--out-dir", str(out), "--config-json", str(cfg),
        "--journal-dir", str(journal),
    ]  # fmt: skip


def run_stage(*args, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        stage_cmd(*args, **kwargs), env=tool_env(), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc


def tree(d: Path) -> dict[str, str]:
    return {
        p.relative_to(d).as_posix(): contracts.sha256_file(p)
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def check_against_hf(out: Path, rows: list[list[int]], model_dir: Path, tol: float = 1e-6):
    """Every stored layer of every row (default ids [2, 4, 5, 8]) against a batch-1 HF forward
    pass of the same ids; id L against HF's last decoder layer output before the final norm
    (a hook on HF's own forward); SpecForge's hidden_state = RMSNorm (the model's weight and
    eps) of the speculators file's last layer, its aux = the other layers concatenated."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["layer_ids"] == [2, 4, 5, 8] and manifest["dtype"] == "float32"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weight = model.model.norm.weight.detach()
    eps = model.config.rms_norm_eps
    caught = {}  # HF's own last decoder layer output, before its final norm
    model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: caught.update(last=out[0] if isinstance(out, tuple) else out)
    )
    worst = 0.0
    for i, ids in enumerate(rows):
        with torch.no_grad():
            ref = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        pre_norm = caught["last"][0]
        assert torch.equal(model.model.norm(pre_norm), ref[LAYERS][0])  # HF's [L] is normed
        spec = load_file(out / layout.speculators_path(i))
        assert spec["token_ids"].dtype == torch.int64 and spec["token_ids"].tolist() == ids
        hs = spec["hidden_states"]
        assert hs.dtype == torch.float32 and tuple(hs.shape) == (len(ids), 4, 64)
        for j, want in enumerate([ref[2][0], ref[4][0], ref[5][0], pre_norm]):
            diff = (hs[:, j] - want).abs().max().item()
            worst = max(worst, diff)
            assert diff <= tol, (i, j, diff)
        last = hs[:, 3]
        assert (last - ref[LAYERS][0]).abs().max().item() > 1e-2  # stored before the norm
        normed = weight * (last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + eps))
        sf = torch.load(out / layout.specforge_path(i), weights_only=True)
        assert sorted(sf) == ["aux_hidden_state", "hidden_state", "input_ids", "loss_mask"]
        assert sf["input_ids"].tolist() == ids and sf["loss_mask"].dtype == torch.int64
        assert tuple(sf["hidden_state"].shape) == (1, len(ids), 64)
        assert (sf["hidden_state"][0] - normed).abs().max().item() <= 1e-6
        assert torch.equal(sf["aux_hidden_state"][0], hs[:, :3].reshape(len(ids), 3 * 64))
    return worst


# ------------------------------------------------------------------------------ config


def demo_config() -> dict:
    return yaml.safe_load((ROOT / "config.yaml").read_text())


def test_the_stage_is_off_by_default_and_leaves_the_demo_as_it_was():
    cfg = check_config(demo_config(), ROOT)
    s = Settings.from_validated(cfg)
    assert s.hidden_states.enabled is False and s.hidden_states.layers is None
    assert s.hidden_states.layouts == ("speculators",)  # one layout: each layer stored once
    # The rerun trigger of stats, card and provenance does not see the disabled section.
    assert "hidden_states" not in outputs_config(s)
    on = demo_config()
    on["hidden_states"] = {"enabled": True, "layers": [0, 1, 2], "drafter": "other",
                           "batch_tokens": 99}  # fmt: skip
    view = outputs_config(check_config(on, ROOT))
    assert view["hidden_states"] == {
        "enabled": True,
        "backend": "hf",
        "model": None,
        "layers": [0, 1, 2],
        "layouts": ["speculators"],
    }


def test_default_layers_and_their_checks():
    assert layout.resolve_layers(None, 8) == [2, 4, 5, 8]
    assert layout.resolve_layers(None, 32) == [2, 16, 29, 32]
    assert layout.resolve_layers([1, 3, 6, 8], 8) == [1, 3, 6, 8]
    assert layout.resolve_layers([1, 3, 8], 8, "other") == [1, 3, 8]  # e.g. DFlash's choice
    for bad, why in (([2, 4, 9], "must be in 0..L"), ([2, 4, 5], "must be L"), ([8], "auxiliary")):
        with pytest.raises(layout.LayoutError, match=why):
            layout.resolve_layers(bad, 8, "other")
    # an EAGLE-3 drafter reads three auxiliary layers: two or four fail, naming the way out
    for bad in ([1, 3, 8], [1, 2, 3, 4, 8]):
        with pytest.raises(layout.LayoutError, match=r"hidden_states\.drafter: other"):
            layout.resolve_layers(bad, 8)
    with pytest.raises(layout.LayoutError, match=r"= \[2, 1, -1, 2\] for L = 2"):
        layout.resolve_layers(None, 2)  # the 2-layer demo model needs explicit ids


def test_a_bad_hidden_states_config_fails_before_any_job_naming_the_key():
    cfg = demo_config()
    cfg["hidden_states"] = {"enabled": True}  # the demo model has 2 layers: no default ids
    with pytest.raises(ConfigError, match=r"hidden_states\.layers"):
        check_config(copy.deepcopy(cfg), ROOT)
    # the demo suggestion of old, two auxiliary layers: not what an EAGLE-3 drafter trains on
    cfg["hidden_states"] = {"enabled": True, "layers": [0, 1, 2]}
    with pytest.raises(ConfigError, match=r"'hidden_states\.layers': \[0, 1, 2\] gives 2 aux"):
        check_config(copy.deepcopy(cfg), ROOT)
    cfg["hidden_states"] = {"enabled": True, "layers": [0, 1, 2], "model": "no/such-model-here"}
    with pytest.raises(ConfigError, match=r"hidden_states\.model"):
        check_config(copy.deepcopy(cfg), ROOT)
    cfg["hidden_states"] = {"enabled": True, "layers": [0, 1, 2], "drafter": "other",
                            "backend": "vllm"}  # fmt: skip
    with pytest.raises(ConfigError, match=r"hidden_states\.launch\.command': required for"):
        check_config(copy.deepcopy(cfg), ROOT)
    cfg["hidden_states"] = {"enabled": True, "layouts": ["eagle"]}
    with pytest.raises(ConfigError, match=r"hidden_states\.layouts"):
        check_config(copy.deepcopy(cfg), ROOT)
    cfg["hidden_states"] = {"enabled": True, "layers": [0, 1, 2], "drafter": "other",
                            "layouts": ["specforge", "specforge-gzip"]}  # fmt: skip
    with pytest.raises(ConfigError, match=r"'hidden_states\.layouts': specforge and specforge-gz"):
        check_config(copy.deepcopy(cfg), ROOT)
    cfg["hidden_states"] = {"enabled": True, "layers": [0, 1, 2], "drafter": "other",
                            "resources": {"gpus": 2}}  # fmt: skip
    cfg["generation"]["resources"] = {"gpus": 8, "runtime_min": 100, "mem_mb": 1000}
    from tokenmill.hidden_states.stage import job_resources

    r = job_resources(Settings.from_validated(check_config(copy.deepcopy(cfg), ROOT)), 2)
    # generation.resources with hidden_states.resources over it; runtime and memory grow
    assert (r["gpu"], r["nodes"], r["runtime"], r["mem_mb"]) == (2, 1, 200, 2000)


def test_plan_bytes_formula():
    # 7B-class: H 4096, 4 layers, bf16: 32 KiB of states per token (the reference's figure)
    assert layout.bytes_per_token("speculators", 4, 4096, 2) == 32768 + 8
    assert layout.bytes_per_token("specforge", 4, 4096, 2) == 32768 + 16
    assert layout.specforge_path(4321) == "specforge/rows_4000-6000/data_4321.ckpt"
    assert layout.speculators_path(7) == "speculators/hidden_states/hs_7.safetensors"


# ------------------------------------------------------------------------------ values


@pytest.mark.slow
def test_every_stored_layer_equals_a_hugging_face_forward_pass(model8, tmp_path):
    """Both layouts, every row, every layer, float32: within 1e-6 of HF's own forward pass of
    the same ids (batch 1, output_hidden_states=True); id L is the last decoder layer's output
    BEFORE the final norm (read with a hook on HF's own forward; HF's hidden_states[L] is that
    output normed); SpecForge's hidden_state is the RMSNorm
    (model's weight and eps) of the speculators file's last layer, its aux the other layers."""
    rows = make_dataset(tmp_path / "000.parquet", 10)
    out, journal = tmp_path / "out", tmp_path / "journal"
    run_stage(tmp_path, stage_config(model8), tmp_path / "000.parquet", out, journal)
    check_against_hf(out, rows, model8)
    assert job.verify_shard(out) == []
    # speculators' rows folder: input_ids, loss_mask (int64) and seq_len, row i = hs_i
    import datasets

    ds = datasets.load_from_disk(str(out / "speculators"))
    assert ds.format["type"] == "torch"  # as speculators' prepare-data saves it
    ds = ds.with_format(None)
    assert ds["input_ids"] == rows and ds["seq_len"] == [len(r) for r in rows]
    assert ds.features["loss_mask"].feature.dtype == "int64"


def relative_errors(
    out: Path, rows: list[list[int]], model_dir: Path, dtype: str = "float32"
) -> list[float]:
    """Per stored layer (default ids [2, 4, 5, 8]): the largest over rows of
    max |stored - batch-1 HF forward| / max |batch-1 HF forward| (0.0: bit-equal), the
    forward in `dtype`, the difference taken in float32."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    caught = {}
    model.model.layers[-1].register_forward_hook(
        lambda _m, _a, o: caught.update(last=o[0] if isinstance(o, tuple) else o)
    )
    worst = [0.0] * 4
    for i, ids in enumerate(rows):
        with torch.no_grad():
            ref = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        hs = load_file(out / layout.speculators_path(i))["hidden_states"].float()
        for j, want in enumerate([ref[2][0], ref[4][0], ref[5][0], caught["last"][0]]):
            want = want.float()
            rel = ((hs[:, j] - want).abs().max() / want.abs().max()).item()
            worst[j] = max(worst[j], rel)
    return worst


def batched_and_batch1_errors(model: Path, tmp_path: Path, dtype: str = "float32") -> dict:
    """relative_errors of the stage's default batching and of max_batch_rows: 1 (outputs in
    tmp_path/batched and tmp_path/batch1) on 6 rows of 1,000-1,600 tokens."""
    rows = make_dataset(tmp_path / "000.parquet", 6, seed=7, lengths=LONG_ROWS)
    found = {}
    for name, extra in (("batched", {}), ("batch1", {"max_batch_rows": 1})):
        out = tmp_path / name
        cfg = stage_config(model, **extra)
        run_stage(tmp_path, cfg, tmp_path / "000.parquet", out, tmp_path / f"journal-{name}")
        found[name] = relative_errors(out, rows, model, dtype)
    return found


@pytest.mark.slow
def test_exactness_on_long_rows_as_the_docs_state_it(model8, tmp_path):
    """docs/hidden-states.md's bounds, on rows of 1,000-1,600 tokens (float32, weights of std
    0.02 as HF initialises them): the default batching (the rows padded into one batch) within
    1e-6 of a batch-1 HF forward relative to the layer's largest value; max_batch_rows: 1
    bit-equal."""
    found = batched_and_batch1_errors(model8, tmp_path)
    print("max relative error per layer:", found)
    assert found["batch1"] == [0.0] * 4
    assert 0.0 < max(found["batched"]) <= 1e-6  # padding changes the summation order


@pytest.fixture(scope="module")
def model8_bf16(model8, tmp_path_factory) -> Path:
    """model8's weights rounded to bfloat16 and saved so (torch_dtype bfloat16), its tokenizer
    beside them."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("model8_bf16")
    for f in model8.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    model = AutoModelForCausalLM.from_pretrained(model8, dtype=torch.float32)
    model.to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.mark.slow
def test_exactness_in_bfloat16_at_its_precision(model8_bf16, tmp_path):
    """A bfloat16 model's states are stored in bfloat16: max_batch_rows: 1 is bit-equal to a
    batch-1 HF forward in bfloat16; the default batching differs by bfloat16 rounding in a
    different summation order, bounded relative to the layer's largest value (bfloat16's unit
    roundoff is 2**-8; docs/hidden-states.md)."""
    from safetensors import safe_open

    found = batched_and_batch1_errors(model8_bf16, tmp_path, "bfloat16")
    for name in found:
        with safe_open(tmp_path / name / layout.speculators_path(0), "pt") as f:
            assert str(f.get_tensor("hidden_states").dtype) == "torch.bfloat16"
    print("max relative error per layer (bfloat16):", found)
    assert found["batch1"] == [0.0] * 4
    assert 0.0 < max(found["batched"]) <= 2**-6  # 4 units of roundoff; measured 1.2-2.2


# ------------------------------------------------------------------------------ exactly once


@pytest.mark.slow
def test_sigkill_five_times_then_every_row_once_and_byte_equal(model8, tmp_path):
    """Kill the stage command at random points (while it writes rows) five times, resume each
    time: every row's files exist once, byte-equal to an unkilled run, nothing else left."""
    dataset = tmp_path / "000.parquet"
    # A kill lands about 10 rows after the previous one here, more on a loaded machine: enough
    # rows that five kills cannot reach the end (with 48, CI's fourth kill found it finished).
    n = 160
    make_dataset(dataset, n, seed=1)
    config = stage_config(model8, max_batch_rows=2, batch_tokens=128)
    ref_out = tmp_path / "ref"
    run_stage(tmp_path, config, dataset, ref_out, tmp_path / "ref_journal")
    reference = tree(ref_out)
    assert len(reference) == 2 * n + 1 + 3  # two layouts, manifest, the rows folder

    out, journal = tmp_path / "out", tmp_path / "journal"
    jfile = Path(run_layout.Layout("results", str(journal)).hidden_states_journal("c", "000"))
    rng = random.Random(21)
    done_before = []
    for kill in range(5):
        proc = subprocess.Popen(
            stage_cmd(tmp_path, config, dataset, out, journal),
            env=tool_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # a random number of further journaled rows, then a random extra delay
        start = len(jfile.read_text().splitlines()) - 1 if jfile.exists() else 0
        target = start + rng.randint(1, 6)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            lines = len(jfile.read_text().splitlines()) - 1 if jfile.exists() else 0
            if lines >= target:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.05))
        assert proc.poll() is None, f"kill {kill}: the stage finished before it was killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done_before.append(len(jfile.read_text().splitlines()) - 1)
    assert done_before == sorted(done_before) and done_before[-1] < n
    proc = run_stage(tmp_path, config, dataset, out, journal)
    assert "already done" in proc.stderr
    assert tree(out) == reference
    assert not any(layout.is_leftover(p.name) for p in out.rglob("*"))


@pytest.mark.slow
def test_leftovers_and_rows_of_a_shrunk_shard_are_removed(model8, tmp_path):
    dataset = tmp_path / "000.parquet"
    make_dataset(dataset, 6)
    out, journal = tmp_path / "out", tmp_path / "journal"
    config = stage_config(model8, layouts=["speculators"])
    run_stage(tmp_path, config, dataset, out, journal)
    hs_dir = out / "speculators" / "hidden_states"
    (hs_dir / ".hs_3.safetensors.abc.tmp").write_bytes(b"partial")
    (hs_dir / "hs_3.safetensors.lock").write_bytes(b"")
    make_dataset(dataset, 4)  # the same first rows, two fewer
    proc = run_stage(tmp_path, config, dataset, out, journal)
    assert "4 already done, 0 to compute" in proc.stderr
    assert sorted(p.name for p in hs_dir.iterdir()) == [f"hs_{i}.safetensors" for i in range(4)]
    assert not (out / "specforge").exists()
    assert job.verify_shard(out) == []
    # a changed row is recomputed, the others are not
    rows = make_dataset(dataset, 4, seed=5)
    proc = run_stage(tmp_path, config, dataset, out, journal)
    assert "0 already done, 4 to compute" in proc.stderr
    from safetensors.torch import load_file

    assert load_file(hs_dir / "hs_2.safetensors")["token_ids"].tolist() == rows[2]


@pytest.mark.parametrize("threads", [1, 3])
def test_the_row_writer_journals_only_written_rows_and_raises_a_failed_write(
    tmp_path, monkeypatch, threads
):
    """Rows are written on the writer's thread while the caller goes on: a failed write is
    raised to the caller, every row journaled has its file with the journaled size, and the
    failed row is not journaled (the next run computes it)."""
    import numpy as np
    import torch

    from tokenmill.hidden_states.hf import RowStates

    real = layout.write_atomic

    def flaky(path, data):
        if Path(path).name == "hs_2.safetensors":
            raise OSError(28, "No space left on device")
        real(path, data)

    monkeypatch.setattr(layout, "write_atomic", flaky)
    out = tmp_path / "out"
    journal = job.Journal(tmp_path / "journal.jsonl", {"fp": 1})
    ids = np.arange(10, 20, dtype=np.int64)
    mask = np.ones(10, dtype=np.int64)
    # the raise may come from a later put or from the exit: both are inside the block
    with (  # noqa: PT012
        pytest.raises(OSError, match="No space left"),
        job.RowWriter(out, journal, ("speculators",), max_tokens=20, threads=threads) as writer,
    ):
        for i in range(6):
            states = torch.full((10, 4, 8), float(i))
            writer.put(RowStates(index=i, states=states, norm=lambda x: x), ids, mask, f"k{i}")
    journal.close()
    done = job.Journal(tmp_path / "journal.jsonl", {"fp": 1}).done
    assert 2 not in done and {0, 1} <= set(done)
    for i, rec in done.items():
        for rel, (size, _sha) in rec["files"].items():
            assert (out / rel).stat().st_size == size, (i, rel)
    assert not (out / layout.row_path("speculators", 2)).exists()


@pytest.mark.slow
def test_specforge_gzip_rows_are_the_plain_rows_gzipped_and_deterministic(model8, tmp_path):
    """layout specforge-gzip: data_{i}.ckpt.gz whose content is byte for byte the specforge
    layout's data_{i}.ckpt; a second run writes the same bytes; a training folder links them."""
    import gzip

    from tokenmill.hidden_states import training

    dataset = tmp_path / "dataset" / "c" / "000.parquet"
    dataset.parent.mkdir(parents=True)
    n = len(make_dataset(dataset, 5, lengths=(300, 600)))
    outs = {}
    for name, lays in (
        ("plain", ["specforge"]),
        ("gz", ["specforge-gzip"]),
        ("gz2", ["specforge-gzip"]),
    ):
        out = tmp_path / name / "hidden_states" / "c" / "000"
        run_stage(
            tmp_path, stage_config(model8, layouts=lays), dataset, out, tmp_path / f"j-{name}"
        )
        outs[name] = out
    ratios = []
    for i in range(n):
        plain = (outs["plain"] / layout.row_path("specforge", i)).read_bytes()
        gz = (outs["gz"] / layout.row_path("specforge-gzip", i)).read_bytes()
        assert layout.row_path("specforge-gzip", i).endswith(".ckpt.gz")
        assert gzip.decompress(gz) == plain
        assert (outs["gz2"] / layout.row_path("specforge-gzip", i)).read_bytes() == gz
        ratios.append(len(gz) / len(plain))
    print("gzip ratio (float32, model8):", [round(r, 3) for r in ratios])
    assert all(r < 1 for r in ratios)
    assert not list(outs["gz"].rglob("*.ckpt")) and job.verify_shard(outs["gz"]) == []
    all_dir = outs["gz"].parent.parent / "all"
    training.build(all_dir, [outs["gz"] / layout.MANIFEST])
    assert (all_dir / layout.row_path("specforge-gzip", n - 1)).read_bytes() == gz
    assert training.problems(all_dir) == []
