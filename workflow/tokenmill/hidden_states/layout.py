"""What the hidden_states stage writes, where, and how many bytes: the trainers' two layouts.

Layer ids follow vLLM's `extract_hidden_states` (docs/hidden-states.md): id k < L is the
residual stream after k decoder layers (Hugging Face `output_hidden_states[k]`, 0 = the
embeddings); id L is the last layer's output BEFORE the final norm. The default ids are
[2, L//2, L-3, L]; the last id must be L (both trainers read the last entry as the verifier's
last state), the ones before it are the auxiliary layers.

One folder per dataset shard, `results/hidden_states/{category}/{shard}/`; row i is the i-th
row of `results/dataset/{category}/{shard}.parquet` (its order is stable), so the indices are
local to the shard and a shard's files depend on that shard alone. Each shard folder is a
complete data folder for either trainer:

    speculators/                      a `datasets` save_to_disk folder of the rows
                                      (input_ids, loss_mask int64, seq_len) and
    speculators/hidden_states/hs_{i}.safetensors
                                      token_ids [seq] int64, hidden_states [seq, n, H]
    specforge/rows_{g}-{g+2000}/data_{i}.ckpt
                                      torch.save dict: input_ids [seq], loss_mask [seq] (int64),
                                      hidden_state [1, seq, H] = final norm of layer L,
                                      aux_hidden_state [1, seq, (n-1)H] (the aux layers in order)
    specforge/rows_{g}-{g+2000}/data_{i}.ckpt.gz
                                      layout specforge-gzip: the same bytes gzipped (SpecForge
                                      reads .ckpt.gz too), level 1, no name or date in the header
    manifest.json                     the completion marker: every file's size and sha256

Every value is in the model's dtype. Files are byte-deterministic: safetensors sorts its header,
and torch.save writes to memory (its zip entries carry a fixed date and the archive name
"archive", not the file's name) before the bytes go to disk.

This module imports no torch at module level: `tokenmill plan` uses the byte formula.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenmill import layout as run_layout
from tokenmill import model as model_files
from tokenmill.contracts import atomic_path

LAYOUTS = ("speculators", "specforge", "specforge-gzip")
# specforge-gzip: SpecForge's rows gzipped; gzip level 1 (level 6 saved under 1 % more on bf16
# activations at a third of the speed: benchmarks/bench_ckpt_gzip.py)
GZIP_LEVEL = 1
SPECFORGE_GROUP = 2000  # SpecForge's rows_{g}-{g+2000} folders
MANIFEST = run_layout.HIDDEN_STATES_MANIFEST  # contracts.HiddenStatesManifest
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ROWS_FILES = ("data-00000-of-00001.arrow", "dataset_info.json", "state.json")


class LayoutError(ValueError):
    """A model or layer list the layouts cannot hold."""


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    dtype: str  # float32 | bfloat16 | float16
    rms_norm_eps: float | None
    where: str  # the config.json read

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def model_dir(name: str | None, basedir=".", revision: str | None = None) -> Path | None:
    """A local model directory, or a hub id's snapshot in the local cache; None otherwise."""
    local = model_files.local_dir(name, basedir)
    if local is not None or not name:
        return local
    hub = model_files.hub_id_of(name)
    return model_files.hub_cache_dir(hub, revision) if hub else None


