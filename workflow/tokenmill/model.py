"""Model identity and vocabulary size, read from the model's files on this machine.

A model is named by generation.model: a local directory (relative to the base directory) or a
Hugging Face hub id, found in the local cache (never downloaded). Its config.json gives the
vocabulary size (tokenize and the draft vocabulary bound token ids by it; generate checks it);
`weights_fingerprint` tells two copies of one checkpoint from two different checkpoints
(generate/launch.py matches the served model with it).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLE_BYTES = 1 << 16  # read at the middle and the end of each weight file


def local_dir(name: str | None, basedir: str | Path = ".") -> Path | None:
    if not name:
        return None
    path = Path(basedir) / name  # an absolute name stays absolute
    return path if path.is_dir() else None


def hub_cache_dir(hub_id: str, revision: str | None) -> Path | None:
    """The local Hugging Face cache snapshot of a hub model (no download), if any."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(hub_id, "config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None


def hub_id_of(name: str) -> str | None:
    """`org/name` of a hub id, or of a path inside the Hugging Face cache
    (.../models--org--name/snapshots/<commit>); None for other paths."""
    for part in Path(name).parts:
        if part.startswith("models--"):
            return "/".join(part[len("models--") :].split("--", 1))
    if name.count("/") == 1 and not name.startswith((".", "/")) and not Path(name).exists():
        return name
    return None


def weights_fingerprint(path: Path) -> str | None:
    """config.json plus, for every weight file, its name, size and 64 KiB read at its middle
    and its end: two copies of one checkpoint agree, fine-tunes of one base do not (their
    configs and sizes do). Reads a few MiB even for a terabyte checkpoint. None without a
    config.json."""
    try:
        h = hashlib.sha256((path / "config.json").read_bytes())
        for f in sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
            size = f.stat().st_size
            h.update(f"\0{f.name}\0{size}\0".encode())
            with open(f, "rb") as fh:
                for offset in (size // 2, max(size - SAMPLE_BYTES, 0)):
                    fh.seek(offset)
                    h.update(fh.read(SAMPLE_BYTES))
    except OSError:
        return None
    return h.hexdigest()


def model_vocab_size(model: str | None, basedir: str | Path = ".", revision: str | None = None):
    """(vocab_size, where it was read) from the model's config.json when it is on this machine
    (a local directory, or a hub id in the local Hugging Face cache); (None, why) otherwise."""
    if not model:
        return None, "no generation.model"
    local = local_dir(model, basedir)
    hub = hub_id_of(model) if local is None else None
    where = local or (hub_cache_dir(hub, revision) if hub else None)
    if where is None:
        return None, f"{model!r} is not a local directory nor in the Hugging Face cache"
    try:
        cfg = json.loads((where / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return None, f"cannot read {where / 'config.json'}: {exc}"
    # Multimodal configs keep the language model's vocabulary in text_config.
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int):
        return None, f"{where / 'config.json'} has no vocab_size"
    return vocab, str(where / "config.json")
