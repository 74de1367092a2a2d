"""Run by tests/test_hidden_states_trainers.py with the python of tests/speculators/ensure_venv.sh.

Uses vLLM speculators' own offline data loader (speculators.train.data.ArrowDataset, which reads
a save_to_disk rows folder and <data>/hidden_states/hs_{i}.safetensors, skipping a row whose
token_ids differ from its input_ids). Argument: a JSON spec {data, out} and, for the forward
pass, {model, d2t, t2d, rows}. Loads every row with on_missing="raise" and float32 states and
saves what the loader returned to out/loaded.pt.

With `model` (the target's folder) and the pipeline's `d2t`/`t2d` files it also runs one
forward pass of speculators' EAGLE-3 draft model on the first `rows` rows, built as its trainer
builds it: `speculators train`'s own config (TrainConfig.resolve of a command line: the target
as verifier, the mapping files, the default aux layer ids [2, L//2, L-3]; on CPU the draft
attention `eager` and the loss `eager`, the two settings its help offers for hardware without
flex attention), its parse_vocab_mappings and build_draft_model; the batch from its
CollateFn with its eagle3 shift_batch (what its data loader does), the call with its
get_trainer_kwargs. Saves {loss, metrics, ...} to out/forward.pt. The backward is left out: its
trainer runs it on a GPU only.
"""

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from speculators.train.data import ArrowDataset  # noqa: E402


def forward_pass(spec: dict, ds: ArrowDataset) -> dict:
    import argparse

    from speculators.model import SpeculatorModel
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.cli import build_draft_model, parse_vocab_mappings
    from speculators.train.config import TrainConfig
    from speculators.train.data import CollateFn

    rows = int(spec.get("rows", 2))
    total = sum(int(ds[i]["input_ids"].shape[0]) for i in range(rows))
    argv = [
        "--verifier-name-or-path", spec["model"], "--data-path", spec["data"],
        "--d2t-path", spec["d2t"], "--t2d-path", spec["t2d"],
        "--draft-attn-impl", "eager", "--loss-implementation", "eager",
        "--ttt-steps", "2", "--total-seq-len", str(total),
        "--hidden-states-dtype", "float32", "--save-path", str(Path(spec["out"]) / "ckpt"),
    ]  # fmt: skip
    cfg = TrainConfig.resolve(argv)
    args = argparse.Namespace(**cfg.flatten())
    d2t, t2d, draft_vocab_size = parse_vocab_mappings(args)
    model_class = SpeculatorModel.registry[args.speculator_type]
    torch.manual_seed(0)
    model = build_draft_model(args, model_class, t2d, d2t, draft_vocab_size).float().eval()
    hidden_size = model.config.transformer_layer_config.hidden_size
    collate = CollateFn(
        total, hidden_size, num_target_layers=len(model.target_layer_ids),
        dtype=torch.float32, preprocess=shift_batch,
    )  # fmt: skip
    batch = collate([ds[i] for i in range(rows)])
    train_kwargs, _ = model_class.get_trainer_kwargs(**vars(args))
    with torch.no_grad():
        _draft, loss, metrics = model(**batch, **train_kwargs)
    return {
        "loss": float(loss),
        "rows": rows,
        "tokens": total,
        "speculator_type": args.speculator_type,
        "target_layer_ids": list(model.target_layer_ids),
        "draft_vocab_size": int(draft_vocab_size),
        "d2t": model.d2t.clone(),
        "t2d": model.t2d.clone(),
        "metrics": {
            k: float(v) for k, v in metrics.items() if torch.is_tensor(v) and v.numel() == 1
        },
    }


def main():
    spec = json.loads(sys.argv[1])
    ds = ArrowDataset(
        max_len=4096,
        datapath=spec["data"],
        on_missing="raise",
        hidden_states_dtype=torch.float32,
    )
    loaded = []
    for i in range(len(ds)):
        item = ds[i]
        if not isinstance(item, dict):
            raise SystemExit(f"speculators: row {i} unavailable: {item!r}")
        loaded.append({k: v for k, v in item.items() if isinstance(v, torch.Tensor)})
    torch.save(loaded, Path(spec["out"]) / "loaded.pt")
    print(f"speculators: ok ({len(loaded)} rows)")
    if spec.get("model"):
        out = forward_pass(spec, ds)
        torch.save(out, Path(spec["out"]) / "forward.pt")
        print(f"speculators: forward ok (loss {out['loss']:.4f})")


if __name__ == "__main__":
    main()
