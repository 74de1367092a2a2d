"""asyncio client for an engine's token-IDs endpoint: one prompt per request, bounded concurrency.

The engine-specific part (request path and body, reading the answer, error bodies) is an
`EngineAPI` from tokenmill.engines (SGLang's /generate by default, vLLM's /v1/completions).

A fixed pool of worker coroutines (concurrency per server) pulls prompts from one queue; each
request goes to the server with the fewest requests in flight. Every finished prompt is handed
to `on_record` at once (the journal), so nothing paid for is lost.

Request ids are `{sample key}-{process nonce}-{counter}`: unique across processes, jobs and
attempts (SGLang refuses a rid that is still in flight: two jobs with the same prompts against
one server, or a resumed job whose killed predecessor left requests in flight).

What each answer becomes (status of the record handed to on_record; reason in REASONS):

    200                          "ok"
    200 with an abort finish     retried
    400 blaming the prompt       "rejected" (engine_rejected): too long for the context, ...
    other 400                    retried (a duplicate request id, a value some version
                                 refuses); exhausted: the job fails with the server's message
    5xx, 408, 429, a timeout     retried; exhausted: "error" (engine_error) with the last error
    connection reset/closed      retried; exhausted: "error" (engine_error) when the server's
                                 health check still passes (a prompt that breaks the
                                 connection, as one that crashes a scheduler worker does),
                                 else the job fails (engine unreachable)
    connection refused           retried; exhausted: the job fails (a dead or unreachable
                                 engine is not a property of the prompt)
    401, 403, 404, ...           the job fails at once (configuration)

Retries use capped exponential backoff with full jitter, `max_attempts` per prompt. Two guards
keep a systemic failure from hiding behind per-prompt handling:

- fail fast: when the first `fail_fast_after` failed attempts of a run, before any success,
  all got the same deterministic answer (HTTP 500/501/505+, or a 400 that does not blame the
  prompt) with the same message, from as many different prompts as can be in flight (up to
  `fail_fast_after`, at least two), the run stops (FailFast): the server
  refuses the request's shape, and retrying every prompt would only waste hours;
- rejection share (RejectionGuard): when rejected + errored prompts, `reject_min_count` or
  more, are more than chance at `reject_max_fraction` can explain (guards.shard_over_limit),
  early over the prompts started or at the shard's end, or when a shard ends with nothing
  generated and two or more refused, the run stops (TooManyRejections, a deterministic failure:
  the job harness refuses a retry with the same config, so nothing is sent twice). The caller
  does not journal those rejections, so a corrected config or server (or deleting the failure
  record) asks for them again; the category's share is judged once all its shards are in
  (dataset/verdict.py).

When the managed engine dies (`alive()` turns false) the run stops with EngineDied without
spending attempts, so the caller can restart the engine.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import json
import logging
import random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from tokenmill import guards
from tokenmill.engines import EngineAPI, SGLangAPI
from tokenmill.engines.base import DUPLICATE_RID
from tokenmill.settings import GenerationSettings, as_section, load_section

log = logging.getLogger(__name__)


# Record statuses -> reject reason codes of the generate stage (the stage's own pre-request
# reason is empty_prompt). README "Rejected rows" lists them.
OK, REJECTED, ERROR = "ok", "rejected", "error"
REASONS = {REJECTED: "engine_rejected", ERROR: "engine_error"}

# One per process: request ids never repeat across processes, jobs or restarts.
NONCE = secrets.token_hex(4)
_RID_COUNTER = itertools.count(1)

# 5xx answers that mean "busy or restarting", not "this request is wrong": never a fail-fast.
_TRANSIENT_5XX = (502, 503, 504)


class GenerationFailed(RuntimeError):
    pass


class EngineDied(RuntimeError):
    pass


class FailFast(GenerationFailed):
    """The first requests of a run all failed with the same deterministic error."""


class RunStopped(GenerationFailed):
    """Another job of the run failed for a reason every shard shares (its fail-fast)."""


class TooManyRejections(GenerationFailed):
    """The share of refused prompts says the config or the server is wrong, not the prompts."""


class _Retryable(Exception):
    def __init__(
        self, msg: str, kind: str = "server", signature: tuple | None = None, url: str = ""
    ):
        super().__init__(msg)
        # kind: "server" (the server answered, or timed out: exhausted -> engine_error row),
        # "reset" (connected, then the connection broke: exhausted -> engine_error row if the
        # server is healthy, else the job fails), "connection" (no connection: exhausted -> the
        # job fails), "request" (a 400 not blaming the prompt: exhausted -> the job fails).
        # signature: (status, message) when deterministic.
        self.kind = kind
        self.signature = signature
        self.url = url


class _Fatal(Exception):
    pass


def new_rid(key: str) -> str:
    return f"{key}-{NONCE}-{next(_RID_COUNTER)}"


@dataclass
class Item:
    prompt_id: str
    key: str
    prompt_ids: list[int]
    seed: int | None = None

    def ids(self) -> np.ndarray:
        """The prompt ids as an array (what ordering reads; the request takes prompt_ids)."""
        return np.asarray(self.prompt_ids, dtype=np.int64)

    def window(self) -> int:
        """The window of the queue this item is ordered within (prefix_reuse.dispatch_order):
        one for items held in memory; a shard's items, per cached row groups."""
        return 0


