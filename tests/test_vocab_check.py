"""Prompt ids against the model's vocabulary at tokenize time: a tokenizer that can produce an
id the model cannot embed (a tokenizer/model mismatch) fails the stage, naming both sizes,
before any engine sees such an id (SGLang 0.5.16's scheduler dies on one)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_tokenize import EXTRA, prompt_rows, tok_cfg, write_prompts

from tokenmill.tokenization import stage as tk
from tokenmill.tokenization.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent


def _model(path: Path, vocab: int) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return path


def _cli(tmp_path, tokenizer_dir, *extra):
    prompts = write_prompts(tmp_path / "prompts.parquet", prompt_rows(EXTRA))
    argv = [
        sys.executable, "-m", "tokenmill", "tokenize", "--prompts", str(prompts),
        "--category", "c", "--shards", "2", "--shard-by", "prompt_id", "--tokenizer-config",
        json.dumps(tok_cfg(tokenizer_dir)), "--max-prompt-tokens", "4096",
        "--out-dir", str(tmp_path / "out"), "--rejected", str(tmp_path / "rej.parquet"),
        "--workers", "1", *extra,
    ]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=300)


def test_tokenizer_larger_than_the_model_vocabulary_fails_naming_both(tmp_path, sample_model_dir):
    n = len(load_tokenizer(tok_cfg(sample_model_dir), "."))
    small = _model(tmp_path / "small-model", n - 20)
    p = _cli(tmp_path, sample_model_dir, "--model", str(small))
    assert p.returncode == 1, p.stdout + p.stderr
    assert f"the tokenizer has {n} tokens but the model's vocab_size is {n - 20}" in p.stderr
    assert str(small / "config.json") in p.stderr


def test_matching_model_passes_and_unknown_model_is_said(tmp_path, sample_model_dir):
    p = _cli(tmp_path / "a", sample_model_dir, "--model", str(sample_model_dir))
    assert p.returncode == 0, p.stderr
    assert "not range-checked" not in p.stdout
    p = _cli(tmp_path / "b", sample_model_dir, "--model", "someorg/not-cached")
    assert p.returncode == 0, p.stderr
    assert "prompt ids not range-checked" in p.stdout


def test_an_id_past_the_vocabulary_fails_naming_the_prompt(tmp_path, sample_model_dir):
    # A tokenizer whose len() fits but whose ids do not (ids with holes, as some tiktoken
    # tokenizers have): the per-id check names the prompt and the id.
    tok = load_tokenizer(tok_cfg(sample_model_dir), ".")
    prompts = write_prompts(tmp_path / "p.parquet", prompt_rows(EXTRA))
    with pytest.raises(tk.TokenizeError, match=r"prompt \w+: token id \d+ is outside .*size 50"):
        tk.tokenize_category(
            prompts, "c", 2, tok_cfg(sample_model_dir), 4096, tmp_path / "out",
            tmp_path / "rej.parquet", tokenizer=_Pretend(tok, 40), model_vocab=(50, "cfg"),
            shard_by="prompt_id",
        )  # fmt: skip


class _Pretend:
    """The real tokenizer, reporting a smaller len()."""

    def __init__(self, tok, n):
        self._tok, self._n = tok, n

    def __len__(self):
        return self._n

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **k):
        return self._tok(*a, **k)
