"""`tokenmill serve-reference`: a CPU engine speaking the subset of SGLang's native HTTP API that
tokenmill's client uses (docs/sglang-api.md), served by a real
transformers causal LM. It lets CI and the demo run the generate stage without GPUs.

Launched like SGLang:
    python -m tokenmill serve-reference --model-path DIR --skip-tokenizer-init --host H --port P
        [--context-length N] [--served-model-name X] [--api-key K] [--random-seed S]
        [--max-running-requests N] [--enable-deterministic-inference] [--enable-metrics]
        [--log-level info]
Harmless SGLang flags (--trust-remote-code, --tp, --mem-fraction-static, ...) are accepted and
ignored.

The scheduler and the model (batching, determinism, sampling) are in
tokenmill.testing.reference_scheduler.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import re
import shlex
import signal
import sys
import uuid

from aiohttp import web

import tokenmill
from tokenmill.testing.reference_scheduler import (
    ENGINE,
    Engine,
    QueueFull,
    Req,
    Sampling,
)

log = logging.getLogger("tokenmill.reference")

READY_LINE = "The server is fired up and ready to roll!"

# SGLang's SamplingParams fields in declaration order (the order its "expected one of" lists),
# with the JSON type the contract gate decodes them as.
SAMPLING_FIELDS = {
    "max_new_tokens": "i64",
    "stop": "str_or_list",
    "stop_token_ids": "list_i64",
    "stop_regex": "str_or_list",
    "temperature": "f64",
    "top_p": "f64",
    "top_k": "i64",
    "min_p": "f64",
    "frequency_penalty": "f64",
    "presence_penalty": "f64",
    "repetition_penalty": "f64",
    "min_new_tokens": "i64",
    "n": "i64",
    "json_schema": "str",
    "regex": "str",
    "ebnf": "str",
    "structural_tag": "str",
    "ignore_eos": "bool",
    "skip_special_tokens": "bool",
    "spaces_between_special_tokens": "bool",
    "no_stop_trim": "bool",
    "custom_params": "map",
    "stream_interval": "i64",
    "logit_bias": "map",
    "sampling_seed": "i64",
    "beam_width": "i64",
    "watermark": "map",
}


class ApiError(Exception):
    def __init__(self, status: int, body):
        super().__init__(str(body))
        self.status = status
        self.body = body


def contract_error(msg: str) -> ApiError:
    """The JSON contract gate's shape: {"error": "<serde text>"}."""
    return ApiError(400, {"error": msg})


def value_error(msg: str, status: int = 400) -> ApiError:
    """A ValueError raised while normalizing/validating: {"error": {"message": ...}}."""
    return ApiError(status, {"error": {"message": msg}})


def object_error(msg: str, status: int) -> ApiError:
    """FastAPI validation / HTTPException shape."""
    kind = "Bad Request" if status == 400 else str(status)
    return ApiError(
        status, {"object": "error", "message": msg, "type": kind, "param": None, "code": status}
    )


