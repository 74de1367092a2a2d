"""Run by tests/test_trainer_loaders.py with the python of tests/speculators/ensure_venv.sh.

Uses vLLM speculators' own code only: its pre-tokenized dataset path, its token-frequency
counter and vocab-mapping builder, its d2t/t2d file loader and the draft model's checks.
Argument: a JSON spec {export, out, max_lengths, draft_sizes, target_vocab_size, mappings}.
Writes, per max_length L: rows-L.json (the rows as speculators loaded them), counts-L.json
(its token_freq.pt), and per draft size N: d2t-L-N.npy, t2d-L-N.npy (its own mapping).
Raises if speculators rejects one of our mappings.
"""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from speculators.data_generation.preprocessing import (
    build_speculator_training_dataset,
    load_raw_dataset,
)
from speculators.model import DraftVocabMixin
from speculators.train.cli import _load_mappings
from speculators.train.vocab_mapping import (
    build_vocab_mappings_from_distribution,
    save_token_frequency_distribution,
)


class VocabOnly(DraftVocabMixin):
    """The d2t/t2d buffers and checks every speculators draft model (Eagle3, ...) has."""

    def __init__(self, draft_size, target_vocab_size):
        super().__init__()
        layer = SimpleNamespace(vocab_size=target_vocab_size, hidden_size=8, pad_token_id=None)
        self._init_vocab(
            SimpleNamespace(draft_vocab_size=draft_size, transformer_layer_config=layer)
        )


def main():
    spec = json.loads(sys.argv[1])
    out = Path(spec["out"])
    target = spec["target_vocab_size"]
    raw, _ = load_raw_dataset(spec["export"])
    for length in spec["max_lengths"]:
        ds = build_speculator_training_dataset(raw, processor=None, max_length=length, num_proc=1)
        rows = [
            {"input_ids": r["input_ids"].tolist(), "loss_mask": r["loss_mask"].tolist()} for r in ds
        ]
        (out / f"rows-{length}.json").write_text(json.dumps(rows))
        freq_path = out / f"token_freq-{length}.pt"
        save_token_frequency_distribution(ds, freq_path)
        freq = torch.load(freq_path, weights_only=True)
        counts = {str(k): int(v) for k, v in sorted(freq.items())}
        (out / f"counts-{length}.json").write_text(json.dumps(counts))
        for n in spec["draft_sizes"]:
            d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), n, target)
            np.save(out / f"d2t-{length}-{n}.npy", d2t.numpy())
            np.save(out / f"t2d-{length}-{n}.npy", t2d.numpy())

    for folder in spec["mappings"]:
        folder = Path(folder)
        d2t, t2d, n = _load_mappings(folder / "d2t.npy", folder / "t2d.npy", None)
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool, (d2t.dtype, t2d.dtype)
        model = VocabOnly(n, target)
        model.load_vocab_mappings(t2d, d2t)  # checks shapes and t2d.sum() == draft size
        assert torch.equal(model.d2t, d2t) and torch.equal(model.t2d, t2d)
        selected = torch.arange(n) + model.d2t
        assert bool(model.t2d[selected].all()), folder
    print("speculators: ok")


if __name__ == "__main__":
    main()
