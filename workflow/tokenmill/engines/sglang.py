"""SGLang's native API (docs/sglang-api.md).

Request: POST /generate {"input_ids": [...], "sampling_params": {...}, "rid": "..."}; the answer
carries output_ids and meta_info.finish_reason {"type", "matched"}. Identity: /model_info and
/server_info (the server's full arguments). The tokenmill reference server speaks the same API.
"""

from __future__ import annotations

import logging
import re

import aiohttp

from tokenmill.engines.base import BadResponse, EngineAPI, get_json, has_flag
from tokenmill.engines.base import error_message as error_message
from tokenmill.settings import GenerationSettings

# SamplingParams fields accepted by the /generate contract gate (api_types.py); any other key is
# a 400 "unknown field" from the server, so we refuse it before paying for a single request.
SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "stop",
        "stop_regex",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "n",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "logit_bias",
        "sampling_seed",
        "stream_interval",
        "custom_params",
        "beam_width",
        "watermark",
    }
)

# Keys that not every SGLang release accepts: key -> the first release known to accept it.
# 0.5.16 (measured, docs/sglang-api.md) answers each of these with a plain-text 500 on every
# request; 0.5.23 (read from its source) accepts them. Releases in between are not known, so
# they are refused there too (the message says how to get past it: drop the key).
KEYS_SINCE = {"beam_width": (0, 5, 23), "watermark": (0, 5, 23)}

log = logging.getLogger(__name__)

# Keys the client sets itself (from stop_tokens and seed_policy); not allowed in the config.
CLIENT_OWNED_KEYS = frozenset({"stop_token_ids", "sampling_seed"})


def skip_tokenizer_init(command: list[str] | None) -> bool:
    return has_flag(command, "--skip-tokenizer-init")


def validate_sampling(params: dict, skip_tokenizer_init: bool) -> None:
    """Raise ValueError (naming the key) for params SGLang would refuse or we cannot use."""
    if not isinstance(params, dict):
        raise ValueError("generation.sampling must be a mapping")
    for key in params:
        if key == "seed":
            raise ValueError(
                "generation.sampling.seed: SGLang has no 'seed' key; use seed_policy: per_sample "
                "(sends sampling_seed; needs --enable-deterministic-inference)"
            )
        if key not in SAMPLING_KEYS:
            raise ValueError(
                f"generation.sampling.{key}: not an SGLang sampling parameter "
                f"(allowed: {', '.join(sorted(SAMPLING_KEYS))})"
            )
        if key in CLIENT_OWNED_KEYS:
            other = "stop_tokens" if key == "stop_token_ids" else "seed_policy: per_sample"
            raise ValueError(f"generation.sampling.{key}: set by the client; use {other}")
    mnt = params.get("max_new_tokens")
    if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1:
        raise ValueError("generation.sampling.max_new_tokens: required, an integer >= 1")
    n = params.get("n", 1)
    if n != 1:
        raise ValueError("generation.sampling.n: must be 1 (one sample per prompt and request)")
    if params.get("beam_width") not in (None, 0, 1):
        raise ValueError("generation.sampling.beam_width: beam search is not supported")
    if skip_tokenizer_init:
        for key in ("stop", "stop_regex"):
            if params.get(key):
                raise ValueError(
                    f"generation.sampling.{key}: refused by SGLang under --skip-tokenizer-init; "
                    "use stop_tokens"
                )
        if (params.get("min_new_tokens") or 0) > 0:
            raise ValueError(
                "generation.sampling.min_new_tokens: must be 0 under --skip-tokenizer-init"
            )


def launches_sglang(command: list[str] | None) -> bool:
    """Does the launch command visibly start SGLang (or the reference engine), so that its
    flags are the server's flags? (A wrapper script hides them: then only the server can tell.)"""
    cmd = list(command or [])
    return any(a in ("sglang.launch_server", "serve-reference") for a in cmd) or any(
        a.rsplit("/", 1)[-1] == "sglang" and b == "serve"
        for a, b in zip(cmd, cmd[1:], strict=False)
    )


def validate_launch(gen: GenerationSettings) -> None:
    """Config-time: seed_policy per_sample with a managed SGLang launched without
    --enable-deterministic-inference would only be refused once the server is up."""
    command = list(gen.launch.command or [])
    if (
        gen.managed
        and gen.seed_policy == "per_sample"
        and not gen.allow_ignored_seeds
        and launches_sglang(command)
        and not has_flag(command, "--enable-deterministic-inference")
    ):
        raise ValueError(
            "seed_policy: per_sample needs --enable-deterministic-inference in "
            "generation.launch.command (without it SGLang accepts sampling_seed and ignores "
            "it); or set generation.allow_ignored_seeds: true to run anyway"
        )


