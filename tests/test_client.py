"""Client against the fake SGLang server over real HTTP on 127.0.0.1: every error path."""

from __future__ import annotations

import asyncio
import json

import fake_sglang
import pytest
from tokenmill import sglang
from tokenmill.client import Client, ClientOptions, GenerationFailed, Item
from tokenmill.engine import free_port


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
