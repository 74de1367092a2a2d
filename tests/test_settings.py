"""Typed settings (tokenmill/settings.py): built from the schema-validated config, frozen,
defaults from the schema only, stage commands' sections validated naming the key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from tokenmill import keys, settings
from tokenmill.settings import ConfigError, Settings, load_section

ROOT = Path(__file__).resolve().parent.parent
DEMO = yaml.safe_load((ROOT / "config.yaml").read_text())
MINIMAL = {
    "tokenizer": {"path": "tok"},
    "categories": {"c": {"sources": ["a.jsonl"], "format": "messages"}},
}
# generation_fingerprint(demo config's generation) as computed by the code before settings.py
# existed: the fingerprint (and so every sample key) must never change for the same config.
DEMO_FINGERPRINT = "54ba43db15d019843cf60ed8044f2753de15edebb32932bfa1b9d4d20b15d675"


def _schema_default(*path):
    node = settings.load_schema()
    for key in path:
        node = node["properties"][key]
    return node["default"]


def test_demo_config_builds_typed_settings():
    s = Settings.from_config(DEMO)
    assert s.tokenizer.path == DEMO["tokenizer"]["path"]
    assert (
        s.generation.sampling["max_new_tokens"] == DEMO["generation"]["sampling"]["max_new_tokens"]
    )
    assert set(s.categories) == set(DEMO["categories"])
    assert s.categories["multiturn"].regenerated
    assert s.generation.raw["sampling"] == DEMO["generation"]["sampling"]
    json.dumps(s.raw)  # the validated dict is JSON for hand-off
    assert s.raw == settings.validate_schema(json.loads(json.dumps(DEMO)))


def test_settings_are_frozen():
    s = Settings.from_config(DEMO)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.generation.concurrency = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.generation.retry.max_attempts = 1
    with pytest.raises(TypeError):
        s.generation.sampling["temperature"] = 1.0
    with pytest.raises(TypeError):
        s.tokenizer.chat_template_kwargs["thinking"] = False
    with pytest.raises(TypeError):
        s.categories["new"] = s.categories["code"]
    assert isinstance(s.generation.stop_tokens, tuple)


def test_from_config_does_not_modify_its_argument():
    config = json.loads(json.dumps(MINIMAL))
    Settings.from_config(config)
    assert config == MINIMAL


def test_defaults_come_from_the_schema():
    s = Settings.from_config(MINIMAL)
    gen = ("generation",)
    assert s.results_dir == _schema_default("results_dir")
    assert s.journal_dir == _schema_default("journal_dir")
    assert s.max_prompt_tokens == _schema_default("max_prompt_tokens")
    assert s.generation.resources.gpus == _schema_default(*gen, "resources", "gpus")
    assert s.generation.retry.max_attempts == _schema_default(*gen, "retry", "max_attempts")
    assert s.generation.reject_limit.max_fraction == _schema_default(
        *gen, "reject_limit", "max_fraction"
    )
    assert s.generation.launch.nnodes == _schema_default(*gen, "launch", "nnodes")
    assert s.generation.launch.host == _schema_default(*gen, "launch", "host")
    assert s.generation.concurrency == _schema_default(*gen, "concurrency")
    assert dict(s.generation.sampling) == _schema_default(*gen, "sampling")
    assert s.generation.external.urls == tuple(_schema_default(*gen, "external", "urls"))
    assert s.dataset.max_sequence_tokens == _schema_default("dataset", "max_sequence_tokens")
    assert s.tokenizer.trust_remote_code == _schema_default("tokenizer", "trust_remote_code")
    assert s.generation.launch.command is None  # no default: required in managed mode only
    assert s.generation.model is None


def test_category_resources_override_generation_resources():
    config = json.loads(json.dumps(MINIMAL))
    config["generation"] = {"resources": {"gpus": 4, "cpus": 16}}
    config["categories"]["big"] = {
        "sources": ["b.jsonl"],
        "format": "messages",
        "resources": {"gpus": 8},
    }
    s = Settings.from_config(config)
    assert s.resources("big").gpus == 8 and s.resources("big").cpus == 16
    assert s.resources("c").gpus == 4
    assert s.resources().gpus == 4
    assert dict(s.categories["big"].resources) == {"gpus": 8}
    assert s.categories["c"].resources is None


def test_load_section_inline_json_section():
    gen = load_section('{"retry": {"max_attempts": 3}}', "generation")
    assert isinstance(gen, settings.GenerationSettings)
    assert gen.retry.max_attempts == 3
    assert gen.retry.backoff_max_s == _schema_default("generation", "retry", "backoff_max_s")


def test_load_section_whole_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEMO))
    tok = load_section(str(path), "tokenizer")
    assert isinstance(tok, settings.TokenizerSettings)
    assert tok.path == DEMO["tokenizer"]["path"]
    assert isinstance(load_section(str(path), None), Settings)
    yaml_path = tmp_path / "config.yaml"
    yaml_path.write_text(yaml.safe_dump(DEMO))
    assert load_section(str(yaml_path), "dataset") == load_section(str(path), "dataset")


def test_load_section_file_holding_the_section(tmp_path):
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps({"draft_vocab_size": 64}))
    ds = load_section(str(path), "dataset")
    assert ds.draft_vocab_size == 64
    assert ds.export_jsonl == _schema_default("dataset", "export_jsonl")


def test_load_section_categories():
    cats = load_section(json.dumps(MINIMAL["categories"]), "categories")
    assert cats["c"].shards == 1 and cats["c"].turns == "last"


def test_partial_or_wrong_section_fails_naming_the_key():
    with pytest.raises(ConfigError, match=r"'generation\.retry\.max_attempts': 'x' is not of"):
        load_section('{"retry": {"max_attempts": "x"}}', "generation")
    with pytest.raises(ConfigError, match=r"'tokenizer': 'path' is a required property"):
        load_section("{}", "tokenizer")
    with pytest.raises(ConfigError, match=r"'generation\.sampling': 'max_new_tokens' is a req"):
        load_section('{"sampling": {"temperature": 0.5}}', "generation")
    with pytest.raises(ConfigError, match=r"'dataset': Additional properties .*'bogus'"):
        load_section('{"bogus": 1}', "dataset")
    bad = json.loads(json.dumps(MINIMAL))
    bad["generation"] = {"concurrency": 0}
    with pytest.raises(ConfigError, match=r"'generation\.concurrency'"):
        load_section(json.dumps(bad), "generation")


def test_string_temperature_fails():
    with pytest.raises(ConfigError, match=r"'generation\.sampling\.temperature': '0' is not"):
        load_section('{"sampling": {"max_new_tokens": 8, "temperature": "0"}}', "generation")
    with pytest.raises(ConfigError, match=r"'generation\.sampling\.top_k'"):
        load_section('{"sampling": {"max_new_tokens": 8, "top_k": 0.5}}', "generation")
    # engine-specific keys stay allowed (the engine module checks them)
    gen = load_section('{"sampling": {"max_new_tokens": 8, "ebnf": "x"}}', "generation")
    assert gen.sampling["ebnf"] == "x"


def test_load_section_unreadable_value():
    with pytest.raises(ConfigError):
        load_section("/nonexistent/config.json", "generation")
    with pytest.raises(ConfigError):
        load_section("{not json", "generation")


def test_json_arg_inline_and_file(tmp_path):
    assert settings.json_arg('{"a": 1}') == {"a": 1}
    path = tmp_path / "x.json"
    path.write_text('{"b": 2}')
    assert settings.json_arg(str(path)) == {"b": 2}
    path.write_text("[1]")
    with pytest.raises(ValueError, match="must be a JSON object"):
        settings.json_arg(str(path), "--x")


def test_normalize_source():
    cat = {"format": "messages"}
    assert settings.normalize_source("a/*.jsonl", cat) == {
        "path": "a/*.jsonl",
        "format": "messages",
    }
    assert settings.normalize_source({"hub": "x/y", "format": "glaive"}, cat)["format"] == "glaive"
    s = Settings.from_config(MINIMAL)
    assert s.categories["c"].source_specs() == [{"path": "a.jsonl", "format": "messages"}]


def test_demo_generation_fingerprint_is_unchanged():
    s = Settings.from_config(DEMO)
    assert keys.generation_fingerprint(s.generation) == DEMO_FINGERPRINT
    assert s.generation.fingerprint == DEMO_FINGERPRINT
    assert keys.generation_fingerprint(s.generation.raw) == DEMO_FINGERPRINT
