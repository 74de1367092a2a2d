"""The production starting points in config/examples/ (Kimi-K2.5, Qwen3) pass the schema and hold
what a real run needs where the demo config is demo-sized: real model ids with the chat
template's thinking switch, reasoning-sized max_new_tokens that fit max_sequence_tokens, GPUs,
SGLang launched with tensor parallelism over exactly the GPUs the job asks for, and host memory.
The demo config marks its demo-sized values."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import ROOT

from tokenmill.keys import generation_fingerprint
from tokenmill.settings import Settings

EXAMPLES = sorted((ROOT / "config" / "examples").glob("*.yaml"))
# model id -> the chat template kwarg that turns its thinking on
THINKING = {"moonshotai/Kimi-K2.5": "thinking", "Qwen/Qwen3-8B": "enable_thinking"}


def test_there_is_an_example_for_each_model():
    models = {yaml.safe_load(p.read_text())["generation"]["model"] for p in EXAMPLES}
    assert models == set(THINKING)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_a_production_starting_point(path: Path):
    settings = Settings.from_config(yaml.safe_load(path.read_text()))  # the schema, defaults in
    gen, tok, ds = settings.generation, settings.tokenizer, settings.dataset
    assert tok.path == gen.model and gen.model in THINKING
    assert tok.raw["chat_template_kwargs"] == {THINKING[gen.model]: True}
    assert gen.engine == "sglang" and gen.mode == "managed"
    command = list(gen.launch.command)
    assert command[:3] == ["{python}", "-m", "sglang.launch_server"]
    assert "--skip-tokenizer-init" in command
    tp = int(command[command.index("--tp") + 1])
    assert gen.resources.gpus >= 1 and tp == gen.resources.gpus * gen.launch.nnodes
    assert gen.resources.mem_mb >= 64000
    max_new = gen.raw["sampling"]["max_new_tokens"]
    assert max_new >= 16384  # reasoning-sized
    assert ds.max_sequence_tokens >= max_new + 1024 and ds.reject_truncated
    assert ds.think_end_token == "</think>" and ds.draft_vocab_size == 32768
    assert generation_fingerprint(gen)  # the generate stage can key its samples


def test_demo_config_marks_its_demo_sized_values():
    lines = (ROOT / "config.yaml").read_text().splitlines()
    marked = {
        line.split(":", 1)[0].strip()
        for line in lines
        if "# demo-sized" in line and not line.lstrip().startswith("#")
    }
    for key in ("max_new_tokens", "temperature", "gpus", "mem_mb", "max_sequence_tokens"):
        assert key in marked, key
    assert "config/examples/" in "\n".join(lines)