def model_shape(name: str | None, basedir=".", revision: str | None = None) -> ModelShape:
    """Layers, hidden size and dtype from the model's config.json (text_config for multimodal
    models). Raises LayoutError when the config is not on this machine."""
    where = model_dir(name, basedir, revision)
    if where is None:
        raise LayoutError(f"model {name!r} is not a local directory nor in the Hugging Face cache")
    try:
        cfg = json.loads((where / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise LayoutError(f"cannot read {where / 'config.json'}: {exc}") from exc
    text = cfg.get("text_config") or cfg
    dtype = str(text.get("dtype") or text.get("torch_dtype") or cfg.get("dtype") or "float32")
    if dtype not in DTYPE_BYTES:
        raise LayoutError(f"{where / 'config.json'}: unsupported dtype {dtype!r}")
    try:
        return ModelShape(
            num_layers=int(text["num_hidden_layers"]),
            hidden_size=int(text["hidden_size"]),
            dtype=dtype,
            rms_norm_eps=text.get("rms_norm_eps"),
            where=str(where / "config.json"),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise LayoutError(f"{where / 'config.json'}: no {exc}") from exc


def default_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3, num_layers]


EAGLE3_AUX_LAYERS = 3  # SpecForge's EAGLE-3 draft asserts 3H auxiliary states, speculators' 3


def resolve_layers(layers, num_layers: int, drafter: str = "eagle3") -> list[int]:
    """The configured ids (None: the default) checked against an L-layer model and the
    drafter they are for (eagle3: exactly three auxiliary ids; other: one or more)."""
    ids = list(layers) if layers is not None else default_layers(num_layers)
    key = "hidden_states.layers"
    if layers is None:
        ids_text = f"null gives [2, L//2, L-3, L] = {ids} for L = {num_layers}"
    else:
        ids_text = str(ids)
    if any(k < 0 or k > num_layers for k in ids):
        raise LayoutError(f"config key '{key}': {ids_text}: ids must be in 0..L = {num_layers}")
    if len(set(ids)) != len(ids):
        raise LayoutError(f"config key '{key}': {ids_text}: repeated ids")
    if ids[-1] != num_layers:
        raise LayoutError(
            f"config key '{key}': {ids_text}: the last id must be L = {num_layers} (the "
            "trainers read the last entry as the last layer before the final norm)"
        )
    if len(ids) < 2:
        raise LayoutError(f"config key '{key}': needs at least one auxiliary layer before L")
    if drafter == "eagle3" and len(ids) != EAGLE3_AUX_LAYERS + 1:
        raise LayoutError(
            f"config key '{key}': {ids_text} gives {len(ids) - 1} auxiliary layers; an EAGLE-3 "
            f"drafter (SpecForge, speculators) trains on {EAGLE3_AUX_LAYERS} plus L, so "
            f"give {EAGLE3_AUX_LAYERS + 1} ids ending with L = {num_layers}, or set "
            "hidden_states.drafter: other for a drafter that wants other layers (such as DFlash)"
        )
    return ids


def bytes_per_token(layout: str, n_layers: int, hidden_size: int, dtype_bytes: int) -> int:
    """Tensor bytes per token (headers and the rows folder not counted): speculators stores
    n layers and token_ids (int64); SpecForge (n-1) aux layers, the normed last, input_ids and
    loss_mask (int64 each). For specforge-gzip, the bytes before gzip: an upper bound."""
    states = n_layers * hidden_size * dtype_bytes
    return states + (8 if layout == "speculators" else 16)


def speculators_path(i: int) -> str:
    return f"speculators/hidden_states/hs_{i}.safetensors"


def specforge_path(i: int, gzipped: bool = False) -> str:
    g = i // SPECFORGE_GROUP * SPECFORGE_GROUP
    return f"specforge/rows_{g}-{g + SPECFORGE_GROUP}/data_{i}.ckpt" + (".gz" if gzipped else "")


def is_gzipped(layout: str) -> bool:
    """Whether a layout's row files are gzipped (.ckpt.gz)."""
    return layout == "specforge-gzip"


def row_path(layout: str, i: int) -> str:
    if layout == "speculators":
        return speculators_path(i)
    return specforge_path(i, gzipped=is_gzipped(layout))


def folder(layout: str) -> str:
    """The folder a layout's files are in, in a shard folder or a training folder."""
    return "speculators" if layout == "speculators" else "specforge"


def folder_conflicts(layouts) -> str | None:
    """Why these layouts cannot be written together (specforge and specforge-gzip share the
    specforge/ folder and SpecForge would read both), or None."""
    if {"specforge", "specforge-gzip"} <= set(layouts):
        return "specforge and specforge-gzip write the same rows into specforge/: pick one"
    return None


def row_index(rel: str) -> int | None:
    """The row whose file `rel` is (row_path's inverse); None for any other path."""
    name = rel.rsplit("/", 1)[-1]
    for prefix, folder in (("hs_", "speculators/hidden_states/"), ("data_", "specforge/")):
        if name.startswith(prefix) and rel.startswith(folder):
            try:
                return int(name[len(prefix) :].split(".")[0])
            except ValueError:
                return None
    return None


def speculators_bytes(token_ids, hidden_states) -> bytes:
    """vLLM's extract_hidden_states file: token_ids [seq] int64, hidden_states [seq, n, H]."""
    from safetensors.torch import save

    return save({"token_ids": token_ids.contiguous(), "hidden_states": hidden_states.contiguous()})


def specforge_bytes(input_ids, loss_mask, hidden_state, aux_hidden_state, gzipped=False) -> bytes:
    """SpecForge's offline row: a torch.save dict, written to memory (deterministic bytes);
    gzipped at GZIP_LEVEL with mtime 0 and no file name (deterministic too) for .ckpt.gz."""
    import torch

    buf = io.BytesIO()
    torch.save(
        {
            "input_ids": input_ids.contiguous(),
            "loss_mask": loss_mask.contiguous(),
            "hidden_state": hidden_state.contiguous(),
            "aux_hidden_state": aux_hidden_state.contiguous(),
        },
        buf,
    )
    if gzipped:
        return gzip.compress(buf.getbuffer(), compresslevel=GZIP_LEVEL, mtime=0)
    return buf.getvalue()


def write_atomic(path: Path, data: bytes) -> None:
    """`data` under `path`, complete or not at all (temporary file, fsync, rename)."""
    tmp = atomic_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def is_leftover(name: str) -> bool:
    """A temporary file of an interrupted write (ours, or a datasets/engine one) or a lock."""
    return name.endswith((".tmp", ".lock")) or name.startswith(".tmp")
