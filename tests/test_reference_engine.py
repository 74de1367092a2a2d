"""The CPU reference engine (`tokenmill serve-reference`) against the SGLang native API contract
(docs/sglang-api.md). Real servers on 127.0.0.1, serving the committed tiny
model in sample/model (kimi-shaped; <|im_end|> is the EOS and the model learned to stop on it)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tokenmill.engines.sglang import SAMPLING_KEYS
from tokenmill.testing.reference_api import READY_LINE, SAMPLING_FIELDS

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "sample" / "model"
KEY = "s3cret-key"
EOS = 4  # <|im_end|> in sample/model (config.json eos_token_id)
CTX = 256
META_KEYS = [
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "cached_tokens_details",
    "e2e_latency",
    "response_sent_to_client_ts",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str, skip_tokenizer_init: bool = True):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "tokenmill", "serve-reference", "--model-path", str(MODEL)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--context-length", str(CTX)]
        cmd += ["--trust-remote-code", "--tp", "1", "--mem-fraction-static", "0.8"]  # ignored
        if skip_tokenizer_init:
            cmd.append("--skip-tokenizer-init")
        cmd += list(extra)
        self.log = open(os.devnull, "w")  # noqa: SIM115
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.PIPE, text=True, env=env
        )
        self.stderr: list[str] = []
        self.health_seen: set[int] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("server died:\n" + "".join(self.stderr))
            try:
                status = call(self.url + "/health")[0]
                self.health_seen.add(status)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not become healthy:\n" + "".join(self.stderr))

    def _read(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def stop(self) -> float:
        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        return time.monotonic() - t


def call(url: str, body=None, key: str | None = None, method: str | None = None, raw=None):
    """-> (status, parsed JSON or text). Never raises on HTTP errors."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


@pytest.fixture(scope="session")
def server():
    s = Server(
        "--api-key",
        KEY,
        "--enable-metrics",
        "--enable-deterministic-inference",
        "--random-seed",
        "7",
        "--served-model-name",
        "tiny",
        "--max-running-requests",
        "32",
        "--log-level",
        "debug",
    )
    yield s
    s.stop()


def gen(server, body, key=KEY):
    return call(server.url + "/generate", body, key=key)


