"""Run by tests/test_hidden_states_trainers.py with the python of tests/specforge/ensure_venv.sh.

Uses SGLang SpecForge's own offline reader (OfflineManifestReader, with its eager validation of
every file's keys and tensors) and its feature-file loader. Argument: a JSON spec {data, out}
and, for the training step, {model, mapping, rows}. Saves {file path: the tensors SpecForge
loaded} to out/loaded.pt.

With `model` (the target's folder) and `mapping` (the pipeline's vocab_mapping.pt) it also runs
one EAGLE-3 training step on the first `rows` files, with SpecForge's own code as its offline
trainer does: the draft config generated from the target's config (its EAGLE-3 defaults: one
llama layer) with the mapping's draft vocabulary size, the draft built by AutoDraftModel with
the mapping and the target's embedding loaded, OnlineEagle3Model (sdpa, ttt length 2) under
Eagle3TrainStrategy with the target's lm_head as its TargetHead; each file read by its reader
and normalised by its eagle3 offline normaliser, collated by its DataCollatorWithPadding. Then
backward. Saves {loss, plosses, grads: {name: (finite, norm)}} to out/step.pt.

Two CPU substitutions, both at SpecForge's own seams: its KL loss is a Triton kernel
(specforge/core/loss.py imports triton; there is no Triton on CPU), so `triton` is a stand-in
module at import time and the step uses that file's own reference `_compute_loss` (the same
formula, eager: TORCHDYNAMO_DISABLE); TargetHead.from_pretrained needs a *.index.json and an
untied lm_head, so the head is built by its constructor and given the checkpoint's lm_head
(the embedding when tied), in float32 (from_pretrained casts to bfloat16 for GPUs).
"""

import json
import os
import sys
import warnings
from pathlib import Path
from unittest import mock

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch  # noqa: E402

warnings.filterwarnings("ignore")

from specforge.runtime.data_plane.feature_store import load_feature_file  # noqa: E402
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader  # noqa: E402


def load_all(data: str) -> dict:
    refs = OfflineManifestReader(data, validate_files=True).read()
    loaded = {}
    for ref in refs:
        path = ref.feature_store_uri[len("file://") :]
        raw = load_feature_file(path)
        specs = {k: (tuple(s.shape), str(s.dtype)) for k, s in ref.feature_specs.items()}
        loaded[path] = {
            "tensors": {k: raw[k].clone() for k in ref.feature_keys},
            "num_tokens": ref.num_tokens,
            "specs": specs,
        }
    return loaded


def train_step(spec: dict, loaded: dict) -> dict:
    from types import SimpleNamespace

    import specforge.core.eagle3_adapters  # noqa: F401 - transformers first (see below)
    from safetensors import safe_open

    # no Triton on CPU (see the module docstring): a stand-in only while the loss module loads
    triton = mock.MagicMock(name="triton")
    sys.modules.update({"triton": triton, "triton.language": triton.language})
    try:
        import specforge.algorithms.eagle3.model as eagle3_model
        from specforge.core.loss import _compute_loss
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]
    from specforge.algorithms.eagle3.data import build_offline_collator, normalize_offline_sample
    from specforge.algorithms.eagle3.providers import algorithm_providers
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.model_loading import _generate_draft_config
    from specforge.training.strategies.base import Eagle3TrainStrategy

    class ReferenceLoss(torch.autograd.Function):  # LogSoftmaxLoss's interface, eager formula
        @staticmethod
        def apply(logits, target_p, position_mask):
            return _compute_loss(logits, target_p, position_mask)

    eagle3_model.LogSoftmaxLoss = ReferenceLoss

    model = spec["model"]
    mapping = torch.load(spec["mapping"], weights_only=True)
    cfg = SimpleNamespace(
        model=SimpleNamespace(target_model_path=model, cache_dir=None, trust_remote_code=False),
        training=SimpleNamespace(strategy="eagle3"),
    )
    draft_config = _generate_draft_config(cfg, algorithm_providers().model.draft_config)
    draft_config.draft_vocab_size = int(mapping["d2t"].numel())
    torch.manual_seed(0)
    draft = AutoDraftModel.from_config(
        draft_config, attention_backend="sdpa", torch_dtype=torch.float32
    )
    draft.load_vocab_mapping(spec["mapping"])
    draft.load_embedding(model)
    draft.freeze_embedding()
    wrapped = eagle3_model.OnlineEagle3Model(draft, length=2, attention_backend="sdpa")

    head = TargetHead(model)
    with safe_open(os.path.join(model, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        key = "lm_head.weight" if "lm_head.weight" in keys else "model.embed_tokens.weight"
        with torch.no_grad():
            head.fc.weight.copy_(f.get_tensor(key))
    head.freeze_weights()
    head = head.eval()

    paths = sorted(loaded)[: int(spec.get("rows", 2))]
    samples = [normalize_offline_sample(load_feature_file(p), max_len=4096) for p in paths]
    tensors = build_offline_collator()(samples)
    batch = TrainBatch(
        sample_ids=paths, strategy="eagle3", tensors=tensors,
        metadata={"target_repr": "hidden_state"},
    )  # fmt: skip
    strategy = Eagle3TrainStrategy(wrapped, target_head=head)
    out = strategy.forward_loss(batch)
    out.loss.backward()
    grads = {
        name: (bool(torch.isfinite(p.grad).all()), float(p.grad.norm()))
        for name, p in wrapped.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    return {
        "loss": float(out.loss.detach()),
        "plosses": [float(x) for x in out.metrics["plosses"]],
        "rows": len(paths),
        "tokens": int(tensors["input_ids"].numel()),
        "grads": grads,
        "trainable": [n for n, p in wrapped.named_parameters() if p.requires_grad],
        "draft_vocab_size": int(draft_config.draft_vocab_size),
    }


def main():
    spec = json.loads(sys.argv[1])
    loaded = load_all(spec["data"])
    torch.save(loaded, Path(spec["out"]) / "loaded.pt")
    print(f"specforge: ok ({len(loaded)} files)")
    if spec.get("model"):
        step = train_step(spec, loaded)
        torch.save(step, Path(spec["out"]) / "step.pt")
        print(f"specforge: step ok (loss {step['loss']:.4f}, {len(step['grads'])} grads)")


if __name__ == "__main__":
    main()
