"""vLLM's OpenAI-compatible server, token IDs in and out (docs/engines.md).

Request (default): POST /v1/completions {"model", "prompt": [token ids], "max_tokens", ...,
"return_token_ids": true}; choices[0].token_ids are the output ids. With `--tokens-only` in the
managed launch command (the server then has no tokenizer) requests go to the tokens-only
endpoint POST /inference/v1/generate {"model", "token_ids", "sampling_params": {...}} instead;
its choices carry the same fields.

Stop: a stop_token_ids hit or EOS is the LAST element of token_ids (it stays in the sequence),
finish_reason "stop"; stop_reason is the matched id, or null for EOS (then the last token is the
EOS that matched). Identity: GET /v1/models (id = served name, root = model path) and GET
/version; the launch arguments come from the managed engine's argv.

generation.sampling uses the common (SGLang) names; they map onto vLLM's as below.
"""

from __future__ import annotations

import aiohttp

from tokenmill.engines.base import BadResponse, EngineAPI, get_json, has_flag
from tokenmill.settings import GenerationSettings

# common name -> vLLM request field
SAMPLING_MAP = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
    "stop": "stop",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens",
    "logit_bias": "logit_bias",
    "n": "n",
}
# Set by the client (stop_tokens, seed_policy: per_sample), never by the config.
CLIENT_OWNED_KEYS = frozenset({"stop_token_ids", "seed", "sampling_seed", "max_tokens"})
TOKENS_ONLY_FLAGS = ("--tokens-only",)
NO_TOKENIZER_FLAGS = ("--skip-tokenizer-init", "--tokens-only")
FINISH_TYPES = {"stop": "stop", "length": "length", "abort": "abort"}


def skip_tokenizer_init(command: list[str] | None) -> bool:
    return has_flag(command, *NO_TOKENIZER_FLAGS)


def validate_sampling(params: dict, skip_tokenizer_init: bool) -> None:
    """Raise ValueError (naming the key) for params vLLM cannot take through our mapping."""
    if not isinstance(params, dict):
        raise ValueError("generation.sampling must be a mapping")
    for key in params:
        if key in CLIENT_OWNED_KEYS:
            other = "stop_tokens" if key == "stop_token_ids" else "seed_policy: per_sample"
            if key == "max_tokens":
                other = "max_new_tokens"
            raise ValueError(f"generation.sampling.{key}: set by the client; use {other}")
        if key not in SAMPLING_MAP:
            raise ValueError(
                f"generation.sampling.{key}: not supported with engine vllm "
                f"(allowed: {', '.join(sorted(SAMPLING_MAP))})"
            )
    mnt = params.get("max_new_tokens")
    if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1:
        raise ValueError("generation.sampling.max_new_tokens: required, an integer >= 1")
    if params.get("n", 1) != 1:
        raise ValueError("generation.sampling.n: must be 1 (one sample per prompt and request)")
    if skip_tokenizer_init and params.get("stop"):
        raise ValueError(
            "generation.sampling.stop: stop strings need vLLM's tokenizer (not under "
            "--skip-tokenizer-init/--tokens-only); use stop_tokens"
        )


def parse_choice(obj) -> dict:
    """A /v1/completions or /inference/v1/generate JSON object -> GENERATED columns."""
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or len(choices) != 1:
        raise BadResponse("expected exactly one choice")
    c = choices[0]
    ids = c.get("token_ids") if isinstance(c, dict) else None
    if not isinstance(ids, list):
        raise BadResponse("choice has no token_ids (does the server support return_token_ids?)")
    reason, stop = c.get("finish_reason"), c.get("stop_reason")
    finish = FINISH_TYPES.get(reason, "abort")  # null/"error"/unknown: not a finished sample
    matched_id = stop if isinstance(stop, int) and not isinstance(stop, bool) else None
    if finish == "stop" and stop is None and ids:
        matched_id = ids[-1]  # EOS: vLLM reports no stop_reason, the EOS is the last token
    usage = obj.get("usage") or {}
    versions = c.get("weight_versions") or []
    return {
        "output_ids": ids,
        "finish_type": finish,
        "finish_matched_id": matched_id,
        "finish_matched_str": stop if isinstance(stop, str) else None,
        "finish_message": None if reason in FINISH_TYPES else f"finish_reason {reason!r}",
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "latency_s": None,
        "weight_version": versions[-1].get("version") if versions else None,
    }


class VLLMAPI(EngineAPI):
    name = "vllm"
    # uvicorn closes idle keep-alive connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by
    # default): drop ours sooner, so an external server with the default never races us.
    client_keepalive_s = 4.0
    default_env = {"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "600", "VLLM_NO_USAGE_STATS": "1"}

    skip_tokenizer_init = staticmethod(skip_tokenizer_init)
    validate_sampling = staticmethod(validate_sampling)

    def __init__(self, gen: GenerationSettings | dict | None = None):
        super().__init__(gen)
        self.tokens_endpoint = self.gen.managed and has_flag(
            self.launch_command, *TOKENS_ONLY_FLAGS
        )

    def prepare(self, sampling: dict, stop_token_ids: list[int]) -> None:
        self._sampling = {SAMPLING_MAP[k]: v for k, v in sampling.items()}
        if stop_token_ids:
            self._sampling["stop_token_ids"] = list(stop_token_ids)

    def build_request(self, url: str, prompt_ids: list[int], seed: int | None, rid: str):
        sp = self._sampling if seed is None else {**self._sampling, "seed": seed}
        model = self.served_model.get(url.rstrip("/"))
        # vLLM serves its first model when the name is left out.
        head = {"model": model} if model else {}
        if self.tokens_endpoint:
            body = {**head, "token_ids": prompt_ids, "sampling_params": sp}
            return "/inference/v1/generate", self._dumps(body)
        body = {**head, "prompt": prompt_ids, **sp, "return_token_ids": True, "request_id": rid}
        return "/v1/completions", self._dumps(body)

    def parse_response(self, obj) -> dict:
        return parse_choice(obj)

    async def fetch_model_info(self, session, url: str, headers: dict) -> dict | None:
        try:
            status, body = await get_json(session, url + "/v1/models", headers)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        data = body.get("data") if status == 200 and isinstance(body, dict) else None
        if not data or not isinstance(data[0], dict):
            return None
        first = data[0]
        return {
            "model_path": first.get("root") or first.get("id"),
            "served_model_name": first.get("id"),
            "max_model_len": first.get("max_model_len"),
            "models": [m.get("id") for m in data if isinstance(m, dict)],
        }

    async def fetch_server_info(self, session, url: str, headers: dict) -> dict:
        try:
            status, body = await get_json(session, url + "/version", headers)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return {}
        info = {"engine": "vllm"}
        if status == 200 and isinstance(body, dict):
            info.update(body)
        return info