def chat_prompt(question: str) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    text = (
        f"<|im_user|>user<|im_middle|>{question}<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    return tok.encode(text, add_special_tokens=False).ids


PROMPTS = [[(7 * i + 3 * j) % 700 + 14 for j in range(1 + (i * 5) % 23)] for i in range(16)]
QUESTIONS = ["What is 2 plus 2?", "Name a color.", "Explain binary search.", "Say hello."]


def greedy_body(prompt, max_new=40, ignore_eos=False):
    sp = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": ignore_eos}
    return {"input_ids": prompt, "sampling_params": sp}


# ------------------------------------------------------------------------------------- shapes


def test_sampling_fields_match_client_list():
    assert set(SAMPLING_FIELDS) == SAMPLING_KEYS


def test_health_is_503_while_loading(server):
    # The HTTP site is up before torch is even imported, so the startup poll saw the 503.
    assert server.health_seen == {503, 200}


def test_info_endpoints(server):
    assert call(server.url + "/health")[0] == 200
    assert call(server.url + "/health_generate")[0] == 200
    assert call(server.url + "/ready")[0] == 200
    for path in ("/model_info", "/get_model_info"):
        status, info = call(server.url + path, key=KEY)
        assert status == 200
        assert info["model_path"] == str(MODEL)
        assert info["served_model_name"] == "tiny"
        assert info["tokenizer_path"] == str(MODEL)
        assert info["is_generation"] is True
        assert info["weight_version"] == "default"
        assert "preferred_sampling_params" in info
    for path in ("/server_info", "/get_server_info"):
        status, info = call(server.url + path, key=KEY)
        assert status == 200
        assert info["api_key"] == KEY  # as SGLang does: the client must redact it
        assert info["context_length"] == CTX
        assert info["random_seed"] == 7
        assert info["max_running_requests"] == 32
        assert info["skip_tokenizer_init"] is True
        assert "serve-reference" in info["launch_command"]
        assert info["version"].startswith("tokenmill-reference-")
        assert info["engine"] == "tokenmill-reference"
        assert isinstance(info["max_total_num_tokens"], int)
        assert isinstance(info["internal_states"], list) and info["internal_states"]
    status, models = call(server.url + "/v1/models", key=KEY)
    assert status == 200 and models["object"] == "list"
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == CTX
    assert any(READY_LINE in line for line in server.stderr)


def test_generate_shape_and_stop_token_kept_last(server):
    prompt = chat_prompt("What is 2 plus 2?")
    status, out = gen(server, {**greedy_body(prompt, 64), "rid": "q-1"})
    assert status == 200
    assert list(out) == ["output_ids", "meta_info"]  # no "text" under --skip-tokenizer-init
    meta = out["meta_info"]
    assert list(meta) == META_KEYS
    assert meta["id"] == "q-1"
    assert meta["finish_reason"] == {"type": "stop", "matched": EOS}
    assert out["output_ids"][-1] == EOS and EOS not in out["output_ids"][:-1]
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["prompt_tokens"] == len(prompt)
    # no prefix cache: null (stats say "unknown"), never a 0 hit rate
    assert meta["cached_tokens"] is None and meta["weight_version"] == "default"
    assert meta["e2e_latency"] >= 0


def test_stop_token_ids_and_length_finish(server):
    sp = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    outs = [gen(server, {"input_ids": p, "sampling_params": sp})[1] for p in PROMPTS]
    for out in outs:
        assert len(out["output_ids"]) == 12
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
        assert out["meta_info"]["completion_tokens"] == 12
    # A stop_token_ids hit ends the output at its first occurrence, the token kept last.
    i, ids = next(
        (i, o["output_ids"])
        for i, o in enumerate(outs)
        if o["output_ids"][0] != EOS and o["output_ids"][1] not in (EOS, o["output_ids"][0])
    )
    body = {"input_ids": PROMPTS[i]}
    body["sampling_params"] = {"temperature": 0, "max_new_tokens": 12, "stop_token_ids": [ids[1]]}
    status, stopped = gen(server, body)
    assert status == 200
    assert stopped["output_ids"] == ids[:2]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[1]}
    assert stopped["meta_info"]["completion_tokens"] == 2
    # max_new_tokens 0: no tokens, length 0.
    body["sampling_params"] = {"max_new_tokens": 0}
    status, empty = gen(server, body)
    assert status == 200 and empty["output_ids"] == []
    assert empty["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_default_max_new_tokens_is_128(server):
    body = {"input_ids": PROMPTS[1], "sampling_params": {"temperature": 0, "ignore_eos": True}}
    status, out = gen(server, body)
    assert status == 200 and len(out["output_ids"]) == 128
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 128}


def test_batch_in_order_and_equal_to_singles(server):
    prompts = [PROMPTS[5], PROMPTS[0], PROMPTS[9]]
    status, outs = gen(
        server,
        {
            "input_ids": prompts,
            "sampling_params": {"temperature": 0, "max_new_tokens": 20},
            "rid": "b",
        },
    )
    assert status == 200 and isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["id"] for o in outs] == ["b_0", "b_1", "b_2"]
    for prompt, out in zip(prompts, outs, strict=True):
        single = gen(server, greedy_body(prompt, 20))[1]
        assert out["output_ids"] == single["output_ids"]
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
    # Per-item sampling params and rid list.
    status, outs = gen(
        server,
        {
            "input_ids": prompts[:2],
            "sampling_params": [
                {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True},
                {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
            ],
            "rid": ["x", "y"],
        },
    )
    assert status == 200
    assert [len(o["output_ids"]) for o in outs] == [3, 5]
    assert [o["meta_info"]["id"] for o in outs] == ["x", "y"]


# ------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("body", "shape", "needle"),
    [
        ({"input_ids": [1, 2], "sampling_params": {"seed": 1}}, str, "unknown field `seed`"),
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 100.0}},
            str,
            "invalid type: floating point `100.0`, expected i64",
        ),
        ({"input_ids": [1, 2.0]}, str, "expected i64"),
        ({"input_ids": []}, dict, "input_ids cannot be empty"),
        ({"input_ids": [[1, 2], []]}, dict, "input_ids cannot be empty"),
        ({"text": "hello"}, dict, "skip_tokenizer_init=True cannot accept text prompts"),
        ({"input_ids": [1] * CTX}, dict, "is longer than the model's context length"),
        (
            {"input_ids": [1] * 200, "sampling_params": {"max_new_tokens": 100}},
            dict,
            "exceeds the model's maximum context length",
        ),
        ({"input_ids": [1, 720]}, dict, "out of the vocabulary"),
        ({"input_ids": [1, -1]}, dict, "out of the vocabulary"),
        ({"input_ids": [1], "sampling_params": {"stop": ["x"]}}, dict, "skip_tokenizer_init"),
        ({"input_ids": [1], "sampling_params": {"stop_regex": "x"}}, dict, "skip_tokenizer_init"),
        ({"input_ids": [1], "sampling_params": {"min_new_tokens": 2}}, dict, "skip_tokenizer_init"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, dict, "top_p"),
        ({"input_ids": [1], "sampling_params": {"n": 2}}, dict, "not supported"),
    ],
)
def test_generate_400s(server, body, shape, needle):
    status, out = gen(server, body)
    assert status == 400, out
    assert isinstance(out["error"], shape)
    message = out["error"] if shape is str else out["error"]["message"]
    assert needle in message


