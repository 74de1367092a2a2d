"""Helpers the Snakefile calls at parse time. Cheap on purpose: no transformers or torch
imports here, because Snakemake parses the workflow in every job it starts."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tokenmill.config import normalize_source
from tokenmill.contracts import canonical_json, sha256_file
from tokenmill.prepare.sources import expand_paths
from tokenmill.tokenization.tokenizer import tokenizer_files


def local_source_files(category: dict, basedir) -> list[str]:
    """The files prepare will read (same expansion), as the rule's inputs."""
    files: list[str] = []
    for src in category["sources"]:
        spec = normalize_source(src, category)
        if "path" in spec:
            files += [shown for shown, _ in expand_paths(spec["path"], basedir)]
    return files


def tokenizer_params_fingerprint(cfg: dict, basedir) -> str:
    """The tokenize rule's rerun trigger: the tokenizer config and the sha256 of every local
    tokenizer file (weights excluded) and of a chat template override. Unlike
    tokenizer.tokenizer_fingerprint (which shards carry) it does not load the tokenizer, so the
    workflow parses fast; a hub tokenizer is covered by its id and revision."""
    h = hashlib.sha256(canonical_json(cfg).encode())
    local = Path(basedir) / cfg["path"]
    files = tokenizer_files(local) if local.is_dir() else []
    if cfg.get("chat_template"):
        template = Path(basedir) / cfg["chat_template"]
        files.append({"name": "chat_template", "sha256": sha256_file(template)})
    h.update(canonical_json([[f["name"], f["sha256"]] for f in files]).encode())
    return h.hexdigest()
