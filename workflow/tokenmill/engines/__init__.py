"""Engines the generate stage can drive. A new engine = one module with an EngineAPI subclass,
registered here (and added to the `generation.engine` enum of the config schema)."""

from __future__ import annotations

from tokenmill.engines.base import BadResponse, EngineAPI, error_message
from tokenmill.engines.sglang import SGLangAPI
from tokenmill.engines.vllm import VLLMAPI
from tokenmill.settings import GenerationSettings, as_section

ENGINES: dict[str, type[EngineAPI]] = {"sglang": SGLangAPI, "vllm": VLLMAPI}

__all__ = ["ENGINES", "BadResponse", "EngineAPI", "SGLangAPI", "VLLMAPI", "error_message", "get"]


def get(name: str | None) -> type[EngineAPI]:
    try:
        return ENGINES[name or "sglang"]
    except KeyError:
        raise ValueError(
            f"generation.engine: unknown engine {name!r} (known: {', '.join(sorted(ENGINES))})"
        ) from None


def for_config(gen: GenerationSettings | dict) -> EngineAPI:
    gen = as_section(gen, "generation")
    return get(gen.engine)(gen)


def validate(gen: GenerationSettings | dict) -> None:
    """Check generation.sampling against the configured engine (managed: its launch flags)."""
    gen = as_section(gen, "generation")
    api = get(gen.engine)
    command = list(gen.launch.command or []) if gen.managed else None
    api.validate_sampling(gen.raw["sampling"], api.skip_tokenizer_init(command))


def validate_launch(gen: GenerationSettings | dict) -> None:
    """Check the launch settings against the rest of the generation config."""
    gen = as_section(gen, "generation")
    get(gen.engine).validate_launch(gen)