@dataclass
class Stats:
    total: int = 0
    done: int = 0
    requested: int = 0
    retries: int = 0
    rejected: int = 0
    errors: int = 0
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
            f"rejected={self.rejected} errors={self.errors}"
        )


@dataclass
class ClientOptions:
    """What the client needs from generation settings (no defaults here: the schema has them;
    `with_defaults` builds the schema's for tests and benchmarks)."""

    sampling: dict
    stop_token_ids: list[int]
    concurrency: int
    request_timeout_s: float
    max_attempts: int
    backoff_initial_s: float
    backoff_max_s: float
    progress_interval_s: float
    api_key: str | None
    fail_fast_after: int
    reject_max_fraction: float
    reject_min_count: int

    @classmethod
    def from_config(
        cls, gen: GenerationSettings | dict, stop_token_ids: list[int], api_key: str | None
    ):
        gen = as_section(gen, "generation")
        return cls(
            sampling=dict(gen.raw["sampling"]),
            stop_token_ids=list(stop_token_ids),
            concurrency=gen.concurrency,
            request_timeout_s=float(gen.request_timeout_s),
            max_attempts=gen.retry.max_attempts,
            backoff_initial_s=float(gen.retry.backoff_initial_s),
            backoff_max_s=float(gen.retry.backoff_max_s),
            progress_interval_s=float(gen.progress_interval_s),
            api_key=api_key,
            fail_fast_after=gen.retry.fail_fast_after,
            reject_max_fraction=float(gen.reject_limit.max_fraction),
            reject_min_count=gen.reject_limit.min_count,
        )

    @classmethod
    def with_defaults(cls, sampling: dict, stop_token_ids: list[int], **overrides):
        """The options of a generation section holding only `sampling` (the schema's defaults
        for everything else), with `overrides` (field names) laid over them."""
        gen = load_section({"sampling": sampling}, "generation")
        return dataclasses.replace(cls.from_config(gen, stop_token_ids, None), **overrides)


LIMIT_KEY = guards.limit_key("generate")


