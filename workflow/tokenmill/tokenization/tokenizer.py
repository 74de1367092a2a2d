"""Loading the target model's tokenizer exactly as configured, and resolving token names."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from tokenmill.contracts import canonical_json, sha256_file
from tokenmill.settings import TokenizerSettings, as_section


def load_tokenizer(cfg: TokenizerSettings | dict, basedir: str | os.PathLike = "."):
    """AutoTokenizer for the `tokenizer:` config section (path, revision, remote code, template)."""
    cfg = as_section(cfg, "tokenizer")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    from transformers import AutoTokenizer

    path = cfg.path
    local = Path(basedir) / path
    tok = AutoTokenizer.from_pretrained(
        str(local) if local.exists() else path,
        revision=cfg.revision,
        trust_remote_code=cfg.trust_remote_code,
    )
    if cfg.chat_template:
        tok.chat_template = (Path(basedir) / cfg.chat_template).read_text()
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
            raise ValueError(
                f"'{tok}' is not a single token of this tokenizer (encodes to {encoded})"
            )
        ids.append(encoded[0])
    return ids


# Model weights are not part of a tokenizer (and hashing gigabytes would be wasteful).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
WEIGHT_INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")


def tokenizer_files(directory: str | os.PathLike) -> list[dict]:
    """name (relative, posix), size and sha256 of every tokenizer file under `directory`.

    Weights and their index files are left out, and so are hidden files and folders (.git,
    .cache of `hf download --local-dir`): they do not change how text becomes tokens.
    """
    root = Path(directory)
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file():
            continue
        if path.name.endswith(WEIGHT_SUFFIXES + WEIGHT_INDEX_SUFFIXES):
            continue
        files.append(
            {"name": rel.as_posix(), "size": path.stat().st_size, "sha256": sha256_file(path)}
        )
    return files


def tokenizer_dir(cfg: TokenizerSettings | dict, basedir: str | os.PathLike = ".") -> Path:
    """The directory holding the tokenizer's files: the local path, or the hub snapshot.

    A hub id must already be in the local Hugging Face cache (load the tokenizer first).
    """
    cfg = as_section(cfg, "tokenizer")
    local = Path(basedir) / cfg.path
    if local.is_dir():
        return local
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(cfg.path, revision=cfg.revision, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - re-raised with what was looked for
        raise FileNotFoundError(
            f"tokenizer '{cfg.path}' (revision {cfg.revision}) is neither a local "
            f"directory under {basedir} nor in the Hugging Face cache: {exc}"
        ) from exc


def tokenizer_fingerprint(
    cfg: TokenizerSettings | dict, basedir: str | os.PathLike = ".", tokenizer=None
):
    """(sha256 hex, files) of everything that decides how a conversation becomes token ids.

    Covers the tokenizer files (name + sha256, weights excluded), the revision, remote code, the
    effective chat template (after a configured override) and chat_template_kwargs. Not the
    path: the same files elsewhere tokenize the same way. `files` is for the provenance.
    """
    cfg = as_section(cfg, "tokenizer")
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg, basedir)
    files = tokenizer_files(tokenizer_dir(cfg, basedir))
    material = {
        "files": [[f["name"], f["sha256"]] for f in files],
        "revision": cfg.revision,
        "trust_remote_code": cfg.trust_remote_code,
        # str, or a dict of named templates for tokenizers that ship several.
        "chat_template": getattr(tokenizer, "chat_template", None),
        "chat_template_kwargs": cfg.raw["chat_template_kwargs"],
    }
    return hashlib.sha256(canonical_json(material).encode()).hexdigest(), files