def _serde_desc(value) -> str:
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value!r}`"
    if isinstance(value, str):
        return f"string {json.dumps(value)}"
    if isinstance(value, list):
        return "sequence"
    if isinstance(value, dict):
        return "map"
    return "null"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_type(key: str, kind: str, value) -> None:
    bad = None
    if kind == "i64":
        if not _is_int(value):
            bad = "i64"
    elif kind == "f64":
        if isinstance(value, bool) or not isinstance(value, int | float):
            bad = "f64"
    elif kind == "bool":
        if not isinstance(value, bool):
            bad = "a boolean"
    elif kind == "str":
        if not isinstance(value, str):
            bad = "a string"
    elif kind == "map":
        if not isinstance(value, dict):
            bad = "a map"
    elif kind == "list_i64":
        if not isinstance(value, list):
            bad = "a sequence"
        else:
            for v in value:
                if not _is_int(v):
                    raise contract_error(f"{key}: invalid type: {_serde_desc(v)}, expected i64")
    elif kind == "str_or_list" and not (
        isinstance(value, str)
        or (isinstance(value, list) and all(isinstance(s, str) for s in value))
    ):
        bad = "a string or a sequence of strings"
    if bad:
        raise contract_error(f"{key}: invalid type: {_serde_desc(value)}, expected {bad}")


_UNSUPPORTED = ("json_schema", "regex", "ebnf", "structural_tag", "custom_params", "watermark")


def parse_sampling(sp, skip_tokenizer_init: bool, vocab_size: int) -> Sampling:
    """Contract gate (types, unknown keys) then SGLang's value checks. Raises ApiError."""
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise contract_error(f"sampling_params: invalid type: {_serde_desc(sp)}, expected a map")
    for key, value in sp.items():
        if key not in SAMPLING_FIELDS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_FIELDS)
            raise contract_error(f"unknown field `{key}`, expected one of {expected}")
        if value is not None:
            _check_type(key, SAMPLING_FIELDS[key], value)
    s = Sampling()
    for key, value in sp.items():
        if value is None or not hasattr(s, key):
            continue
        if key in ("stop", "stop_regex") and isinstance(value, str):
            value = [value]
        if SAMPLING_FIELDS[key] == "f64":
            value = float(value)
        setattr(s, key, value)
    if "max_new_tokens" in sp and sp["max_new_tokens"] is None:
        s.max_new_tokens = None
    _check_values(s, sp, skip_tokenizer_init, vocab_size)
    return s


def _check_values(s: Sampling, sp: dict, skip_tokenizer_init: bool, vocab_size: int) -> None:
    for key in _UNSUPPORTED:
        if sp.get(key) is not None:
            raise value_error(f"{key} is not supported by the reference engine.")
    if (sp.get("beam_width") or 0) > 1:
        raise value_error("beam search (beam_width > 1) is not supported by the reference engine.")
    if s.n != 1:
        raise value_error("n > 1 is not supported by the reference engine; send copies instead.")
    for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty"):
        if not math.isfinite(getattr(s, name)):
            raise value_error(f"{name} must be finite, got {getattr(s, name)}.")
    if s.temperature < 0.0:
        raise value_error(f"temperature must be non-negative, got {s.temperature}.")
    if not 0.0 < s.top_p <= 1.0:
        raise value_error(f"top_p must be in (0, 1], got {s.top_p}.")
    if not 0.0 <= s.min_p <= 1.0:
        raise value_error(f"min_p must be in [0, 1], got {s.min_p}.")
    if s.top_k < 1 and s.top_k != -1:
        raise value_error(f"top_k must be -1 (disable), or at least 1, got {s.top_k}.")
    if not -2.0 <= s.frequency_penalty <= 2.0:
        raise value_error(f"frequency_penalty must be in [-2, 2], got {s.frequency_penalty}.")
    if not -2.0 <= s.presence_penalty <= 2.0:
        raise value_error(f"presence_penalty must be in [-2, 2], got {s.presence_penalty}.")
    if not 0.0 < s.repetition_penalty <= 2.0:
        raise value_error(f"repetition_penalty must be in (0, 2], got {s.repetition_penalty}.")
    if s.max_new_tokens is not None and s.max_new_tokens < 0:
        raise value_error(f"max_new_tokens must be at least 0, got {s.max_new_tokens}.")
    if s.min_new_tokens < 0:
        raise value_error(f"min_new_tokens must be in [0, max_new_tokens], got {s.min_new_tokens}.")
    if s.max_new_tokens is not None and s.min_new_tokens > s.max_new_tokens:
        raise value_error(
            f"min_new_tokens must be in [0, max_new_tokens({s.max_new_tokens})], "
            f"got {s.min_new_tokens}."
        )
    if s.stream_interval is not None and s.stream_interval < 1:
        raise value_error(f"stream_interval must be at least 1, got {s.stream_interval}.")
    if len(s.stop) > 32 or len(s.stop_regex) > 32:
        raise value_error("at most 32 stop strings / stop regexes are allowed.")
    for pattern in s.stop_regex:
        try:
            re.compile(pattern)
        except re.error as e:
            raise value_error(f"Invalid regex pattern in stop_regex: {pattern!r} ({e})") from None
    if skip_tokenizer_init:
        if s.stop:
            raise value_error(f"stop={s.stop} is unavailable when skip_tokenizer_init=True")
        if s.stop_regex:
            raise value_error(
                f"stop_regex={s.stop_regex} is unavailable when skip_tokenizer_init=True"
            )
        if s.min_new_tokens > 0:
            raise value_error(
                f"min_new_tokens={s.min_new_tokens} is unavailable when skip_tokenizer_init=True"
            )
    for tid in s.stop_token_ids:
        if not 0 <= tid < vocab_size:
            raise value_error(f"stop_token_ids: token id {tid} is out of the vocabulary.")
    if s.logit_bias:
        for k, v in s.logit_bias.items():
            if not str(k).lstrip("-").isdigit() or not 0 <= int(k) < vocab_size:
                raise value_error(f"logit_bias must has keys in [0, {vocab_size - 1}], got {k}.")
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise contract_error(f"logit_bias: invalid type: {_serde_desc(v)}, expected f64")


def build_requests(engine: Engine, body: dict) -> tuple[list[Req], bool]:
    """A /generate body -> the engine's requests (SGLang's validation). Raises ApiError."""
    if not isinstance(body, dict):
        raise object_error("Input should be a valid dictionary", 400)
    ids = body.get("input_ids")
    text = body.get("text")
    if ids is None and text is None and body.get("input_embeds") is None:
        raise value_error("Either text, input_ids or input_embeds should be provided.")
    if ids is None and body.get("input_embeds") is not None:
        raise value_error("input_embeds is not supported by the reference engine.")
    if ids is None:
        if engine.args.skip_tokenizer_init:
            raise value_error(
                "The engine initialized with skip_tokenizer_init=True cannot accept text "
                "prompts. Please provide input_ids or re-initialize the engine with "
                "skip_tokenizer_init=False."
            )
        if isinstance(text, str):
            batch, prompts = False, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            batch, prompts = True, text
        else:
            raise contract_error(f"text: invalid type: {_serde_desc(text)}, expected a string")
        id_lists = [engine.tokenizer.encode(t) for t in prompts]
    else:
        batch, id_lists = _parse_input_ids(ids)
    if isinstance(text, list) and ids is not None:
        batch = True
    for prompt in id_lists:
        if not prompt:
            raise value_error("input_ids cannot be empty.")
        for tid in prompt:
            if not 0 <= tid < engine.vocab_size:
                raise value_error(
                    f"Token id {tid} in input_ids is out of the vocabulary "
                    f"(vocab size {engine.vocab_size})."
                )
    n = len(id_lists)
    if (
        body.get("return_logprob") not in (None, False)
        and body.get("return_logprob") != [False] * n
    ):
        raise value_error("return_logprob is not supported by the reference engine.")
    if body.get("custom_logit_processor") is not None:
        raise value_error(
            "The server is not configured to enable custom logit processor. Please set "
            "`--enable-custom-logit-processor` to enable this feature."
        )
    if body.get("lora_path") is not None:
        raise value_error("LoRA is not supported by the reference engine.")
    sps = body.get("sampling_params")
    if isinstance(sps, list):
        if len(sps) != n:
            raise value_error(
                f"The length of sampling_params ({len(sps)}) does not match the batch size ({n})."
            )
    else:
        sps = [sps] * n
    merged = []
    for sp in sps:
        if engine.args.preferred_sampling_params and isinstance(sp, dict | type(None)):
            sp = {**engine.args.preferred_sampling_params, **(sp or {})}
        merged.append(sp)
    params = [
        parse_sampling(sp, engine.args.skip_tokenizer_init, engine.vocab_size) for sp in merged
    ]
    rids = _rids(body.get("rid"), n, batch)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise contract_error(f"stream: invalid type: {_serde_desc(stream)}, expected a boolean")
    reqs = []
    for i, (prompt, sp, rid) in enumerate(zip(id_lists, params, rids, strict=True)):
        reqs.append(make_request(engine, rid, prompt, sp, i, stream, body))
    return reqs, batch


def make_request(engine: Engine, rid, prompt, sp, index, stream, body) -> Req:
    ctx = engine.context_length
    if len(prompt) >= ctx:
        if not engine.args.allow_auto_truncate:
            raise value_error(
                f"The input ({len(prompt)} tokens) is longer than the model's context "
                f"length ({ctx} tokens)."
            )
        prompt = prompt[: ctx - 1]
    too_long = sp.max_new_tokens is not None and len(prompt) + sp.max_new_tokens > ctx
    if too_long and not engine.args.allow_auto_truncate:
        raise value_error(
            "Requested token count exceeds the model's maximum context length of "
            f"{ctx} tokens. You requested a total of {len(prompt) + sp.max_new_tokens} "
            f"tokens: {len(prompt)} tokens from the input messages and "
            f"{sp.max_new_tokens} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )
    # Like SGLang's scheduler: leave room for the token that would follow.
    room = ctx - len(prompt) - 1
    max_new = room if sp.max_new_tokens is None else min(sp.max_new_tokens, room)
    stop_ids = frozenset() if sp.ignore_eos else engine.eos_ids | set(sp.stop_token_ids)
    return Req(
        rid=rid,
        input_ids=list(prompt),
        sp=sp,
        max_new=max(max_new, 0),
        stop_ids=stop_ids,
        stream=stream,
        index=index,
        return_prompt_token_ids=bool(body.get("return_prompt_token_ids")),
    )


def _parse_input_ids(ids) -> tuple[bool, list[list[int]]]:
    if not isinstance(ids, list):
        raise contract_error(f"input_ids: invalid type: {_serde_desc(ids)}, expected a sequence")
    if not ids:
        raise value_error("input_ids cannot be empty.")
    if isinstance(ids[0], list):
        lists = ids
        for x in lists:
            if not isinstance(x, list):
                raise contract_error(
                    f"input_ids: invalid type: {_serde_desc(x)}, expected a sequence"
                )
        batch = True
    else:
        lists, batch = [ids], False
    for x in lists:
        for v in x:
            if not _is_int(v):
                raise contract_error(f"input_ids: invalid type: {_serde_desc(v)}, expected i64")
    return batch, lists


def _rids(rid, n: int, batch: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(n)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(n)] if batch else [rid]
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != n:
            raise value_error("The specified rids length mismatch with the batch_size.")
        if len(set(rid)) != len(rid):
            raise value_error(f"Duplicate request IDs detected within the request: {rid}")
        return list(rid)
    raise contract_error(f"rid: invalid type: {_serde_desc(rid)}, expected a string")


# ---------------------------------------------------------------------------------------- HTTP

OPEN_PREFIXES = ("/health", "/ready", "/metrics")


def make_app(engine: Engine) -> web.Application:
    key = engine.args.api_key

    @web.middleware
    async def auth(request, handler):
        if key and not request.path.startswith(OPEN_PREFIXES):
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), key.encode()
            ):
                return web.json_response({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except ApiError as e:
            return web.json_response(e.body, status=e.status)

    def need_loaded():
        if not engine.loaded:
            raise object_error("The server is starting up; the model is not loaded yet.", 503)

    async def health(request):
        return web.Response(status=200 if engine.loaded and not engine.stopping else 503)

    async def model_info(request):
        need_loaded()
        return web.json_response(engine.model_info())

    async def server_info(request):
        return web.json_response(engine.server_info())

    async def models(request):
        need_loaded()
        name = engine.args.served_model_name
        entry = {
            "id": name,
            "object": "model",
            "created": int(engine.startup_time),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": engine.context_length,
        }
        return web.json_response({"object": "list", "data": [entry]})

    async def generate(request):
        need_loaded()
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            raise object_error(f"JSON decode error: {e}", 400) from None
        reqs, batch = build_requests(engine, body)
        try:
            engine.submit(reqs)
        except QueueFull as exc:
            raise object_error(str(exc), 503) from None
        if reqs[0].stream:
            return await stream(request, reqs, batch)
        try:
            for r in reqs:
                await r.done.wait()
        except asyncio.CancelledError:
            for r in reqs:
                engine.abort(r.rid)
            raise
        results = [engine.result(r) for r in reqs]
        return web.json_response(results if batch else results[0])

    async def stream(request, reqs, batch):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            pending = set(reqs)
            while pending:
                waits = [asyncio.ensure_future(r.updated.wait()) for r in pending]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for w in waits:
                    w.cancel()
                for r in list(pending):
                    if not r.updated.is_set():
                        continue
                    r.updated.clear()
                    done = r.state == "done"
                    chunk = engine.result(r)
                    if chunk["meta_info"]["finish_reason"] is not None and not done:
                        # Finished between steps but not yet closed by the scheduler: only the
                        # closing chunk carries a finish_reason, as in SGLang.
                        continue
                    if batch:
                        chunk["index"] = r.index
                    await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                    if done:
                        pending.discard(r)
            await resp.write(b"data: [DONE]\n\n")
        except (asyncio.CancelledError, ConnectionResetError):
            for r in reqs:
                engine.abort(r.rid)
            raise
        return resp

    async def abort_request(request):
        try:
            body = await request.json()
        except ValueError:
            body = {}
        if isinstance(body, dict):
            if body.get("abort_all"):
                engine.abort(all_=True)
            elif body.get("rid"):
                engine.abort(str(body["rid"]))
        return web.Response(status=200)

    async def metrics(request):
        return web.Response(text=engine.metrics_text(), content_type="text/plain")

    async def flush_cache(request):
        return web.Response(text="Cache flushed (the reference engine has no prefix cache).\n")

    app = web.Application(middlewares=[auth], client_max_size=512 * 1024**2)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/ready", health)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/generate", generate)
    app.router.add_put("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_route("*", "/flush_cache", flush_cache)
    if engine.args.enable_metrics:
        app.router.add_get("/metrics", metrics)
    return app


# ----------------------------------------------------------------------------------------- CLI

# SGLang flags accepted for launch-command compatibility and otherwise ignored: (flag, takes value).
_IGNORED_FLAGS = [
    (("--tp-size", "--tp", "--tensor-parallel-size"), True),
    (("--dp-size", "--dp", "--data-parallel-size"), True),
    (("--pp-size", "--pipeline-parallel-size"), True),
    (("--ep-size", "--expert-parallel-size"), True),
    (("--nnodes",), True),
    (("--node-rank",), True),
    (("--dist-init-addr", "--nccl-init-addr"), True),
    (("--mem-fraction-static",), True),
    (("--revision",), True),
    (("--watchdog-timeout",), True),
    (("--chunked-prefill-size",), True),
    (("--max-total-tokens",), True),
    (("--max-prefill-tokens",), True),
    (("--cuda-graph-max-bs",), True),
    (("--attention-backend",), True),
    (("--sampling-backend",), True),
    (("--dtype",), True),
    (("--kv-cache-dtype",), True),
    (("--quantization",), True),
    (("--load-format",), True),
    (("--device",), True),
    (("--base-gpu-id",), True),
    (("--schedule-policy",), True),
    (("--chat-template",), True),
    (("--load-balance-method",), True),
    (("--disable-radix-cache",), False),
    (("--disable-cuda-graph",), False),
    (("--enable-torch-compile",), False),
    (("--enable-dp-attention",), False),
    (("--skip-server-warmup",), False),
    (("--incremental-streaming-output",), False),
    # operational flags (tokenmill/launch_flags.py): accepted so tests can add them
    (("--log-requests-level",), True),
    (("--decode-log-interval",), True),
    (("--show-time-cost",), False),
    (("--dist-timeout",), True),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tokenmill serve-reference",
        description="CPU reference engine speaking SGLang's native /generate API.",
    )
    p.add_argument("--model-path", "--model", required=True)
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--random-seed", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--allow-auto-truncate", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--preferred-sampling-params", type=json.loads, default=None)
    p.add_argument("--reasoning-parser", default=None)
    p.add_argument("--tool-call-parser", default=None)
    p.add_argument("--stream-interval", type=int, default=1)
    p.add_argument("--log-requests", action="store_true", help="log every request served")
    p.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch intra-op threads (fixed so outputs do not depend on the machine's core count)",
    )
    for names, takes_value in _IGNORED_FLAGS:
        if takes_value:
            p.add_argument(*names, default=None, help=argparse.SUPPRESS, dest="_ign" + names[0])
        else:
            p.add_argument(
                *names, action="store_true", help=argparse.SUPPRESS, dest="_ign" + names[0]
            )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for key in [k for k in vars(args) if k.startswith("_ign")]:
        delattr(args, key)
    if args.tokenizer_path is None:
        args.tokenizer_path = args.model_path
    if args.served_model_name is None:
        args.served_model_name = args.model_path
    if args.random_seed is None:
        # SGLang draws a random seed when none is given.
        args.random_seed = int.from_bytes(os.urandom(4), "little") & 0x7FFF_FFFF
    if args.max_running_requests < 1:
        raise SystemExit("--max-running-requests must be at least 1")
    args.tp_size = 1
    args.dp_size = 1
    args._launch_command = shlex.join([sys.executable, "-m", "tokenmill", "serve-reference", *argv])
    return args


async def serve(args) -> int:
    loop = asyncio.get_running_loop()
    engine = Engine(args)
    engine.wakeup = asyncio.Event()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # --log-requests (as SGLang's flag): one access-log line per HTTP request served, so tests
    # can count what the server itself received.
    access_log = logging.getLogger("aiohttp.access") if args.log_requests else None
    if access_log:
        access_log.setLevel(logging.INFO)
    runner = web.AppRunner(
        make_app(engine),
        access_log=access_log,
        access_log_format='%a "%r" %s',
        shutdown_timeout=1.0,
    )
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info(
        "%s %s: loading model %s, listening on http://%s:%d",
        ENGINE,
        tokenmill.__version__,
        args.model_path,
        args.host,
        args.port,
    )
    load = loop.run_in_executor(engine.executor, engine.load)
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([load, stopper], return_when=asyncio.FIRST_COMPLETED)
    scheduler = None
    rc = 0
    if not stop.is_set():
        try:
            load.result()
        except Exception:
            log.exception("Failed to load the model from %s", args.model_path)
            rc = 1
            stop.set()
    if not stop.is_set():
        engine.loaded = True
        scheduler = asyncio.ensure_future(engine.scheduler())
        log.info(
            "Model loaded: vocab %d, context length %d, eos ids %s, max running requests %d",
            engine.vocab_size,
            engine.context_length,
            sorted(engine.eos_ids),
            args.max_running_requests,
        )
        log.info(READY_LINE)
        await stopper
    log.info("Shutting down")
    engine.stopping = True
    engine.abort(all_=True)
    if engine.wakeup is not None:
        engine.wakeup.set()
    if scheduler is not None:
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(scheduler, timeout=0.5)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(runner.cleanup(), timeout=1.0)
    engine.executor.shutdown(wait=False, cancel_futures=True)
    log.info("Shutdown complete")
    return rc


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="[%(asctime)s] %(message)s",
        stream=sys.stderr,
    )
    # The worker's torch would otherwise log per-thread warnings and HF would try the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    rc = asyncio.run(serve(args))
    # Everything is flushed and closed; skip the interpreter teardown, which for torch +
    # transformers takes ~2 s on a busy machine and would break the 2 s SIGTERM promise.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
