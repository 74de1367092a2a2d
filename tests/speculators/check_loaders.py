"""Run by tests/test_trainer_loaders.py with the python of tests/speculators/ensure_venv.sh.

Uses vLLM speculators' own code only: its pre-tokenized dataset path, its token-frequency
counter and vocab-mapping builder, its d2t/t2d file loader and the draft model's checks.
Argument: a JSON spec {export, out, max_lengths, draft_sizes, target_vocab_size, mappings,
optional model}. Writes, per max_length L: rows-L.json (the rows as speculators loaded them),
counts-L.json (its token_freq.pt), and per draft size N: d2t-L-N.npy, t2d-L-N.npy (its own
mapping). With `model` (the target model folder; prepare-data loads its processor), also its
prepare-data function itself (load_and_preprocess_dataset, --seq-length L, token frequencies
on): prepared-counts-L.json and prepared-d2t-L-N.npy, prepared-t2d-L-N.npy.
Each of our mapping folders must hold d2t-N.npy / t2d-N.npy that `speculators train` finds in
its data folder (parse_vocab_mappings, no --d2t-path) without building its own.
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
    load_and_preprocess_dataset,
    load_raw_dataset,
)
from speculators.model import DraftVocabMixin
from speculators.train.cli import parse_vocab_mappings
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

    if spec.get("model"):
        for length in spec["max_lengths"]:
            freq_path = out / f"prepared-token_freq-{length}.pt"
            load_and_preprocess_dataset(
                spec["model"],
                [spec["export"]],
                seq_length=length,
                build_dataset_num_proc=1,
                token_freq_path=freq_path,
                skip_token_freq=False,
            )
            freq = torch.load(freq_path, weights_only=True)
            counts = {str(k): int(v) for k, v in sorted(freq.items())}
            (out / f"prepared-counts-{length}.json").write_text(json.dumps(counts))
            for n in spec["draft_sizes"]:
                d2t, t2d = build_vocab_mappings_from_distribution(dict(freq), n, target)
                np.save(out / f"prepared-d2t-{length}-{n}.npy", d2t.numpy())
                np.save(out / f"prepared-t2d-{length}-{n}.npy", t2d.numpy())

    for folder in spec["mappings"]:
        folder = Path(folder)
        (d2t_file,) = folder.glob("d2t-*.npy")
        n = int(d2t_file.stem.split("-")[1])
        # What `speculators train --data-path FOLDER --draft-vocab-size N` does: it finds our
        # files by name. No token_freq.pt and a verifier that does not exist: had it not found
        # them, it could only fail.
        args = SimpleNamespace(
            d2t_path=None,
            t2d_path=None,
            data_path=str(folder),
            draft_vocab_size=n,
            token_freq_path=str(folder / "no-token_freq.pt"),
            verifier_name_or_path=str(folder / "no-verifier"),
            trust_remote_code=False,
        )
        d2t, t2d, n = parse_vocab_mappings(args)
        assert torch.equal(d2t, torch.from_numpy(np.load(d2t_file))), folder
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool, (d2t.dtype, t2d.dtype)
        model = VocabOnly(n, target)
        model.load_vocab_mappings(t2d, d2t)  # checks shapes and t2d.sum() == draft size
        assert torch.equal(model.d2t, d2t) and torch.equal(model.t2d, t2d)
        selected = torch.arange(n) + model.d2t
        assert bool(model.t2d[selected].all()), folder
    print("speculators: ok")


if __name__ == "__main__":
    main()
