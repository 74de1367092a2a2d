"""The tiny offline tokenizer/model builder is deterministic, and sample/model is its output."""

from __future__ import annotations

import json

import pytest
from tokenmill.tiny import build_tiny_model, build_tiny_tokenizer

# Files that do not depend on training: equal for any train_steps.
UNTRAINED_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
]


@pytest.mark.parametrize("template", ["kimi", "qwen3"])
def test_tokenizer_build_is_deterministic(tmp_path, template):
    build_tiny_tokenizer(tmp_path / "a", template=template)
    build_tiny_tokenizer(tmp_path / "b", template=template)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    vocab = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    added = {t["content"] for t in vocab["added_tokens"]}
    assert {"<think>", "</think>", "<|im_end|>", "<|im_start|>"} <= added


def test_model_build_is_deterministic(tmp_path):
    build_tiny_model(tmp_path / "a", train_steps=2)
    build_tiny_model(tmp_path / "b", train_steps=2)
    for name in [*UNTRAINED_FILES, "model.safetensors", "tokenmill_tiny.json"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    # Training changes the weights: the comparison above is not between two untrained models.
    build_tiny_model(tmp_path / "c", train_steps=0)
    a = (tmp_path / "a" / "model.safetensors").read_bytes()
    assert a != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_sample_model_matches_the_builder(tmp_path, sample_model_dir):
    recorded = json.loads((sample_model_dir / "tokenmill_tiny.json").read_text())
    build_tiny_model(tmp_path / "m", template=recorded["template"], train_steps=0)
    for name in UNTRAINED_FILES:
        built = (tmp_path / "m" / name).read_bytes()
        assert built == (sample_model_dir / name).read_bytes(), f"sample/model/{name} is stale"


@pytest.mark.slow
def test_sample_model_weights_match_a_default_build(tmp_path, sample_model_dir):
    # ~20 s: the default build trains 300 steps. Same machine type, same torch: same bytes.
    recorded = json.loads((sample_model_dir / "tokenmill_tiny.json").read_text())
    assert recorded == {"template": "kimi", "train_steps": 300, "seed": 0}
    build_tiny_model(tmp_path / "m")
    for name in ("model.safetensors", "tokenmill_tiny.json"):
        built = (tmp_path / "m" / name).read_bytes()
        assert built == (sample_model_dir / name).read_bytes(), f"sample/model/{name} is stale"
