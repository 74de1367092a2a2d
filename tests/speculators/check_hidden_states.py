"""Run by tests/test_hidden_states_trainers.py with the python of tests/speculators/ensure_venv.sh.

Uses vLLM speculators' own offline data loader (speculators.train.data.ArrowDataset, which reads
a save_to_disk rows folder and <data>/hidden_states/hs_{i}.safetensors, skipping a row whose
token_ids differ from its input_ids). Argument: a JSON spec {data, out}. Loads every row with
on_missing="raise" and float32 states and saves what the loader returned to out/loaded.pt.
"""

import json
import sys
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")

from speculators.train.data import ArrowDataset  # noqa: E402


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


if __name__ == "__main__":
    main()