def parse_version(text) -> tuple[int, ...] | None:
    """(major, minor, patch) of an SGLang version string ("0.5.16", "0.5.23.post1", "0.5.16-
    fake"); None when it is not one (the reference engine reports "tokenmill-reference-...")."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", str(text or ""))
    return tuple(int(x or 0) for x in m.groups()) if m else None


def check_sampling_version(params: dict, version: str | None) -> None:
    """Raise ValueError for a sampling key the running SGLang version does not accept."""
    parsed = parse_version(version)
    if parsed is None:
        return
    for key in sorted(params):
        since = KEYS_SINCE.get(key)
        if since and parsed < since:
            raise ValueError(
                f"generation.sampling.{key}: not accepted by SGLang {version} (the server's "
                f"/server_info version; known from {'.'.join(map(str, since))}): that server "
                "answers every request with a plain-text 500. Remove the key or upgrade the server"
            )


def parse_generate(obj) -> dict:
    """A /generate JSON object -> the GENERATED columns it carries (server/sample_key excluded)."""
    if isinstance(obj, list):
        if len(obj) != 1:
            raise BadResponse(f"expected one result, got a list of {len(obj)}")
        obj = obj[0]
    if not isinstance(obj, dict) or not isinstance(obj.get("output_ids"), list):
        raise BadResponse("response has no output_ids")
    meta = obj.get("meta_info") or {}
    finish = meta.get("finish_reason") or {}
    matched = finish.get("matched")
    if isinstance(matched, list):  # schema allows a list form for matched tokens
        matched = matched[-1] if matched else None
    return {
        "output_ids": obj["output_ids"],
        "finish_type": finish.get("type"),
        "finish_matched_id": matched if isinstance(matched, int) else None,
        "finish_matched_str": matched if isinstance(matched, str) else None,
        "finish_message": finish.get("message"),
        "prompt_tokens": meta.get("prompt_tokens"),
        "completion_tokens": meta.get("completion_tokens"),
        "cached_tokens": meta.get("cached_tokens"),
        "latency_s": meta.get("e2e_latency"),
        "weight_version": meta.get("weight_version"),
    }


class SGLangAPI(EngineAPI):
    name = "sglang"
    # SGLang's HTTP server (uvicorn, timeout_keep_alive 5 s, not a launch flag) closes a
    # keep-alive connection idle for 5 s: drop ours after 4 s, so a request sent after a pause
    # (a conversation's tokenizer render, a blocked event loop) never goes out on a closed one.
    client_keepalive_s = 4.0

    skip_tokenizer_init = staticmethod(skip_tokenizer_init)
    validate_sampling = staticmethod(validate_sampling)
    validate_launch = staticmethod(validate_launch)

    def server_skips_tokenizer(self, server_info: dict) -> bool:
        return bool(server_info.get("skip_tokenizer_init"))

    def check_server(self, gen: GenerationSettings, server_info: dict, url: str) -> dict:
        notes = super().check_server(gen, server_info, url)
        version = server_info.get("version")
        notes["version"] = version
        if parse_version(version) is None:
            log.warning(
                "%s: server version %r is not an SGLang release number: sampling keys are not "
                "checked against it", url, version,
            )  # fmt: skip
        check_sampling_version(gen.raw["sampling"], version)
        if gen.seed_policy == "per_sample":
            det = bool(server_info.get("enable_deterministic_inference"))
            notes["seeds_honoured"] = det
            if not det and not gen.allow_ignored_seeds:
                raise ValueError(
                    f"generation.seed_policy: per_sample needs an SGLang server started with "
                    f"--enable-deterministic-inference, but {url} (version {version}) reports "
                    f"enable_deterministic_inference="
                    f"{server_info.get('enable_deterministic_inference')!r}: it would accept "
                    "sampling_seed and ignore it. Add the flag to the launch command, or set "
                    "generation.allow_ignored_seeds: true to run anyway (the meta and the "
                    "provenance then say seeds_honoured: false)"
                )
            if not det:
                log.warning("%s ignores sampling_seed (no deterministic inference)", url)
        return notes

    def prepare(self, sampling: dict, stop_token_ids: list[int]) -> None:
        self._sampling = dict(sampling)
        if stop_token_ids:
            self._sampling["stop_token_ids"] = list(stop_token_ids)

    def build_request(self, url: str, prompt_ids: list[int], seed: int | None, rid: str):
        sp = self._sampling if seed is None else {**self._sampling, "sampling_seed": seed}
        return "/generate", self._dumps(
            {"input_ids": prompt_ids, "sampling_params": sp, "rid": rid}
        )

    def parse_response(self, obj) -> dict:
        return parse_generate(obj)

    async def _first(self, session, url: str, headers: dict, paths) -> dict | None:
        for path in paths:
            try:
                status, body = await get_json(session, url + path, headers)
            except (TimeoutError, aiohttp.ClientError, OSError):
                continue
            if status == 200 and isinstance(body, dict):
                return body
        return None

    async def fetch_model_info(self, session, url: str, headers: dict) -> dict | None:
        return await self._first(session, url, headers, ("/model_info", "/get_model_info"))

    async def fetch_server_info(self, session, url: str, headers: dict) -> dict:
        paths = ("/server_info", "/get_server_info")
        return await self._first(session, url, headers, paths) or {}
