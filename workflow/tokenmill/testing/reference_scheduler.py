"""The reference engine's scheduler and model: a transformers causal LM on CPU, continuous
batching over batch-1 forward passes, SGLang's sampling semantics. The HTTP side (routes,
request validation, the command line) is tokenmill.testing.reference_api.

Batching and determinism: a scheduler coroutine admits waiting requests (up to
--max-running-requests) into a running set and drives one decode loop on a single worker
thread; every loop step advances every running request by one token, finished requests leave and
new ones join between steps (continuous batching, per-row stop / max_new_tokens / sampling).
Each row runs its own batch-1 forward with its own KV cache. We do not stack rows into one padded
matrix: CPU GEMM kernels and attention reductions change their summation order with the batch
size and padding, so a padded batch can flip a greedy argmax and a prompt would not give the same
output_ids alone and in company. Batch-1 rows make every row's logits independent of what else is
running (byte-identical outputs, tested), at the price of per-row Python overhead. Measured on
the tiny model: a left-padded batch of 16 prompts gave last-token logits differing from the
batch-1 ones in 15 of 16 rows (up to 9e-6); batch-1 rows decode ~1200 tokens/s on a busy 2-core
machine, so 150 prompts x 256 forced tokens take ~32 s and the real demo (stops early) < 1 s.

Sampling: temperature < 1e-6 is greedy (argmax, first index on ties); otherwise temperature,
top_k, top_p, min_p with torch.multinomial. Penalties: repetition_penalty (prompt + output
tokens, HF style), frequency_penalty and presence_penalty (output tokens), logit_bias. With
--enable-deterministic-inference each request samples from its own generator seeded with
sampling_seed (42 when unset, as SGLang); otherwise all requests draw from one generator seeded
with --random-seed. Not supported (400 saying so): n > 1, beam search, grammars (json_schema,
regex, ebnf, structural_tag), return_logprob, custom logit processors. Streaming (`stream: true`)
is supported, cumulative (SGLang's default). cached_tokens is always null: there is no prefix
cache, so its hit rate is unknown (0 would claim a cache that never hit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import tokenmill

log = logging.getLogger("tokenmill.reference")

ENGINE = "tokenmill-reference"


class QueueFull(Exception):
    """More waiting requests than --max-queued-requests allows (HTTP 503)."""


@dataclass
class Sampling:
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    logit_bias: dict | None = None
    sampling_seed: int | None = None
    stream_interval: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6 or self.top_k == 1


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    sp: Sampling
    max_new: int
    stop_ids: frozenset
    stream: bool = False
    index: int = 0
    return_prompt_token_ids: bool = False
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict | None = None
    aborted: bool = False
    queued_abort: bool = False
    state: str = "waiting"
    done: asyncio.Event | None = None
    updated: asyncio.Event | None = None
    text_stop: tuple | None = None  # (match_start, match_end) in decoded text


class Row:
    """Per-request decode state, touched only by the worker thread while running."""

    def __init__(self, req: Req):
        self.req = req
        self.cache = None
        self.logits = None
        self.pos = 0
        self.counts = None  # output token counts, for frequency/presence penalties
        self.seen = None  # prompt+output tokens, for repetition_penalty
        self.generator = None
        self.done = False
        self.sent = 0  # tokens already streamed


class Engine:
    def __init__(self, args):
        self.args = args
        self.model = None
        self.tokenizer = None
        self.loaded = False
        self.stopping = False
        self.waiting: deque[Req] = deque()
        self.running: list[Row] = []
        self.by_rid: dict[str, list[Req]] = {}
        self.wakeup: asyncio.Event | None = None
        self.has_waiting = threading.Event()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ref-worker")
        self.startup_time = time.time()
        self.metrics = {
            "num_requests_total": 0,
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
            "cached_tokens_total": 0,
            "num_aborted_requests_total": 0,
        }
        self.last_gen_throughput = 0.0
        self.eos_ids: frozenset = frozenset()
        self.vocab_size = 0
        self.context_length = 0
        self.generator = None

    # ---- loading (worker thread) ----
    def load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.set_num_threads(self.args.cpu_threads)
        path = self.args.model_path
        config = AutoConfig.from_pretrained(path, trust_remote_code=self.args.trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=self.args.trust_remote_code
        )
        self.model = model.eval()
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        eos = set(_as_ids(getattr(config, "eos_token_id", None)))
        gen_cfg = Path(path) / "generation_config.json"
        if gen_cfg.is_file():
            eos |= set(_as_ids(json.loads(gen_cfg.read_text()).get("eos_token_id")))
        self.eos_ids = frozenset(eos)
        self.context_length = self.args.context_length or _config_context_length(config)
        if not self.args.skip_tokenizer_init:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(
                self.args.tokenizer_path or path, trust_remote_code=self.args.trust_remote_code
            )
        self.generator = torch.Generator().manual_seed(self.args.random_seed)

    # ---- request building (event loop) ----

    # ---- scheduling (event loop) ----
    def submit(self, reqs: list[Req]) -> None:
        limit = self.args.max_queued_requests
        if limit is not None and len(self.waiting) + len(reqs) > limit:
            raise QueueFull("The request queue is full.")
        for r in reqs:
            r.done = asyncio.Event()
            r.updated = asyncio.Event()
            self.by_rid.setdefault(r.rid, []).append(r)
            self.waiting.append(r)
            self.metrics["num_requests_total"] += 1
            self.metrics["prompt_tokens_total"] += len(r.input_ids)
        self.has_waiting.set()
        self.wakeup.set()

    def abort(self, rid: str | None = None, all_: bool = False) -> int:
        targets = [r for rs in self.by_rid.values() for r in rs] if all_ else self.by_rid.get(rid)
        count = 0
        for r in list(targets or []):
            if r.state == "waiting":
                with contextlib.suppress(ValueError):
                    self.waiting.remove(r)
                r.queued_abort = True
                r.finish_reason = {"type": "abort", "message": "Abort in waiting queue"}
                self._finish(r)
            elif r.state == "running":
                r.aborted = True  # the worker notices at its next step
            count += 1
        self.has_waiting.set()
        return count

    def _finish(self, r: Req) -> None:
        r.state = "done"
        if r.finish_reason and r.finish_reason.get("type") == "abort":
            self.metrics["num_aborted_requests_total"] += 1
        self.metrics["generation_tokens_total"] += len(r.output_ids)
        rs = self.by_rid.get(r.rid, [])
        if r in rs:
            rs.remove(r)
        if not rs:
            self.by_rid.pop(r.rid, None)
        r.done.set()
        r.updated.set()

    async def scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping:
            while self.waiting and len(self.running) < self.args.max_running_requests:
                req = self.waiting.popleft()
                req.state = "running"
                self.running.append(Row(req))
            if not self.running:
                self.wakeup.clear()
                if not self.waiting:
                    await self.wakeup.wait()
                continue
            self.has_waiting.clear()
            rows = list(self.running)
            steps = 1 if any(r.req.stream for r in rows) else 64
            t0 = time.monotonic()
            try:
                made = await loop.run_in_executor(self.executor, self._run_steps, rows, steps)
            except Exception:
                log.exception("decode loop failed; aborting the running batch")
                for row in rows:
                    row.done = True
                    row.req.finish_reason = _abort_reason("Internal error in reference engine")
                made = 0
            dt = time.monotonic() - t0
            if made and dt > 0:
                self.last_gen_throughput = made / dt
            log.debug(
                "Decode batch. #running-req: %d, #queue-req: %d, #new-token: %d, "
                "gen throughput (token/s): %.1f",
                len(rows),
                len(self.waiting),
                made,
                self.last_gen_throughput,
            )
            for row in rows:
                if row.done:
                    self.running.remove(row)
                    self._finish(row.req)
                elif row.req.stream:
                    n = len(row.req.output_ids)
                    interval = row.req.sp.stream_interval or self.args.stream_interval
                    if n - row.sent >= interval or (n and not row.sent):
                        row.sent = n
                        row.req.updated.set()
        for row in self.running:  # stopped: whatever is left ends as aborted
            if row.req.finish_reason is None:
                row.req.finish_reason = _abort_reason("Aborted")
            self._finish(row.req)
        self.running.clear()

    # ---- decode loop (worker thread) ----
    def _run_steps(self, rows: list[Row], max_steps: int) -> int:
        import torch

        made = 0
        with torch.inference_mode():
            for _ in range(max_steps):
                any_done = False
                for row in rows:
                    if row.done:
                        continue
                    self._step(row)
                    made += 1
                    any_done |= row.done
                if any_done or self.stopping or self.has_waiting.is_set():
                    break
        return made

    def _step(self, row: Row) -> None:
        import torch

        req = row.req
        if req.aborted or self.stopping:
            row.done = True
            req.finish_reason = _abort_reason("Aborted")
            return
        if req.max_new == 0:
            row.done = True
            req.finish_reason = {"type": "length", "length": 0}
            return
        if row.logits is None:
            self._prefill(row)
        token = self._sample(row)
        req.output_ids.append(token)
        if row.counts is not None:
            row.counts[token] += 1
        if row.seen is not None:
            row.seen[token] = True
        n = len(req.output_ids)
        if token in req.stop_ids and n >= req.sp.min_new_tokens:
            req.finish_reason = {"type": "stop", "matched": token}
        elif self._text_stop(req):
            pass
        elif n >= req.max_new:
            req.finish_reason = {"type": "length", "length": req.max_new}
        if req.finish_reason is not None:
            row.done = True
            return
        row.logits = self._forward(row, torch.tensor([[token]]))

    def _prefill(self, row: Row) -> None:
        import torch
        from transformers import DynamicCache

        sp = row.req.sp
        row.cache = DynamicCache(config=self.model.config)
        if sp.frequency_penalty or sp.presence_penalty:
            row.counts = torch.zeros(self.vocab_size)
        if sp.repetition_penalty != 1.0:
            row.seen = torch.zeros(self.vocab_size, dtype=torch.bool)
            row.seen[torch.tensor(row.req.input_ids)] = True
        if not sp.greedy:
            if self.args.enable_deterministic_inference:
                seed = 42 if sp.sampling_seed is None else sp.sampling_seed
                row.generator = torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)
            else:
                row.generator = self.generator
        row.logits = self._forward(row, torch.tensor([row.req.input_ids]))

    def _forward(self, row: Row, ids):
        import torch

        n = ids.shape[1]
        positions = torch.arange(row.pos, row.pos + n)
        out = self.model(
            input_ids=ids,
            past_key_values=row.cache,
            position_ids=positions.unsqueeze(0),
            cache_position=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        row.pos += n
        return out.logits[0, -1].float()

    def _sample(self, row: Row) -> int:
        import torch

        sp = row.req.sp
        logits = row.logits
        if row.seen is not None:
            pen = sp.repetition_penalty
            picked = logits[row.seen]
            logits = logits.clone()
            logits[row.seen] = torch.where(picked > 0, picked / pen, picked * pen)
        if row.counts is not None:
            logits = (
                logits
                - sp.frequency_penalty * row.counts
                - sp.presence_penalty * (row.counts > 0).float()
            )
        if sp.logit_bias:
            logits = logits.clone()
            for k, v in sp.logit_bias.items():
                logits[int(k)] += float(v)
        if row.req.stop_ids and len(row.req.output_ids) < sp.min_new_tokens:
            logits = logits.clone()
            logits[list(row.req.stop_ids)] = float("-inf")
        if sp.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / sp.temperature, dim=-1)
        if 0 < sp.top_k < probs.shape[0]:
            kth = torch.topk(probs, sp.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if sp.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            sorted_p[(cum - sorted_p) > sp.top_p] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        if sp.min_p > 0.0:
            probs = torch.where(probs >= sp.min_p * probs.max(), probs, torch.zeros_like(probs))
        return int(torch.multinomial(probs / probs.sum(), 1, generator=row.generator))

    def _text_stop(self, req: Req) -> bool:
        sp = req.sp
        if self.tokenizer is None or not (sp.stop or sp.stop_regex):
            return False
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=sp.skip_special_tokens)
        hits = []
        for s in sp.stop:
            i = text.find(s)
            if i >= 0:
                hits.append((i, i + len(s), s))
        for p in sp.stop_regex:
            m = re.search(p, text)
            if m:
                hits.append((m.start(), m.end(), p))
        if not hits:
            return False
        start, end, matched = min(hits)
        req.text_stop = (start, end)
        req.finish_reason = {"type": "stop", "matched": matched}
        return True

    # ---- responses ----
    def result(self, r: Req) -> dict:
        out = {}
        if self.tokenizer is not None:
            out["text"] = self._text(r)
        out["output_ids"] = list(r.output_ids)
        if r.return_prompt_token_ids:
            out["prompt_token_ids"] = list(r.input_ids)
        e2e = round(time.monotonic() - r.created, 6)
        if r.queued_abort:
            out["meta_info"] = {
                "id": r.rid,
                "finish_reason": r.finish_reason,
                "weight_version": self.args.weight_version,
                "e2e_latency": e2e,
                "completion_tokens": 0,
            }
            return out
        meta = {
            "id": r.rid,
            "finish_reason": r.finish_reason,
            "prompt_tokens": len(r.input_ids),
            "weight_version": self.args.weight_version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(r.output_ids),
            "cached_tokens": None,  # no prefix cache: its hit rate is unknown, not 0
            "cached_tokens_details": None,
        }
        if r.finish_reason is not None:
            meta["e2e_latency"] = e2e
        meta["response_sent_to_client_ts"] = time.time()
        out["meta_info"] = meta
        return out

    def _text(self, r: Req) -> str:
        sp = r.sp
        ids = r.output_ids
        fr = r.finish_reason or {}
        if isinstance(fr.get("matched"), int) and not sp.no_stop_trim and ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(
            ids,
            skip_special_tokens=sp.skip_special_tokens,
            spaces_between_special_tokens=sp.spaces_between_special_tokens,
        )
        if r.text_stop is not None:
            text = text[: r.text_stop[1] if sp.no_stop_trim else r.text_stop[0]]
        return text

    def model_info(self) -> dict:
        cfg = self.model.config if self.model is not None else None
        return {
            "model_path": self.args.model_path,
            "served_model_name": self.args.served_model_name,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True,
            "preferred_sampling_params": self.args.preferred_sampling_params,
            "weight_version": self.args.weight_version,
            "load_format": "auto",
            "reasoning_parser": self.args.reasoning_parser,
            "tool_call_parser": self.args.tool_call_parser,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(cfg, "model_type", None),
            "architectures": getattr(cfg, "architectures", None),
        }

    def server_info(self) -> dict:
        info = {k: v for k, v in vars(self.args).items() if not k.startswith("_")}
        info["context_length"] = self.context_length
        info["launch_command"] = self.args._launch_command
        info["max_total_num_tokens"] = self.context_length * self.args.max_running_requests
        info["max_req_input_len"] = self.context_length - 1
        info["status"] = "ready" if self.loaded else "starting"
        info["startup_time"] = self.startup_time
        info["kv_events"] = None
        info["internal_states"] = [
            {
                "last_gen_throughput": self.last_gen_throughput,
                "memory_usage": {},
                "effective_max_running_requests_per_dp": self.args.max_running_requests,
                "num_running_reqs": len(self.running),
                "num_queue_reqs": len(self.waiting),
            }
        ]
        info["version"] = f"{ENGINE}-{tokenmill.__version__}"
        info["engine"] = ENGINE
        info["frontend"] = "python"
        return info

    def metrics_text(self) -> str:
        name = self.args.served_model_name.replace('"', '\\"')
        label = f'{{model_name="{name}"}}'
        lines = []
        for name, value in self.metrics.items():
            lines += [f"# TYPE sglang:{name} counter", f"sglang:{name}{label} {float(value)}"]
        gauges = {
            "num_running_reqs": len(self.running),
            "num_queue_reqs": len(self.waiting),
            "gen_throughput": self.last_gen_throughput,
            "cache_hit_rate": 0.0,
            "token_usage": 0.0,
            "num_used_tokens": sum(len(r.req.input_ids) + r.pos for r in self.running),
        }
        for name, value in gauges.items():
            lines += [f"# TYPE sglang:{name} gauge", f"sglang:{name}{label} {float(value)}"]
        return "\n".join(lines) + "\n"


def _abort_reason(message: str) -> dict:
    return {"type": "abort", "message": message, "status_code": None, "err_type": None}


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _config_context_length(config) -> int:
    cfg = getattr(config, "text_config", None) or config
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048
