"""What every engine module provides: the small engine-specific part of the generate stage.

The client, the managed/external engine code and the generate stage are engine-neutral; an
engine is one `EngineAPI` subclass that knows how to ask its server for token IDs, how to read
the answer, how to read the server's identity (for the model check and provenance), and which
`generation.sampling` keys it accepts. `generation.sampling` uses one vocabulary for every engine
(SGLang's names: max_new_tokens, min_new_tokens, ...); an engine maps it onto its own request.
"""

from __future__ import annotations

import json
import re

import aiohttp

from tokenmill.settings import GenerationSettings, as_section

# 400 messages that blame the prompt itself (it can never be answered with this model and
# config): the only 400s journaled as final rejections. Every other 400 (a duplicate request
# id, a sampling value some version refuses, ...) is retried a bounded number of times and
# then fails the job with the server's message. Measured (SGLang 0.5.16, reference engine,
# vLLM 0.32): "The input (N tokens) is longer than the model's context length (M tokens).",
# "Requested token count exceeds the model's maximum context length ...", "Input length (N
# tokens) exceeds the maximum allowed length ...", "This model's maximum context length is N
# tokens ...", "Token id N in input_ids is out of the vocabulary ...", "input_ids cannot be
# empty.".
PROMPT_AT_FAULT = re.compile(
    r"context length|maximum context|longer than the model|exceeds the maximum allowed length"
    r"|prompt is too long|out of the vocabulary|out of vocabulary|input_ids cannot be empty",
    re.IGNORECASE,
)
DUPLICATE_RID = re.compile(r"duplicate request id", re.IGNORECASE)


class BadResponse(ValueError):
    """A 200 response that does not look like a generation result."""


def error_message(body: bytes | str, status: int | None = None) -> str:
    """The message of the usual JSON error bodies: {"error": str}, {"error": {"message"}},
    {"object": "error", "message", "code"}, {"detail": str}; plain text otherwise."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        obj = json.loads(text)
    except ValueError:
        return text.strip()[:2000] or f"HTTP {status}"
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, str):
            return err
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in obj:
            return str(obj["message"])
        if isinstance(obj.get("detail"), str):
            return obj["detail"]
    return text.strip()[:2000]


def has_flag(command: list[str] | None, *flags: str) -> bool:
    return bool(command) and any(a in flags or a.split("=", 1)[0] in flags for a in command)


async def get_json(session: aiohttp.ClientSession, url: str, headers: dict):
    """(status, parsed JSON or None)."""
    async with session.get(url, headers=headers) as r:
        if r.status != 200:
            return r.status, None
        try:
            return 200, await r.json(content_type=None)
        except (ValueError, aiohttp.ContentTypeError):
            return 200, None


class EngineAPI:
    """One engine's HTTP API. Instances hold per-run state (the model name each URL serves)."""

    name = "?"
    health_path = "/health"
    # Seconds aiohttp keeps an idle pooled connection: below the server's own idle timeout, so
    # that no request goes out on a connection the server may have closed (a stale one costs a
    # retry, "Server disconnected"). Each engine owns its figure; 4 s fits the 5 s of uvicorn,
    # the default of Python HTTP servers, for an engine that says nothing.
    client_keepalive_s = 4.0
    # Environment defaults for a managed engine process (launch.env overrides them).
    default_env: dict[str, str] = {}

    def __init__(self, gen: GenerationSettings | dict | None = None):
        self.gen = as_section(gen or {}, "generation")  # {}: the schema's defaults
        self.launch_command = list(self.gen.launch.command or [])
        self.served_model: dict[str, str] = {}  # url -> model name to put in requests

    # ---- configuration ----
    @staticmethod
    def skip_tokenizer_init(command: list[str] | None) -> bool:
        raise NotImplementedError

    @staticmethod
    def validate_sampling(params: dict, skip_tokenizer_init: bool) -> None:
        """Raise ValueError naming the key for sampling params this engine refuses."""
        raise NotImplementedError

    @staticmethod
    def validate_launch(gen: GenerationSettings) -> None:
        """Raise ValueError for launch settings that cannot work with the rest of the config."""

    def server_skips_tokenizer(self, server_info: dict) -> bool:
        """From a running server's info (external mode): does it run without a tokenizer?"""
        return False

    # ---- requests ----
    def prepare(self, sampling: dict, stop_token_ids: list[int]) -> None:
        """Fix the sampling part shared by every request of the run."""
        raise NotImplementedError

    def build_request(self, url: str, prompt_ids: list[int], seed: int | None, rid: str):
        """-> (path, JSON body bytes)."""
        raise NotImplementedError

    def parse_response(self, obj) -> dict:
        """A 200 JSON body -> the GENERATED columns it carries (server/sample_key excluded):
        output_ids, finish_type (stop/length/abort), finish_matched_id/str, finish_message,
        prompt_tokens, completion_tokens, cached_tokens, latency_s, weight_version."""
        raise NotImplementedError

    def error_message(self, body: bytes | str, status: int | None = None) -> str:
        return error_message(body, status)

    @staticmethod
    def prompt_at_fault(message: str) -> bool:
        """Does this 400 say the prompt itself can never be answered (final rejection)?"""
        return bool(PROMPT_AT_FAULT.search(message or "")) and not DUPLICATE_RID.search(message)

    # ---- checks against the running server (before the first request) ----
    def check_server(self, gen: GenerationSettings, server_info: dict, url: str) -> dict:
        """Raise ValueError (naming the key and the server) for a config this running server
        cannot honour; else notes for the meta ({"seeds_honoured": bool|None, ...})."""
        per_sample = gen.seed_policy == "per_sample"
        return {"seeds_honoured": True if per_sample else None}

    # ---- identity ----
    async def fetch_model_info(self, session, url: str, headers: dict) -> dict | None:
        """The served model as {"model_path", "served_model_name", ...}; None if not ready."""
        raise NotImplementedError

    async def fetch_server_info(self, session, url: str, headers: dict) -> dict:
        """Version and arguments of the server, for provenance ({} when unavailable)."""
        raise NotImplementedError

    def remember(self, url: str, model_info: dict) -> None:
        name = model_info.get("served_model_name") or model_info.get("model_path")
        if name:
            self.served_model[url.rstrip("/")] = name

    @staticmethod
    def _dumps(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()