def test_non_json_body_is_400(server):
    status, out = call(server.url + "/generate", raw=b"{not json", key=KEY)
    assert status == 400 and out["object"] == "error" and out["code"] == 400


def test_prompt_plus_max_new_equal_to_context_is_clamped(server):
    body = {"input_ids": [20] * 250, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}}
    body["sampling_params"]["temperature"] = 0
    status, out = gen(server, body)
    assert status == 200
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_api_key(server):
    status, out = call(server.url + "/generate", greedy_body([1, 2]))
    assert (status, out) == (401, {"error": "Unauthorized"})
    assert call(server.url + "/generate", greedy_body([1, 2]), key="wrong")[0] == 401
    assert call(server.url + "/model_info")[0] == 401
    assert call(server.url + "/server_info", key="wrong")[0] == 401
    assert call(server.url + "/health")[0] == 200
    assert call(server.url + "/ready")[0] == 200
    assert call(server.url + "/metrics")[0] == 200


def test_metrics_counts(server):
    def counter(name):
        text = call(server.url + "/metrics")[1]
        line = next(x for x in text.splitlines() if x.startswith(f"sglang:{name}{{"))
        assert 'model_name="tiny"' in line
        return float(line.rsplit(" ", 1)[1])

    before_req, before_gen = counter("num_requests_total"), counter("generation_tokens_total")
    body = greedy_body(PROMPTS[2], 7)
    body["sampling_params"]["ignore_eos"] = True
    assert gen(server, body)[0] == 200
    assert counter("num_requests_total") == before_req + 1
    assert counter("generation_tokens_total") == before_gen + 7


# ------------------------------------------------------------------------- batching, sampling