# One-sided z of the early rejection check: a shard stops before its end only when even the
# Wilson lower bound of its refusal rate at this z (p ~ 3e-7) is over the limit.
def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class RejectionGuard:
    """Counts the prompts of a shard (across engine restarts) and stops a run whose refusals
    are systemic. `ok_before`: successes of the shard already in the journal.

    A shard's share is a sample of its category's, so it is judged by the rule of every
    shard's guard (guards.shard_over_limit): it trips only on refusals that chance cannot
    explain at the limit, early over the prompts started so far (prompts in flight count as
    not refused, so answers that come back sooner than others cannot inflate the share) or at
    the end over the shard. Anything else is the category's verdict, once every shard is in
    (dataset/verdict.py)."""

    def __init__(self, max_fraction: float, min_count: int, ok_before: int = 0):
        self.max_fraction = max_fraction
        self.min_count = min_count
        self.ok_before = ok_before
        self.started = 0  # prompts taken from the queue in this job (in flight included)
        self.ok = 0
        self.refused = 0  # rejected + errored
        self.first: list[str] = []  # the first messages, for the error
        # Once tripped, every worker raises this same error: another answer that lands before
        # the run is stopped must not replace the counts at the moment the limit was passed.
        self.tripped: TooManyRejections | None = None

    def add(self, rec: dict) -> None:
        if self.tripped is not None:
            raise self.tripped
        if rec["status"] == OK:
            self.ok += 1
            return
        self.refused += 1
        if len(self.first) < 5:
            self.first.append(f"{rec['prompt_id']}: {REASONS[rec['status']]}: {rec['message']}")
        self.check(final=False)

    def _why(self, final: bool) -> str | None:
        """Why the shard's refusals cannot be chance at the limit (None: they can be)."""
        lim, refused = self.max_fraction, self.refused
        if final:
            n, kept = self.ok + refused + self.ok_before, self.ok + self.ok_before
            if guards.shard_over_limit(n, refused, kept, self, key=LIMIT_KEY) is None:
                return None
            if kept == 0:
                return (
                    f"{refused} of {plural(n, 'prompt')} refused by the engine "
                    f"({refused / max(n, 1):.1%}: nothing in the shard was generated)"
                )
            so_far = ""
        else:
            n = self.started + self.ok_before
            if refused < self.min_count or guards.chance_at_limit(refused, n, lim) >= (
                guards.GUARD_ALPHA
            ):
                return None
            so_far = " of those started so far"
        return (
            f"{refused} of {plural(n, 'prompt')} refused by the engine ({refused / n:.1%}"
            f"{so_far}; a true {lim:.1%}, generation.reject_limit.max_fraction, gives that many "
            f"with a chance below {guards.GUARD_ALPHA:.0e})"
        )

    def check(self, final: bool) -> None:
        if self.max_fraction >= 1.0 or not self.refused:
            return
        why = self._why(final)
        if why is None:
            return
        self.tripped = TooManyRejections(
            f"{why}; {self.ok} generated in this job, {self.ok_before} from the journal: this "
            "looks like a config or server problem, not bad prompts. A retry with this config "
            "is refused (nothing is sent twice); the refusals are not journaled: a corrected "
            "config or server retries them. First messages:\n  " + "\n  ".join(self.first)
        )
        raise self.tripped

    def share_line(self) -> str:
        """The shard's refusal share so far, for the job's summary."""
        n = self.ok + self.refused + self.ok_before
        return f"{self.refused} of {plural(n, 'prompt')} refused ({self.refused / max(n, 1):.1%})"


