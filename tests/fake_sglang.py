"""A fake SGLang server (no model) speaking the native API's shapes, with fault injection.

Raw asyncio HTTP/1.1 with keep-alive (fast enough to benchmark a client against); a connection
idle for 5 s between requests is closed, as SGLang's uvicorn does (--idle-timeout). output_ids
are a deterministic function of input_ids and end with the first stop_token_id (finish "stop"),
or run to max_new_tokens (finish "length") when no stop token is given.

Every /generate received is counted: GET /stats, and one line per request appended to
--counter-file (survives the server's death, so restart tests can count across processes).

Launchable as a managed-mode command:
    {python} tests/fake_sglang.py --model-path {model} --host {host} --port {port} [faults]

--script FILE answers chosen prompts with chosen ids (a model's exact tool call, say): a JSON
list of {"ends_with": [ids], "output": [ids]}, the first rule whose ids end the prompt wins.

--sglang-version picks whose answers it gives where releases differ (docs/sglang-api.md):
"0.5.23" (default, read from the source): an unknown sampling key is a JSON 400, /model_info has
served_model_name. "0.5.16" (measured on a real server): no served_model_name in /model_info, an
unknown or ill-typed sampling key (beam_width, watermark, seed, ...) is a plain-text 500, a float
max_new_tokens kills the server. In both: a rid still in flight is a 400 "Duplicate request ID
detected", sampling_seed is ignored (not echoed in meta_info) unless the server runs with
--enable-deterministic-inference, and a prompt id >= --vocab-size kills the whole server.

With --api vllm it speaks vLLM's shapes instead (POST /v1/completions with a token-ID prompt and
return_token_ids, GET /v1/models and /version), same outputs and faults; EOS (--eos-id) is
reported like vLLM does: stop_reason null, the EOS as the last token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import sys
import time

from gate_proxy import hold_limit  # tests/ is on sys.path: this script's folder

SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "min_new_tokens", "stop", "stop_regex",
    "stop_token_ids", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "n", "json_schema", "regex", "ebnf", "structural_tag", "logit_bias",
    "sampling_seed", "stream_interval", "custom_params", "beam_width", "watermark",
}  # fmt: skip

# 0.5.16 refuses these with a plain-text 500 (a TypeError inside the server).
NOT_IN_0_5_16 = {"beam_width", "watermark"}

REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           500: "Internal Server Error", 503: "Service Unavailable"}  # fmt: skip


def _share_of(ids) -> float:
    """A prompt's place in [0, 1), from a hash of its ids: the same prompt, the same place."""
    digest = hashlib.sha256(",".join(map(str, ids)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def fake_output(
    input_ids: list[int], max_new: int, stop_ids: list[int], length: int | None = None
) -> tuple[list[int], dict]:
    """`length`: that many tokens before the stop token (1-5 by default)."""
    seed = sum(input_ids) * 31 + len(input_ids)
    n = length if length is not None else len(input_ids) % 5 + 1
    body = [10 + (seed + 7 * i) % 1000 for i in range(n)]
    if stop_ids and n < max_new:
        return body + [stop_ids[0]], {"type": "stop", "matched": stop_ids[0]}
    body = body[:max_new]
    return body, {"type": "length", "length": max_new}


class Fake:
    def __init__(self, args):
        self.a = args
        self.count = 0
        self.started = time.monotonic()
        self.counter = open(args.counter_file, "a") if args.counter_file else None  # noqa: SIM115
        self.in_flight: set[str] = set()
        self.old = args.sglang_version == "0.5.16"
        self.script = []
        if args.script:
            with open(args.script) as f:
                self.script = json.load(f)

    def scripted(self, ids: list[int], stop_ids: list[int]):
        """(output, finish) of the first --script rule whose ends_with ends `ids`, else None."""
        for rule in self.script:
            end = rule["ends_with"]
            if ids[len(ids) - len(end) :] == end:
                out = list(rule["output"])
                if out and out[-1] in stop_ids:
                    return out, {"type": "stop", "matched": out[-1]}
                return out, {"type": "length", "length": len(out)}
        return None

    def ready(self) -> bool:
        return time.monotonic() - self.started >= self.a.startup_delay

    def model_info(self) -> dict:
        info = {
            "model_path": self.a.model_path,
            "served_model_name": self.a.served_model_name or self.a.model_path,
            "tokenizer_path": self.a.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
        }
        if self.old:  # as measured: no served_model_name
            del info["served_model_name"]
            info.update(has_image_understanding=False, has_audio_understanding=False,
                        model_type="qwen2", architectures=["Qwen2ForCausalLM"])  # fmt: skip
        return info

    def server_info(self) -> dict:
        return {
            "model_path": self.a.model_path,
            "served_model_name": self.a.served_model_name or self.a.model_path,
            "skip_tokenizer_init": self.a.skip_tokenizer_init,
            "enable_deterministic_inference": self.a.enable_deterministic_inference,
            "tp_size": 1,
            "port": self.a.port,
            "api_key": self.a.api_key,
            "hf_token": "hf_should_not_leak",
            "max_total_num_tokens": 4096,
            "launch_command": " ".join(sys.argv),
            "version": self.a.sglang_version,
            "internal_states": [{"last_gen_throughput": 0.0}],
        }

    async def generate(self, body: bytes):
        """-> (status, payload) or 'reset' / 'hang' / 'die'."""
        rid = None
        with contextlib.suppress(ValueError, AttributeError):
            rid = json.loads(body).get("rid")
        if rid is not None and rid in self.in_flight:
            self.count += 1
            msg = f"Duplicate request ID detected: {rid}"
            return 400, {"error": {"message": msg}}
        if rid is not None:
            self.in_flight.add(rid)
        try:
            return await self._generate(body)
        finally:
            self.in_flight.discard(rid)

    async def _generate(self, body: bytes):
        self.count += 1
        n = self.count
        a = self.a
        try:
            req = json.loads(body)
        except ValueError:
            return 400, {"object": "error", "message": "bad json", "type": "Bad Request",
                         "param": None, "code": 400}  # fmt: skip
        ids = req.get("input_ids") or []
        if self.counter:
            self.counter.write(
                json.dumps(
                    {
                        "n": n,
                        "rid": req.get("rid"),
                        "ids": ids,
                        "sp": req.get("sampling_params"),
                        "vllm": req.get("vllm"),
                    }
                )
                + "\n"
            )
            self.counter.flush()
        if a.die_after and n > a.die_after and not (a.die_marker and os.path.exists(a.die_marker)):
            if a.die_marker:
                open(a.die_marker, "w").close()
            return "die"
        if n <= a.exit_first:
            return "die"
        if a.vocab_size is not None and any(not 0 <= t < a.vocab_size for t in ids):
            print(f"fake sglang: token id out of vocabulary {a.vocab_size}: scheduler dies",
                  flush=True)  # fmt: skip
            return "die"
        if n <= a.duplicate_rid_first:  # as if another process had this rid in flight
            return 400, {"error": {"message": f"Duplicate request ID detected: {req.get('rid')}"}}
        if n <= a.fail_400:
            msg = "stop=['x'] is unavailable when skip_tokenizer_init=True"
            return 400, {"error": {"message": msg}}
        if n <= a.reset_first:
            return "reset"
        if n <= a.hang_first:
            return "hang"
        if n <= a.fail_503:
            return 503, {"object": "error", "message": "The request queue is full.",
                         "type": "503", "param": None, "code": 503}  # fmt: skip
        if n <= a.fail_500:
            return 500, "Internal Server Error"
        sp = req.get("sampling_params") or {}
        accepted = SAMPLING_KEYS - NOT_IN_0_5_16 if self.old else SAMPLING_KEYS
        unknown = [k for k in sp if k not in accepted]
        if unknown and self.old:
            return 500, "Internal Server Error"
        if unknown:
            return 400, {"error": f"unknown field `{unknown[0]}`, expected one of ..."}
        if self.old and isinstance(sp.get("max_new_tokens"), float):
            return "die"
        if not ids:
            return 400, {"error": {"message": "input_ids cannot be empty."}}
        ctx, max_new = a.context_length, sp.get("max_new_tokens", 128)
        if ctx and len(ids) >= ctx:
            msg = (f"The input ({len(ids)} tokens) is longer than the model's context length "
                   f"({ctx} tokens).")  # fmt: skip
            return 400, {"error": {"message": msg}}
        if ctx and len(ids) + max_new > ctx:
            msg = (f"Requested token count exceeds the model's maximum context length of {ctx} "
                   f"tokens. You requested a total of {len(ids) + max_new} tokens")  # fmt: skip
            return 400, {"error": {"message": msg}}
        if ids[0] in a.error_first_token:
            return 500, "Internal Server Error"
        if ids[0] in a.hang_first_token:
            return "hang"
        if ids[0] in a.reset_first_token:  # a prompt that crashes a scheduler worker, say
            return "reset"
        if a.reject_share and _share_of(ids) < a.reject_share:  # this prompt, every time
            msg = f"Input length ({len(ids)} tokens) exceeds the maximum allowed length"
            return 400, {"error": {"message": msg}}
        if ids[0] in a.reject_first_token:
            shape = ids[0] % 3
            msg = f"Input length ({len(ids)} tokens) exceeds the maximum allowed length"
            if shape == 0:
                return 400, {"error": {"message": msg}}
            if shape == 1:
                return 400, {"error": msg}
            return 400, {"object": "error", "message": msg, "type": "Bad Request",
                         "param": None, "code": 400}  # fmt: skip
        if a.latency:
            await asyncio.sleep(a.latency)
        while (limit := hold_limit(a.hold_file)) is not None and n > limit:
            await asyncio.sleep(0.02)  # held: a kill test's interruption lands mid-shard
        stop_ids = sp.get("stop_token_ids") or []
        out, finish = self.scripted(ids, stop_ids) or fake_output(ids, max_new, stop_ids,
                                                                   a.output_len)  # fmt: skip
        if n <= a.abort_first or ids[0] in a.abort_first_token:
            out, finish = out[:1], {"type": "abort", "message": "Aborted", "status_code": None,
                                    "err_type": None}  # fmt: skip
        meta = {
            "id": req.get("rid"),
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            "weight_version": "default",
            "e2e_latency": a.latency,
        }
        if "sampling_seed" in sp and a.enable_deterministic_inference:
            meta["sampling_seed_seen"] = sp["sampling_seed"]  # without the flag: ignored
        return 200, {"output_ids": out, "meta_info": meta}

    async def vllm_completions(self, body: bytes):
        """vLLM's /v1/completions on top of the SGLang fake: translate in, translate out."""
        try:
            req = json.loads(body)
        except ValueError:
            return 400, {"error": {"message": "bad json", "type": "BadRequestError", "code": 400}}
        if not req.get("return_token_ids"):
            return 400, {"error": {"message": "tokenmill needs return_token_ids"}}
        sp = {"max_new_tokens": req.get("max_tokens", 16)}
        sp["stop_token_ids"] = req.get("stop_token_ids") or []
        if self.a.eos_id is not None:
            sp["stop_token_ids"] = sp["stop_token_ids"] or [self.a.eos_id]
        inner = {
            "input_ids": req.get("prompt"),
            "rid": req.get("request_id"),
            "sampling_params": sp,
            "vllm": req,  # logged as sent, for the tests
        }
        res = await self.generate(json.dumps(inner).encode())
        if not isinstance(res, tuple) or res[0] != 200:
            if isinstance(res, tuple) and isinstance(res[1], dict):
                msg = res[1].get("message") or res[1].get("error")
                msg = msg.get("message") if isinstance(msg, dict) else msg
                return res[0], {"error": {"message": msg, "type": "Error", "code": res[0]}}
            return res
        out, meta = res[1]["output_ids"], res[1]["meta_info"]
        finish = meta["finish_reason"]
        stop = finish.get("matched") if finish["type"] == "stop" else None
        if stop == self.a.eos_id:
            stop = None  # vLLM: EOS has no stop_reason
        choice = {"index": 0, "text": "", "finish_reason": finish["type"], "stop_reason": stop,
                  "token_ids": out, "prompt_token_ids": req["prompt"]}  # fmt: skip
        n_in = len(req["prompt"])
        usage = {"prompt_tokens": n_in, "completion_tokens": len(out),
                 "total_tokens": n_in + len(out), "prompt_tokens_details": None}  # fmt: skip
        return 200, {"id": f"cmpl-{req.get('request_id')}", "object": "text_completion",
                     "model": req.get("model"), "choices": [choice], "usage": usage}  # fmt: skip

    async def route(self, method: str, path: str, headers: dict, body: bytes):
        path = path.split("?", 1)[0]
        if self.a.api == "vllm":
            return await self.route_vllm(method, path, headers, body)
        if path in ("/health", "/health_generate", "/ready"):
            return (200, "") if self.ready() else (503, "")
        if path == "/stats":
            return 200, {"generate_requests": self.count}
        if self.a.api_key and headers.get("authorization") != f"Bearer {self.a.api_key}":
            return 401, {"error": "Unauthorized"}
        if path in ("/model_info", "/get_model_info"):
            return (200, self.model_info()) if self.ready() else (503, "")
        if path in ("/server_info", "/get_server_info"):
            return 200, self.server_info()
        if path == "/generate" and method in ("POST", "PUT"):
            return await self.generate(body)
        return 404, {"detail": "Not Found"}

    async def route_vllm(self, method: str, path: str, headers: dict, body: bytes):
        if path == "/health":
            return (200, "") if self.ready() else (503, "")
        if self.a.api_key and headers.get("authorization") != f"Bearer {self.a.api_key}":
            return 401, {"error": {"message": "Unauthorized", "type": "Unauthorized"}}
        if path == "/version":
            keep_alive = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE")
            return 200, {"version": "0.32.0-fake", "env_keep_alive": keep_alive}
        if path == "/v1/models":
            name = self.a.served_model_name or self.a.model_path
            return 200, {"object": "list", "data": [
                {"id": name, "object": "model", "root": self.a.model_path, "max_model_len": 2048}
            ]}  # fmt: skip
        if path == "/v1/completions" and method == "POST":
            return await self.vllm_completions(body)
        return 404, {"detail": "Not Found"}

    def idle_timeout(self) -> float | None:
        t = self.a.idle_timeout
        if t is None:
            env = os.environ.get("VLLM_HTTP_TIMEOUT_KEEP_ALIVE") if self.a.api == "vllm" else None
            t = float(env) if env else 5.0
        return t or None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        idle = self.idle_timeout()
        try:
            while True:
                try:  # uvicorn: a connection idle this long between requests is closed
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), idle)
                except TimeoutError:
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {}
                for ln in lines[1:]:
                    if ":" in ln:
                        k, v = ln.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                res = await self.route(method, path, headers, body)
                if res == "die":
                    os._exit(3)
                if res == "reset":
                    writer.transport.abort()
                    return
                if res == "hang":
                    await asyncio.sleep(3600)
                    return
                status, payload = res
                data = (
                    payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                )
                ctype = "text/plain" if isinstance(payload, str) else "application/json"
                writer.write(
                    f"HTTP/1.1 {status} {REASONS.get(status, 'X')}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(data)}\r\nConnection: keep-alive\r\n\r\n".encode()
                    + data
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


# ---------------------------------------------------------------------------- test helpers
FAKE = os.path.abspath(__file__)


def start(port: int, *flags: str, model: str = "fake/model", env=None):
    """Start a fake server process on 127.0.0.1:port and wait until it answers /health."""
    import subprocess
    import urllib.request

    cmd = [sys.executable, FAKE, "--model-path", model, "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("fake server did not start")


def count_requests(counter_file) -> int:
    try:
        with open(counter_file) as f:
            return sum(1 for _ in f)
    except FileNotFoundError:
        return 0


def requested_ids(counter_file) -> list[list[int]]:
    with open(counter_file) as f:
        return [json.loads(line)["ids"] for line in f]


def parse_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--model-path")
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--api-key")
    p.add_argument("--counter-file")
    p.add_argument("--latency", type=float, default=0.0, help="seconds each /generate takes")
    p.add_argument("--startup-delay", type=float, default=0.0, help="/health 503 this long")
    p.add_argument("--exit-at-start", type=int, default=None, help="exit with this code at once")
    p.add_argument("--fail-503", type=int, default=0, help="first N /generate get 503")
    p.add_argument("--fail-500", type=int, default=0, help="first N /generate get 500")
    p.add_argument("--reset-first", type=int, default=0, help="first N: connection reset")
    p.add_argument("--hang-first", type=int, default=0, help="first N never answer")
    p.add_argument("--abort-first", type=int, default=0, help="first N: finish_reason abort")
    p.add_argument("--exit-first", type=int, default=0, help="die on each of the first N")
    p.add_argument("--die-after", type=int, default=0, help="die on request N+1")
    p.add_argument("--hold-file", help="holds an int N: requests after the Nth are held")
    p.add_argument("--die-marker", help="die only once: skip dying if this file exists")
    p.add_argument("--reject-first-token", type=int, action="append", default=[],
                   help="400 for prompts whose first token is this")  # fmt: skip
    p.add_argument(
        "--reject-share",
        type=float,
        default=0.0,
        help="400 for this share of the prompts (chosen by a hash of their ids)",
    )
    p.add_argument("--skip-tokenizer-init", action="store_true")
    p.add_argument("--sglang-version", default="0.5.23", choices=["0.5.23", "0.5.16"])
    p.add_argument("--enable-deterministic-inference", action="store_true")
    p.add_argument("--vocab-size", type=int, default=None, help="a prompt id >= this: die")
    p.add_argument("--context-length", type=int, default=0, help="400 past it (0: none)")
    p.add_argument("--duplicate-rid-first", type=int, default=0,
                   help="first N: 400 Duplicate request ID")  # fmt: skip
    p.add_argument("--fail-400", type=int, default=0, help="first N: 400 not blaming the prompt")
    for what in ("error", "abort", "hang", "reset"):
        p.add_argument(f"--{what}-first-token", type=int, action="append", default=[],
                       help=f"prompts whose first token is this: always {what}")  # fmt: skip
    p.add_argument("--api", choices=["sglang", "vllm"], default="sglang")
    p.add_argument("--idle-timeout", type=float, default=None,
                   help="close a keep-alive connection idle this long (default 5 s, as SGLang's "
                   "uvicorn; --api vllm: VLLM_HTTP_TIMEOUT_KEEP_ALIVE or 5; 0: never)")  # fmt: skip
    p.add_argument("--eos-id", type=int, default=None, help="vllm: EOS when no stop ids are sent")
    p.add_argument("--output-len", type=int, default=None, help="tokens before the stop token")
    p.add_argument("--script", help="JSON file: [{ends_with: [ids], output: [ids]}]; a prompt "
                   "ending with ends_with gets that output (first match)")  # fmt: skip
    p.add_argument("--model", dest="model_path", help="vLLM's spelling of --model-path")
    args, _ = p.parse_known_args(argv)  # tolerate real SGLang flags in launch commands
    return args


async def amain(args):
    fake = Fake(args)
    server = await asyncio.start_server(fake.handle, args.host, args.port, backlog=1024)
    print(f"fake sglang listening on {args.host}:{args.port} pid={os.getpid()}", flush=True)
    print("The server is fired up and ready to roll!", flush=True)
    async with server:
        await server.serve_forever()


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.exit_at_start is not None:
        print("fake sglang: failing at start (as asked)", flush=True)
        sys.exit(args.exit_at_start)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(amain(args))


if __name__ == "__main__":
    main()
