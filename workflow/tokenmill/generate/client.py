"""asyncio client for an engine's token-IDs endpoint: one prompt per request, bounded concurrency.

The engine-specific part (request path and body, reading the answer, error bodies) is an
`EngineAPI` from tokenmill.generate.engines (SGLang's /generate by default, vLLM's /v1/completions).

A fixed pool of worker coroutines (concurrency per server) pulls prompts from one queue; each
request goes to the server with the fewest requests in flight. Every finished sample (or 400
rejection) is handed to `on_record` at once (the journal), so nothing paid for is lost.

Errors: connection errors, timeouts, 5xx and 429 are retried with capped exponential backoff
and full jitter; HTTP 400 rejects that one prompt with the server's message; HTTP 200 with an
abort finish reason is retried. When a prompt exhausts its attempts the run fails with
GenerationFailed naming it. When the managed engine dies (`alive()` turns false) the run stops
with EngineDied without spending attempts, so the caller can restart the engine.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from tokenmill.generate.engines import EngineAPI, SGLangAPI

log = logging.getLogger(__name__)


class GenerationFailed(RuntimeError):
    pass


class EngineDied(RuntimeError):
    pass


class _Retryable(Exception):
    pass


class _Fatal(Exception):
    pass


@dataclass
class Item:
    prompt_id: str
    key: str
    prompt_ids: list[int]
    seed: int | None = None


@dataclass
class Stats:
    total: int = 0
    done: int = 0
    requested: int = 0
    retries: int = 0
    rejected: int = 0
    output_tokens: int = 0
    in_flight: int = 0
    started: float = field(default_factory=time.monotonic)

    def line(self) -> str:
        el = max(time.monotonic() - self.started, 1e-9)
        rps, tps = self.done / el, self.output_tokens / el
        left = self.total - self.done
        eta = f"{left / rps:.0f}s" if rps > 0 else "?"
        return (
            f"progress {self.done}/{self.total} req/s={rps:.2f} out_tok/s={tps:.1f} "
            f"eta={eta} in_flight={self.in_flight} retries={self.retries} "
            f"rejected={self.rejected}"
        )


@dataclass
class ClientOptions:
    sampling: dict
    stop_token_ids: list[int]
    concurrency: int = 64
    request_timeout_s: float = 3600.0
    max_attempts: int = 8
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    progress_interval_s: float = 30.0
    api_key: str | None = None

    @classmethod
    def from_config(cls, gen: dict, stop_token_ids: list[int], api_key: str | None):
        retry = gen.get("retry") or {}
        return cls(
            sampling=dict(gen.get("sampling") or {}),
            stop_token_ids=list(stop_token_ids),
            concurrency=int(gen.get("concurrency", 64)),
            request_timeout_s=float(gen.get("request_timeout_s", 3600)),
            max_attempts=int(retry.get("max_attempts", 8)),
            backoff_initial_s=float(retry.get("backoff_initial_s", 1.0)),
            backoff_max_s=float(retry.get("backoff_max_s", 60.0)),
            progress_interval_s=float(gen.get("progress_interval_s", 30)),
            api_key=api_key,
        )


class Client:
    def __init__(
        self,
        urls: list[str],
        opts: ClientOptions,
        on_record: Callable[[dict], None],
        alive: Callable[[], bool] | None = None,
        stats: Stats | None = None,
        api: EngineAPI | None = None,
    ):
        if not urls:
            raise ValueError("no server URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.opts = opts
        self.on_record = on_record
        self.alive = alive
        self.stats = stats or Stats()
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._headers = {"Content-Type": "application/json"}
        if opts.api_key:
            self._headers["Authorization"] = f"Bearer {opts.api_key}"
        self.api = api or SGLangAPI()
        # Sampling params shared by every request; per-request fields are added to a copy.
        self.api.prepare(opts.sampling, opts.stop_token_ids)

    def _pick_url(self) -> str:
        return min(self.urls, key=self._in_flight.__getitem__)

    def _request(self, url: str, item: Item, attempt: int) -> tuple[str, bytes]:
        # rid: unique per attempt (SGLang rejects duplicate rids still in flight after a retry).
        return self.api.build_request(url, item.prompt_ids, item.seed, f"{item.key}-{attempt}")

    async def _once(self, session: aiohttp.ClientSession, item: Item, attempt: int):
        url = self._pick_url()
        self._in_flight[url] += 1
        self.stats.in_flight += 1
        self.stats.requested += 1
        t0 = time.monotonic()
        path, body = self._request(url, item, attempt)
        try:
            async with session.post(url + path, data=body, headers=self._headers) as resp:
                raw = await resp.read()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise _Retryable(f"{url}: {type(exc).__name__}: {exc}") from None
        finally:
            self._in_flight[url] -= 1
            self.stats.in_flight -= 1
        if status == 200:
            try:
                res = self.api.parse_response(json.loads(raw))
            except ValueError as exc:
                raise _Retryable(f"{url}: bad 200 response: {exc}") from None
            if res["finish_type"] == "abort":
                raise _Retryable(f"{url}: finish_reason abort: {res.get('finish_message')}")
            res["latency_s"] = res["latency_s"] or (time.monotonic() - t0)
            res["server"] = url
            return "ok", res
        msg = self.api.error_message(raw, status)
        if status == 400:
            return "rejected", {"message": msg, "server": url}
        if status >= 500 or status in (408, 429):
            raise _Retryable(f"{url}: HTTP {status}: {msg}")
        # 401/403/404/...: a configuration problem; retrying cannot help.
        raise _Fatal(f"{url}: HTTP {status}: {msg}")

    async def _process(self, session, item: Item) -> None:
        last = ""
        for attempt in range(1, self.opts.max_attempts + 1):
            try:
                kind, res = await self._once(session, item, attempt)
            except _Retryable as exc:
                last = str(exc)
                if self.alive is not None and not self.alive():
                    raise EngineDied(f"engine died ({last})") from None
                if attempt == self.opts.max_attempts:
                    break
                self.stats.retries += 1
                cap = min(self.opts.backoff_max_s, self.opts.backoff_initial_s * 2 ** (attempt - 1))
                log.warning(
                    "prompt %s attempt %d/%d failed: %s",
                    item.prompt_id,
                    attempt,
                    self.opts.max_attempts,
                    last,
                )
                await asyncio.sleep(random.uniform(0, cap))  # full jitter
                continue
            except _Fatal as exc:
                raise GenerationFailed(f"prompt {item.prompt_id}: {exc}") from None
            rec = {"key": item.key, "status": kind, "prompt_id": item.prompt_id, **res}
            rec["attempts"] = attempt
            self.on_record(rec)
            self.stats.done += 1
            if kind == "ok":
                self.stats.output_tokens += len(res["output_ids"])
            else:
                self.stats.rejected += 1
            return
        raise GenerationFailed(
            f"prompt {item.prompt_id} (sample {item.key}) failed after "
            f"{self.opts.max_attempts} attempts; last error: {last}"
        )

    async def _worker(self, session, queue: asyncio.Queue) -> None:
        while True:
            try:
                item = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await self._process(session, item)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            if self.alive is not None and not self.alive():
                raise EngineDied("engine process exited")

    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.opts.progress_interval_s)
            log.info(self.stats.line())

    async def run(self, items: list[Item]) -> Stats:
        """Generate every item; raises GenerationFailed or EngineDied (journaled work stays)."""
        self.stats.total = max(self.stats.total, self.stats.done + len(items))
        queue: asyncio.Queue = asyncio.Queue()
        for it in items:
            queue.put_nowait(it)
        n_workers = min(len(items), self.opts.concurrency * len(self.urls))
        conn = aiohttp.TCPConnector(
            limit=self.opts.concurrency * len(self.urls),
            limit_per_host=self.opts.concurrency,
            keepalive_timeout=self.api.client_keepalive_s,
        )
        timeout = aiohttp.ClientTimeout(total=self.opts.request_timeout_s)
        async with aiohttp.ClientSession(
            connector=conn,
            timeout=timeout,
            raise_for_status=False,
            skip_auto_headers=["User-Agent"],
        ) as session:
            workers = [asyncio.create_task(self._worker(session, queue)) for _ in range(n_workers)]
            helpers = [asyncio.create_task(self._progress())]
            if self.alive is not None:
                helpers.append(asyncio.create_task(self._watch()))
            try:
                pending = set(workers) | set(helpers)
                while any(not w.done() for w in workers):
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for t in done:
                        if t.exception() is not None:
                            raise t.exception()
            finally:
                for t in workers + helpers:
                    t.cancel()
                await asyncio.gather(*workers, *helpers, return_exceptions=True)
        log.info(self.stats.line())
        return self.stats
