"""The Hugging Face transformers backend: the reference (and the fallback) for hidden states.

The model runs in its own dtype over batches of rows sorted by length (right-padded, at most
`batch_tokens` padded tokens and `max_batch_rows` rows per forward). A batched float32 forward
differs from a batch-1 one by rounding (the padded shapes change the summation order); the
batches are a function of the whole shard, so a resumed job computes each row in the same batch
as an uninterrupted one and writes the same bytes (on CPU; GPU kernels may not be bit-exact
between runs). `max_batch_rows: 1` is bit-equal to a batch-1 Hugging Face forward. Layer id k < L is
`output_hidden_states[k]`; id L is caught by a forward hook on the last decoder layer, BEFORE
the final norm (Hugging Face's `hidden_states[L]` is after it); the normed last state
SpecForge stores is the model's own final norm applied to that, on the host, by the writer.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass
class RowStates:
    index: int
    states: object  # torch.Tensor [seq, n_layers, H], the configured ids in order
    norm: Callable  # the model's final norm: applied to layer L (SpecForge's hidden_state)

    def normed_last(self):
        """[seq, H]: the final norm of layer L (the last configured id). Computed on request,
        by the writer, only for the layouts that store it."""
        import torch

        with torch.inference_mode():
            return self.norm(self.states[:, -1])


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


# `max_batch_rows: auto` per device: on CPU a warm forward was fastest at 4 rows of the 4, 8,
# 16, 32 benchmarks/bench_hidden_states.py times; 16 on GPUs (larger batches fill them; not
# measured here).
AUTO_BATCH_ROWS = {"cpu": 4}
AUTO_BATCH_ROWS_GPU = 16


def batch_rows(setting: int | str, device: str) -> int:
    """hidden_states.max_batch_rows for a resolved device ("auto": by AUTO_BATCH_ROWS)."""
    if setting != "auto":
        return int(setting)
    return AUTO_BATCH_ROWS.get(device.split(":")[0], AUTO_BATCH_ROWS_GPU)


def batches(lengths: dict[int, int], batch_tokens: int, max_rows: int) -> list[list[int]]:
    """Row indices in batches, longest first; a batch's padded size (rows x longest) stays
    within batch_tokens unless one row alone is longer."""
    order = sorted(lengths, key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    for i in order:
        if (
            out
            and len(out[-1]) < max_rows
            and lengths[out[-1][0]] * (len(out[-1]) + 1) <= (batch_tokens)
        ):
            out[-1].append(i)
        else:
            out.append([i])
    return out


class HFBackend:
    def __init__(self, model_path: str, layers: list[int], device: str = "auto"):
        import torch
        from transformers import AutoModelForCausalLM

        self.device = pick_device(device)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
        self.model.to(self.device).eval()
        self.layers = list(layers)
        decoder = self.decoder = self.model.get_decoder()
        self.num_layers = len(decoder.layers)
        # The final norm runs where the rows' states are, on the host, on the writer's thread
        # (it is the model's own module: on CPU the same one)
        self.host_norm = copy.deepcopy(decoder.norm).to("cpu").eval()
        self._last = None

        def keep(_module, _args, output):
            self._last = output[0] if isinstance(output, tuple) else output

        decoder.layers[-1].register_forward_hook(keep)
        self.dtype = self.model.dtype
        self._torch = torch

    def run(self, rows: dict[int, list[int]], todo, batch_tokens: int, max_rows) -> Iterator:
        """RowStates of the rows in `todo` (indices into `rows`, index -> ids). The batches are
        cut from ALL rows of the shard and a batch with any row to do runs whole, so a row is
        always computed in the same batch (same padding, same float rounding): a resumed run
        writes the bytes an uninterrupted one would."""
        lengths = {i: len(ids) for i, ids in rows.items()}
        todo = set(todo)
        for batch in batches(lengths, batch_tokens, batch_rows(max_rows, self.device)):
            if todo.intersection(batch):
                yield from (r for r in self._forward(batch, rows) if r.index in todo)

    def close(self) -> None:
        return None

    def _forward(self, batch: list[int], rows: dict[int, list[int]]) -> list[RowStates]:
        torch = self._torch
        width = max(len(rows[i]) for i in batch)
        pad = 0
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(batch):
            ids[r, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
            mask[r, : len(rows[i])] = 1
        with torch.inference_mode():
            out = self.decoder(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device) if len(batch) > 1 else None,
                output_hidden_states=True,
                use_cache=False,
            )
            hidden = out.hidden_states
            per_layer = [self._last if k == self.num_layers else hidden[k] for k in self.layers]
            self._last = None
            # one copy per row, [seq, n_layers, H], on the host
            states = [
                torch.stack([h[r, : len(rows[i])] for h in per_layer], dim=1).to("cpu")
                for r, i in enumerate(batch)
            ]
        return [
            RowStates(index=i, states=s, norm=self.host_norm)
            for i, s in zip(batch, states, strict=True)
        ]
