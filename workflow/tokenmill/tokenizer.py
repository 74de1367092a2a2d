"""Loading the target model's tokenizer exactly as configured, and resolving token names."""

from __future__ import annotations

import os
from pathlib import Path


def load_tokenizer(cfg: dict, basedir: str | os.PathLike = "."):
    """AutoTokenizer for the `tokenizer:` config section (path, revision, remote code, template)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from transformers import AutoTokenizer

    path = cfg["path"]
    local = Path(basedir) / path
    tok = AutoTokenizer.from_pretrained(
        str(local) if local.exists() else path,
        revision=cfg.get("revision"),
        trust_remote_code=bool(cfg.get("trust_remote_code", False)),
    )
    if cfg.get("chat_template"):
        tok.chat_template = (Path(basedir) / cfg["chat_template"]).read_text()
    return tok


def resolve_token_ids(tokenizer, tokens) -> list[int]:
    """Token strings (or ids) -> ids. A string that is not a single known token is an error."""
    ids: list[int] = []
    vocab = tokenizer.get_vocab()
    for tok in tokens:
        if isinstance(tok, int):
            ids.append(tok)
            continue
        if tok in vocab:
            ids.append(vocab[tok])
            continue
        encoded = tokenizer.encode(tok, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(f"'{tok}' is not a single token of this tokenizer (encodes to {encoded})")
        ids.append(encoded[0])
    return ids