class Client:
    def __init__(
        self,
        urls: list[str],
        opts: ClientOptions,
        on_record: Callable[[dict], None],
        alive: Callable[[], bool] | None = None,
        stats: Stats | None = None,
        api: EngineAPI | None = None,
        guard: RejectionGuard | None = None,
        follow: Callable[[dict], list[Item]] | None = None,
        stop_check: Callable[[], str | None] | None = None,
    ):
        if not urls:
            raise ValueError("no server URLs")
        self.urls = [u.rstrip("/") for u in urls]
        self.opts = opts
        self.on_record = on_record
        self.alive = alive
        self.stats = stats or Stats()
        self.guard = guard or RejectionGuard(opts.reject_max_fraction, opts.reject_min_count)
        # follow(record) -> the items that this answer makes possible (the next turn of a
        # conversation): queued at once, so a worker never waits while work is ready.
        self.follow = follow
        # stop_check() -> why the whole run stops (failure.RunStop), asked before each request
        self.stop_check = stop_check
        self._active = 0
        self._wakeup = asyncio.Event()
        self._queue: collections.deque | None = None
        # Fail fast: the signature every failure so far had, the prompts and attempts behind
        # it; disarmed for good by a success or by a different deterministic failure.
        self._ff_armed = True
        self._stopping = False  # set when the run fails fast (_fail_fast)
        self._ff_signature: tuple | None = None
        self._ff_prompts: list[str] = []
        self._ff_attempts = 0
        self._n_workers = 0
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._headers = {"Content-Type": "application/json"}
        if opts.api_key:
            self._headers["Authorization"] = f"Bearer {opts.api_key}"
        self.api = api or SGLangAPI()
        # Sampling params shared by every request; per-request fields are added to a copy.
        self.api.prepare(opts.sampling, opts.stop_token_ids)

    def _pick_url(self) -> str:
        return min(self.urls, key=self._in_flight.__getitem__)

    def _request(self, url: str, item: Item) -> tuple[str, bytes]:
        return self.api.build_request(url, item.prompt_ids, item.seed, new_rid(item.key))

    async def _once(self, session: aiohttp.ClientSession, item: Item, attempt: int):
        if self._stopping:  # the run failed fast: not one request more than its message says
            raise asyncio.CancelledError
        why = self.stop_check() if self.stop_check is not None else None
        if why:
            self._stopping = True
            raise RunStopped(f"{why}; stopped after {plural(self.stats.requested, 'request')}")
        url = self._pick_url()
        self._in_flight[url] += 1
        self.stats.in_flight += 1
        self.stats.requested += 1
        t0 = time.monotonic()
        path, body = self._request(url, item)
        try:
            async with session.post(url + path, data=body, headers=self._headers) as resp:
                raw = await resp.read()
                status = resp.status
        except TimeoutError as exc:  # the server took the request and never answered in time
            raise _Retryable(f"{url}: timeout after {self.opts.request_timeout_s}s {exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            msg = f"{url}: {type(exc).__name__}: {exc}"
            # Refused (nothing listens): the engine is down. Anything else (reset, closed
            # mid-answer): the server took the connection; maybe only this prompt breaks it.
            kind = "connection" if isinstance(exc, aiohttp.ClientConnectorError) else "reset"
            raise _Retryable(msg, kind=kind, url=url) from None
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
            if self.api.prompt_at_fault(msg):
                return REJECTED, {"message": msg, "server": url}
            duplicate = DUPLICATE_RID.search(msg)
            raise _Retryable(
                f"{url}: HTTP 400: {msg}",
                kind="request",
                signature=None if duplicate else (status, msg),
            )
        if status >= 500 or status in (408, 429):
            deterministic = status >= 500 and status not in _TRANSIENT_5XX
            sig = (status, msg) if deterministic else None
            raise _Retryable(f"{url}: HTTP {status}: {msg}", signature=sig)
        # 401/403/404/...: a configuration problem; retrying cannot help.
        raise _Fatal(f"{url}: HTTP {status}: {msg}")

    def _fail_fast(self, item: Item, exc: _Retryable) -> None:
        """Raise FailFast when the first failures of the run are all one deterministic error."""
        if not self._ff_armed or exc.signature is None:
            return
        if self._ff_signature is None:
            self._ff_signature = exc.signature
        elif exc.signature != self._ff_signature:
            self._ff_armed = False
            return
        self._ff_attempts += 1
        if item.prompt_id not in self._ff_prompts:
            self._ff_prompts.append(item.prompt_id)
        k = self.opts.fail_fast_after
        # From k different prompts, or from every prompt that can be in flight at once; never
        # from one prompt alone (a prompt that always fails is an engine_error row, not a job
        # that fails on every rerun).
        need = max(2, min(k, self._n_workers))
        if k <= 0 or self._ff_attempts < k or len(self._ff_prompts) < need:
            return
        status, msg = self._ff_signature
        sent = self.stats.requested
        self._stopping = True  # other workers may run before the main loop cancels them
        raise FailFast(
            f"none of the first {plural(sent, 'request')} of this job succeeded; the "
            f"{self._ff_attempts} answered (prompts {', '.join(self._ff_prompts[:5])}) all "
            f"failed with the same answer, HTTP {status}: {msg!r}. An error on every request "
            "means the server refuses the request's shape (for example a sampling key its "
            "version does not accept), not a busy server: stopping instead of retrying every prompt"
        )

    async def _process(self, session, item: Item) -> None:
        last = ""
        self.guard.started += 1
        for attempt in range(1, self.opts.max_attempts + 1):
            try:
                kind, res = await self._once(session, item, attempt)
            except _Retryable as exc:
                last = str(exc)
                if self.alive is not None and not self.alive():
                    raise EngineDied(f"engine died ({last})") from None
                self._fail_fast(item, exc)
                if attempt == self.opts.max_attempts:
                    if exc.kind == "server":  # the engine answers, just never this prompt
                        kind, res = ERROR, {"message": last}
                        break
                    if exc.kind == "reset" and await self._healthy(session, exc.url):
                        # The server stays up and answers its health check: this prompt
                        # breaks the connection (a scheduler worker it crashes, say).
                        last += f" (the server stays healthy: {self.api.health_path} answers)"
                        kind, res = ERROR, {"message": last}
                        break
                    what = "refused" if exc.kind == "request" else "engine unreachable"
                    raise GenerationFailed(
                        f"prompt {item.prompt_id} (sample {item.key}) failed after "
                        f"{self.opts.max_attempts} attempts ({what}); last error: {last}"
                    ) from None
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
            if kind == OK:
                self._ff_armed = False
            break
        rec = {"key": item.key, "status": kind, "prompt_id": item.prompt_id, **res}
        rec["attempts"] = attempt
        self.on_record(rec)
        if self.follow is not None:
            # A conversation's next turn goes first: its prompt extends the one just answered,
            # whose prefix the engine's cache holds now, not after the rest of the queue.
            nxt = list(self.follow(rec))
            self._queue.extendleft(reversed(nxt))
            self.stats.total += len(nxt)
        self.stats.done += 1
        if kind == OK:
            self.stats.output_tokens += len(res["output_ids"])
        elif kind == REJECTED:
            self.stats.rejected += 1
        else:
            self.stats.errors += 1
            log.warning("prompt %s: engine_error after %d attempts: %s", item.prompt_id,
                        attempt, last)  # fmt: skip
        self.guard.add(rec)

    async def _healthy(self, session, url: str) -> bool:
        """Does the server at `url` answer its health check with 200 now?"""
        if self.alive is not None and not self.alive():
            return False
        timeout = aiohttp.ClientTimeout(total=min(30.0, self.opts.request_timeout_s))
        try:
            async with session.get(
                url + self.api.health_path, headers=self._headers, timeout=timeout
            ) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def _worker(self, session, queue: collections.deque) -> None:
        while True:
            try:
                item = queue.popleft()
            except IndexError:
                # With follow-ups, an item still in process may queue more work.
                if self.follow is None or self._active == 0:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._active += 1
            try:
                await self._process(session, item)
            finally:
                self._active -= 1
                self._wakeup.set()

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
        queue = collections.deque(items)  # workers take from the left; follow-ups go there too
        self._queue = queue
        n_workers = min(len(items), self.opts.concurrency * len(self.urls))
        self._n_workers = n_workers
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
                        # A worker stopped by a fail-fast ends cancelled; the worker that
                        # failed fast holds the cause, in this batch or a later one.
                        if not t.cancelled() and t.exception() is not None:
                            raise t.exception()
            finally:
                for t in workers + helpers:
                    t.cancel()
                await asyncio.gather(*workers, *helpers, return_exceptions=True)
        log.info(self.stats.line())
        self.guard.check(final=True)
        if self.guard.refused:
            log.info(
                "%s; generation.reject_limit.max_fraction %.1f%%",
                self.guard.share_line(),
                100 * self.guard.max_fraction,
            )
        return self.stats
