"""Helpers the Snakefile calls at parse time. Cheap on purpose: no transformers or torch
imports here, because Snakemake parses the workflow in every job it starts."""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path

from tokenmill.config import normalize_source
from tokenmill.contracts import canonical_json
from tokenmill.keys import generation_fingerprint  # noqa: F401 - re-exported for the Snakefile

# Model weights are not part of a tokenizer: hashing gigabytes at every parse would be wasteful.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def shard_names(count: int) -> list[str]:
    return [f"{i:03d}" for i in range(count)]


def local_source_files(category: dict, basedir) -> list[str]:
    files: list[str] = []
    for src in category["sources"]:
        spec = normalize_source(src, category)
        if "path" in spec:
            pattern = spec["path"]
            root = Path(basedir)
            matches = sorted(glob.glob(str(root / pattern)))
            # Keep paths relative to the working directory when the pattern was relative.
            files += [
                str(Path(m).relative_to(root)) if not Path(pattern).is_absolute() else m
                for m in matches
            ]
    return files


def tokenizer_params_fingerprint(cfg: dict, basedir) -> str:
    """Changes when the tokenizer config or any local tokenizer file (not weights) changes."""
    h = hashlib.sha256(canonical_json(cfg).encode())
    local = Path(basedir) / cfg["path"]
    paths = sorted(p for p in local.rglob("*") if p.is_file()) if local.is_dir() else []
    if cfg.get("chat_template"):
        paths.append(Path(basedir) / cfg["chat_template"])
    for p in paths:
        if p.name.endswith(WEIGHT_SUFFIXES):
            continue
        h.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()