def _concurrently(fn, items):
    results = [None] * len(items)

    def run(i):
        results[i] = fn(items[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def test_concurrent_equals_sequential_greedy(server):
    # Long outputs (ignore_eos) on random prompts, natural stops on chat prompts.
    items = [(p, True) for p in PROMPTS[:12]] + [(chat_prompt(q), False) for q in QUESTIONS]

    def one(item):
        status, out = gen(server, greedy_body(item[0], 48, ignore_eos=item[1]))
        assert status == 200
        return out["output_ids"]

    sequential = [one(item) for item in items]
    concurrent = _concurrently(one, items)
    assert concurrent == sequential
    params = [greedy_body(p, 48, ignore_eos=e)["sampling_params"] for p, e in items]
    status, batch = gen(server, {"input_ids": [p for p, _ in items], "sampling_params": params})
    assert status == 200
    assert [o["output_ids"] for o in batch] == sequential
    assert len({tuple(s) for s in sequential}) > 8  # the prompts really differ
    assert sum(s[-1] == EOS for s in sequential) >= 2  # some stopped naturally
    # The server really ran them together.
    assert any(_running(line) > 4 for line in server.stderr)


def _running(line: str) -> int:
    if "#running-req: " not in line:
        return 0
    return int(line.split("#running-req: ")[1].split(",")[0])


def test_sampling_seed_reproducible(server):
    def sample(seed):
        sp = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 24}
        sp["ignore_eos"] = True
        if seed is not None:
            sp["sampling_seed"] = seed
        status, out = gen(server, {"input_ids": PROMPTS[4], "sampling_params": sp})
        assert status == 200
        return out["output_ids"]

    a = _concurrently(sample, [1, 2, 1, 3, None, None])
    assert a[0] == a[2]
    assert a[4] == a[5] == sample(42)  # unset means 42 under --enable-deterministic-inference
    assert len({tuple(x) for x in a}) >= 3
    greedy = gen(server, greedy_body(PROMPTS[4], 24) | {})[1]["output_ids"]
    assert greedy != a[0] or greedy != a[1]


def test_penalties_change_output(server):
    body = greedy_body(PROMPTS[6], 30)
    body["sampling_params"]["ignore_eos"] = True
    base = gen(server, body)[1]["output_ids"]
    body["sampling_params"]["repetition_penalty"] = 2.0
    body["sampling_params"]["frequency_penalty"] = 2.0
    penalized = gen(server, body)[1]["output_ids"]
    assert len(penalized) == 30
    assert len(set(penalized)) >= len(set(base))


def test_stream_cumulative(server):
    body = greedy_body(PROMPTS[7], 6)
    body["sampling_params"]["ignore_eos"] = True
    body["stream"] = True
    req = urllib.request.Request(server.url + "/generate", data=json.dumps(body).encode())
    req.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in resp.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    final = chunks[-1]["output_ids"]
    # Cumulative: every chunk is a prefix of the final output. Like SGLang, a consumer that
    # falls behind gets the latest state, not every intermediate one, so on a loaded machine
    # chunks may skip lengths.
    lengths = [len(c["output_ids"]) for c in chunks]
    assert lengths == sorted(lengths) and lengths[0] >= 1 and lengths[-1] == 6, lengths
    assert all(final[: len(c["output_ids"])] == c["output_ids"] for c in chunks)
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    del body["stream"]
    assert gen(server, body)[1]["output_ids"] == chunks[-1]["output_ids"]


def test_abort_all_returns_200_with_partial_outputs(server):
    sp = {"temperature": 0, "max_new_tokens": 240, "ignore_eos": True}
    body = {"input_ids": [PROMPTS[i % 16][:10] for i in range(24)], "sampling_params": sp}
    body["rid"] = "ab"
    result = {}
    t = threading.Thread(target=lambda: result.update(r=gen(server, body)))
    t.start()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and "r" not in result:
        text = call(server.url + "/metrics")[1]
        if 'sglang:num_running_reqs{model_name="tiny"} 0.0' not in text:
            break
        time.sleep(0.01)
    assert call(server.url + "/abort_request", {"abort_all": True}, key=KEY)[0] == 200
    t.join(timeout=30)
    status, outs = result["r"]
    assert status == 200
    aborted = [o for o in outs if o["meta_info"]["finish_reason"]["type"] == "abort"]
    assert aborted, "abort came too late: every request had finished"
    for o in aborted:
        assert len(o["output_ids"]) < 240
        assert o["meta_info"]["finish_reason"]["message"] in ("Aborted", "Abort in waiting queue")


# ---------------------------------------------------------------------- restart, text, SIGTERM


def test_restart_determinism_text_mode_and_sigterm(server):
    prompts = PROMPTS + [chat_prompt(q) for q in QUESTIONS]
    expected = [gen(server, greedy_body(p, 48, True))[1]["output_ids"] for p in prompts]
    # A fresh process, one request at a time, tokenizer loaded: the same ids byte for byte.
    other = Server("--max-running-requests", "1", skip_tokenizer_init=False)
    try:
        got = _concurrently(
            lambda p: call(other.url + "/generate", greedy_body(p, 48, True))[1], prompts
        )
        assert [o["output_ids"] for o in got] == expected
        assert all(isinstance(o["text"], str) for o in got)
        assert list(got[0]) == ["text", "output_ids", "meta_info"]
        status, out = call(
            other.url + "/generate",
            {"text": "What is 2 plus 2?", "sampling_params": {"temperature": 0}},
        )
        assert status == 200 and out["meta_info"]["prompt_tokens"] > 0
        assert call(other.url + "/model_info")[0] == 200  # no --api-key: open
    finally:
        took = other.stop()
    assert other.proc.returncode == 0
    assert took < 2.0, f"SIGTERM shutdown took {took:.2f}s"
    assert any("Shutting down" in line for line in other.stderr)
