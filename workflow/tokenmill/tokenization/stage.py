"""`tokenmill tokenize`: one category's prompts -> tokenized shards (raw prompt token ids).

    tokenmill tokenize --prompts results/prompts/C.parquet --category C --shards N \\
        --tokenizer-config JSON_OR_FILE --max-prompt-tokens M --out-dir results/tokenized/C \\
        --rejected results/rejected/tokenize/C.parquet [--basedir .] [--workers K] [--processes P]
        [--stop-tokens '["<|im_end|>"]']

    prompt_ids = apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                     tokenize=True, **chat_template_kwargs)

With a fast tokenizer the same ids are computed by rendering the template to text
(tokenize=False) and batch-encoding the texts with `tokenizer(texts, add_special_tokens=False)`,
which is exactly what apply_chat_template does for one prompt, but lets the Rust encoder work
on a whole chunk in parallel. A slow tokenizer (Kimi's tiktoken one) takes the generic path:
apply_chat_template(tokenize=True) per prompt.

--workers K is the number of cores the stage may use. A fast tokenizer encodes in this process
with K Rust threads while a second thread shards and writes (measured on 2 cores: spreading a
fast tokenizer over processes is slower; rendering is ~10% of the work); a slow tokenizer gets
K processes, each encoding whole chunks. --processes P overrides that choice.

Streaming: the prompts file (sorted by prompt_id) is read by record batches; each shard's rows
arrive in prompt_id order and are cut into row groups by a rule that depends only on that
shard's own rows (contracts.row_group_ends: ROW_GROUP_SIZE rows or ROW_GROUP_TOKENS tokens), so
a prompt edited in one shard leaves every other shard byte-identical. Row groups are spilled to
a temporary Arrow IPC file per shard and copied into the final Parquet file at the end, because
the shard's counts (records_in / kept / rejected) go in its metadata, which is written when the
file is opened.
All N shard files are always written, empty ones too.

--stop-tokens (generation.stop_tokens) are resolved to ids with the loaded tokenizer and written
into every shard's metadata (tokenmill.stop_tokens / tokenmill.stop_token_ids): the generate job
reads them there instead of loading the tokenizer. A string that is not one token of this
tokenizer fails the stage, naming generation.stop_tokens.

Rejections (results/rejected/tokenize/C.parquet, stage "tokenize", prompt_id order):
invalid_record (messages/tools not JSON, or not a list of messages), template_error (the chat
template raised), encode_error, empty_prompt, too_long (never truncated), duplicate_prompt_id,
invalid_prompt_id (no shard can be computed; counted in the category totals only).

Vocabulary: with --model (generation.model) whose config.json is on this machine, a tokenizer
larger than the model's vocab_size, or any prompt id outside [0, vocab_size), fails the stage
naming both sizes: such an id would kill SGLang's scheduler at the first request.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import inspect
import itertools
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import contracts, guards
from tokenmill.contracts import (  # the shard metadata keys (generate/stage.py reads them here)
    META_MAX_PROMPT_TOKENS,
    META_NUM_SHARDS,
    META_STOP_TOKEN_IDS,
    META_STOP_TOKENS,
)
from tokenmill.settings import TokenizerSettings, as_section, load_section, thaw
from tokenmill.tokenization import shards

STAGE = "tokenize"
CHUNK_ROWS = 1024
# A shard's row group ends as contracts.row_group_ends says (ROW_GROUP_SIZE rows or
# ROW_GROUP_TOKENS tokens): bounds memory to about shards x 4 MiB of buffered ids for long prompts.
REJECTED_GROUP_ROWS = 1024
DETAIL_MAX_CHARS = 500

INVALID_RECORD = "invalid_record"
TEMPLATE_ERROR = "template_error"
ENCODE_ERROR = "encode_error"
EMPTY_PROMPT = "empty_prompt"
TOO_LONG = "too_long"
DUPLICATE_PROMPT_ID = "duplicate_prompt_id"
INVALID_PROMPT_ID = "invalid_prompt_id"
REASONS = (
    INVALID_RECORD,
    TEMPLATE_ERROR,
    ENCODE_ERROR,
    EMPTY_PROMPT,
    TOO_LONG,
    DUPLICATE_PROMPT_ID,
    INVALID_PROMPT_ID,
)


# apply_chat_template arguments the stage itself sets; chat_template_kwargs must not.
FIXED_ARGUMENTS = {"conversation", "tools", "add_generation_prompt", "tokenize", "return_dict"}


class TokenizeError(RuntimeError):
    """A problem that stops the whole category (unsorted input, bad arguments)."""


def _detail(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:DETAIL_MAX_CHARS]


# ---------------------------------------------------------------------------------------------
# Encoding: (messages JSON, tools JSON) rows -> token ids


@dataclass
class ChunkResult:
    """Token ids of a chunk, flat: row i owns flat[offsets[i]:offsets[i+1]]; errors by row."""

    flat: np.ndarray  # int32
    lengths: np.ndarray  # int64, 0 for rows in `errors`
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)


def _apply_chat_template_params() -> set[str]:
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return {name for name, p in params.items() if p.kind is not p.VAR_KEYWORD}


class Encoder:
    """Tokenizes prompt rows with one tokenizer and the configured chat_template_kwargs."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        fixed = set(self.kwargs) & FIXED_ARGUMENTS
        if fixed:
            raise TokenizeError(
                f"tokenizer.chat_template_kwargs may not set {sorted(fixed)}: the stage sets them"
            )
        # A kwarg that is one of apply_chat_template's own arguments (sanitize_control_tokens,
        # ...) changes how it tokenizes; only the generic path honours it exactly.
        clash = set(self.kwargs) & _apply_chat_template_params()
        self.fast = bool(getattr(tokenizer, "is_fast", False)) and not clash

    @staticmethod
    def _parse(messages_json, tools_json):
        messages = json.loads(messages_json)
        tools = json.loads(tools_json) if tools_json is not None else None
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages is not a non-empty list")
        if not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages holds something other than message objects")
        if tools is not None and not isinstance(tools, list):
            raise ValueError("tools is not a list")
        return messages, tools

    def encode(self, rows: list[tuple[str, str | None]]) -> ChunkResult:
        errors: dict[int, tuple[str, str]] = {}
        parsed: list[tuple[int, list, list | None]] = []
        for i, (messages_json, tools_json) in enumerate(rows):
            try:
                messages, tools = self._parse(messages_json, tools_json)
            except (ValueError, TypeError) as exc:
                errors[i] = (INVALID_RECORD, _detail(exc))
                continue
            parsed.append((i, messages, tools))
        encoded = (
            self._encode_fast(parsed, errors) if self.fast else self._encode_generic(parsed, errors)
        )
        lengths = np.zeros(len(rows), dtype=np.int64)
        for i, ids in encoded:
            lengths[i] = len(ids)
        flat = np.fromiter(
            itertools.chain.from_iterable(ids for _, ids in encoded),
            dtype=np.int32,
            count=int(lengths.sum()),
        )
        return ChunkResult(flat, lengths, errors)

    def _encode_fast(self, parsed, errors):
        tok = self.tokenizer
        texts, index = [], []
        for i, messages, tools in parsed:
            try:
                text = tok.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=False, **self.kwargs
                )
                if not isinstance(text, str):
                    raise TypeError(f"template rendered {type(text).__name__}, not text")
            except Exception as exc:  # noqa: BLE001 - any template failure rejects one prompt
                errors[i] = (TEMPLATE_ERROR, _detail(exc))
                continue
            texts.append(text)
            index.append(i)
        if not texts:
            return []
        try:
            ids = self._batch(texts)
        except Exception:  # noqa: BLE001 - isolate the prompt that breaks the batch
            ids = []
            for i, text in zip(index, texts, strict=True):
                try:
                    ids.append(self._batch([text])[0])
                except Exception as exc:  # noqa: BLE001
                    errors[i] = (ENCODE_ERROR, _detail(exc))
                    ids.append(None)
        return [(i, x) for i, x in zip(index, ids, strict=True) if x is not None]

    def _batch(self, texts: list[str]) -> list[list[int]]:
        # What apply_chat_template(tokenize=True) calls, on many texts at once.
        out = self.tokenizer(
            texts,
            add_special_tokens=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return out["input_ids"]

    def _encode_generic(self, parsed, errors):
        from tokenmill.tokenization.conversations import render

        out = []
        for i, messages, tools in parsed:
            try:
                ids = render(self.tokenizer, messages, tools, True, self.kwargs)
            except Exception as exc:  # noqa: BLE001 - any template failure rejects one prompt
                errors[i] = (TEMPLATE_ERROR, _detail(exc))
                continue
            out.append((i, ids))
        return out


# Worker processes (processes > 1) each hold their own tokenizer.
_WORKER_ENCODER: Encoder | None = None


def _init_worker(tok_raw: dict, basedir: str) -> None:
    global _WORKER_ENCODER
    # The parent's cores are shared between workers: no nested Rust thread pools.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenmill.tokenization.tokenizer import load_tokenizer

    tok = as_section(tok_raw, "tokenizer")
    _WORKER_ENCODER = Encoder(load_tokenizer(tok, basedir), thaw(tok.chat_template_kwargs))


def _worker_encode(rows):
    assert _WORKER_ENCODER is not None
    return _WORKER_ENCODER.encode(rows)


# ---------------------------------------------------------------------------------------------
# Shards: buffered rows -> row groups (a rule that depends on the shard's rows only) -> spill


@dataclass
class ShardCounts:
    """One shard's prompt rows, in = kept + rejected (a row without a shard, invalid_prompt_id,
    counts in the category's totals only), and the prompt tokens it keeps."""

    records_in: int = 0
    kept: int = 0
    rejected: int = 0
    tokens: int = 0

    def metadata(self, common_meta: dict, shard: int) -> dict:
        """The shard file's metadata: the category's, the shard and its counts."""
        name = shards.shard_name(shard)
        what = f"tokenize {common_meta[contracts.META_CATEGORY]}/{name}"
        return {
            **common_meta,
            contracts.META_SHARD: name,
            **contracts.count_metadata(self.records_in, self.kept, self.rejected, what=what),
            contracts.META_PROMPT_TOKENS: str(self.tokens),
        }


class ShardSpill(ShardCounts):
    """One shard's kept rows: buffered, cut into row groups, each spilled to an Arrow IPC file.

    One small file per row group, opened and closed at once: thousands of shards never hold
    thousands of open files.
    """

    def __init__(self, spill_dir: Path, shard: int, name: str | None = None):
        super().__init__()
        self._prefix = spill_dir / (name or shards.shard_name(shard))
        self._files: list[Path] = []
        self._buffer: list[pa.Table] = []
        self._rows = 0
        self._tokens = 0

    def add(self, table: pa.Table) -> None:
        self._buffer.append(table)
        self._rows += table.num_rows
        self._tokens += int(pc.sum(table["num_prompt_tokens"]).as_py() or 0)
        self.kept += table.num_rows
        while self._rows >= contracts.ROW_GROUP_SIZE or self._tokens >= contracts.ROW_GROUP_TOKENS:
            self._flush_one()

    def _flush_one(self) -> None:
        table = pa.concat_tables(self._buffer).combine_chunks()
        counts = table["num_prompt_tokens"].to_numpy().astype(np.int64)
        cut = contracts.row_group_ends(counts)[0]
        self._write(table.slice(0, cut))
        rest = table.slice(cut)
        self._buffer = [rest] if rest.num_rows else []
        self._rows = rest.num_rows
        self._tokens = int(counts[cut:].sum())

    def _write(self, table: pa.Table) -> None:
        self.tokens += int(pc.sum(table["num_prompt_tokens"]).as_py() or 0)
        path = Path(f"{self._prefix}-{len(self._files):06d}.arrow")
        options = pa.ipc.IpcWriteOptions(compression="lz4")
        with (
            pa.OSFile(str(path), "wb") as sink,
            pa.ipc.new_file(sink, contracts.TOKENIZED, options=options) as writer,
        ):
            writer.write_batch(table.combine_chunks().to_batches()[0])
        self._files.append(path)

    def finish(self) -> None:
        if self._rows:
            self._write(pa.concat_tables(self._buffer))
        self._buffer = []

    def row_groups(self):
        """The spilled row groups in order, each as one record batch."""
        for path in self._files:
            with pa.memory_map(str(path)) as source:
                yield pa.ipc.open_file(source).get_batch(0)


class Gathered:
    """shard_by: prefix. Every kept row in category (prompt_id) order, spilled, and each row's
    assignment key: a row's shard is known only once the whole category is (shards.assign)."""

    def __init__(self, spill_dir: Path):
        self.spill = ShardSpill(spill_dir, 0, name="all")
        self.keys: list[bytes] = []

    def add(self, table: pa.Table, values: np.ndarray, offsets: np.ndarray) -> None:
        self.spill.add(table)
        self.keys += [shards.assignment_key(values[offsets[i] : offsets[i + 1]])
                      for i in range(table.num_rows)]  # fmt: skip

    def place(self, spills: list[ShardSpill]) -> str:
        """Hand every row to its shard, in order: each shard stays in prompt_id order. Returns
        the assignment's digest (shards.AssignmentDigest)."""
        self.spill.finish()
        placed = np.asarray(shards.assign(self.keys, len(spills)), dtype=np.int64)
        for s, n in enumerate(np.bincount(placed, minlength=len(spills))):
            spills[s].records_in += int(n)
        digest = shards.AssignmentDigest()
        start = 0
        for batch in self.spill.row_groups():
            table = pa.Table.from_batches([batch])
            here = placed[start : start + table.num_rows]
            digest.add(table.column("prompt_id").to_pylist(), here.tolist())
            _to_spills(table, here, spills)
            start += table.num_rows
        return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# The stage


@dataclass
class Summary:
    category: str
    fingerprint: str
    records_in: int = 0
    kept: int = 0
    rejected: int = 0
    prompt_tokens: int = 0
    reasons: collections.Counter = field(default_factory=collections.Counter)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "category": self.category,
            "tokenizer_fingerprint": self.fingerprint,
            "records_in": self.records_in,
            "kept": self.kept,
            "rejected": self.rejected,
            "prompt_tokens": self.prompt_tokens,
            "reasons": dict(sorted(self.reasons.items())),
            "seconds": round(self.seconds, 3),
        }


def _record_json(messages_json, tools_json) -> str:
    def load(value):
        try:
            return json.loads(value) if value is not None else None
        except (ValueError, TypeError):
            return value

    return contracts.canonical_json({"messages": load(messages_json), "tools": load(tools_json)})


class Rows:
    """What prompt rows and conversation rows share: the checks of every row in order (sorted by
    prompt_id, a shard, not a duplicate; then, once encoded, not empty and not too long), the
    counts (the category's Summary and every shard's in = kept + rejected), and the rejected
    rows, written to the rejected file in groups."""

    def __init__(
        self, summary, counts: list[ShardCounts], max_prompt_tokens: int, writer, placed_later=False
    ):
        self.summary, self.counts, self.writer = summary, counts, writer
        self.max_prompt_tokens = max_prompt_tokens
        # shard_by: prefix: a kept row's shard is counted once placed; a rejected row stays in
        # its prompt_id's shard
        self.placed_later = placed_later
        self.previous: str | None = None
        self.rejected: list[dict] = []

    def admit(self, pid: str) -> tuple[int, str | None, str | None]:
        """(shard or -1, reason, detail) of the next row; raises on unsorted input."""
        self.summary.records_in += 1
        if self.previous is not None and pid < self.previous:
            raise TokenizeError(
                f"prompts file is not sorted by prompt_id: '{pid}' after '{self.previous}' "
                f"(row {self.summary.records_in - 1})"
            )
        shard, reason, detail = -1, None, None
        try:
            shard = shards.shard_of(pid, len(self.counts))
        except ValueError as exc:
            reason, detail = INVALID_PROMPT_ID, str(exc)
        if shard >= 0 and not self.placed_later:
            self.counts[shard].records_in += 1
        if reason is None and pid == self.previous:
            reason, detail = DUPLICATE_PROMPT_ID, "the same prompt_id appears more than once"
        self.previous = pid
        return shard, reason, detail

    def length_reason(self, n: int, where: str = "") -> tuple[str | None, str | None]:
        if n == 0:
            return EMPTY_PROMPT, "the chat template rendered no tokens"
        if n > self.max_prompt_tokens:
            return (
                TOO_LONG,
                f"{where}{n} prompt tokens > max_prompt_tokens {self.max_prompt_tokens}",
            )
        return None, None

    def reject(self, shard, reason, detail, source, pid, messages_json, tools_json) -> None:
        self.summary.rejected += 1
        self.summary.reasons[reason] += 1
        if shard >= 0:
            self.counts[shard].records_in += self.placed_later
            self.counts[shard].rejected += 1
        record = _record_json(messages_json, tools_json)
        category = self.summary.category
        self.rejected.append(
            contracts.rejected_row(STAGE, category, reason, detail, source, pid, record)
        )

    def kept(self, tokens: int, rows: int = 1) -> None:
        self.summary.kept += rows
        self.summary.prompt_tokens += tokens

    def flush(self, min_rows: int = REJECTED_GROUP_ROWS) -> None:
        """Write the rejected rows held once there are `min_rows` (0: all, and an empty file)."""
        if len(self.rejected) >= min_rows and (self.rejected or self.writer.rows == 0):
            self.writer.write(contracts.rejected_table(self.rejected))
            self.rejected = []

    def finish(self) -> None:
        self.flush(0)
        s = self.summary
        contracts.check_conservation(f"tokenize {s.category}", s.records_in, s.kept, s.rejected)


def _chunk_results(batches, encoder: Encoder | None, workers: int, tok, basedir):
    """(batch, ChunkResult) in input order; with workers > 1 a bounded number in flight."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    if workers <= 1:
        # One thread encodes the next chunk while this one shards and writes the last: the
        # Rust encoder and the Parquet writer release the GIL, so the cores stay busy.
        pool, submit, in_flight = ThreadPoolExecutor(max_workers=1), encoder.encode, 2
    else:
        # spawn: the parent may hold Rust tokenizer threads, which fork does not survive.
        pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(tok.raw, str(basedir)),  # a plain dict: settings do not pickle
        )
        submit, in_flight = _worker_encode, 2 * workers
    with pool:
        pending: collections.deque = collections.deque()
        for batch in batches:
            pending.append((batch, pool.submit(submit, _rows(batch))))
            if len(pending) >= in_flight:
                done, fut = pending.popleft()
                yield done, fut.result()
        while pending:
            done, fut = pending.popleft()
            yield done, fut.result()


def _rows(batch: pa.RecordBatch) -> list[tuple[str, str | None]]:
    return list(
        zip(batch.column("messages").to_pylist(), batch.column("tools").to_pylist(), strict=True)
    )


def tokenize_category(
    prompts: str | os.PathLike,
    category: str,
    num_shards: int,
    tok_cfg: TokenizerSettings | dict,
    max_prompt_tokens: int,
    out_dir: str | os.PathLike,
    rejected_path: str | os.PathLike,
    basedir: str | os.PathLike = ".",
    workers: int = 1,
    chunk_rows: int = CHUNK_ROWS,
    tokenizer=None,
    model_vocab: tuple[int | None, str] = (None, ""),
    stop_tokens: list | None = None,
    think_end_token: str | None = None,
    *,
    shard_by: str,
) -> Summary:
    """Run the stage end to end; returns the counts. `tokenizer`: an already loaded one.
    `shard_by`: categories.C.shard_by (tokenization/shards.py; its default is the schema's).
    `model_vocab`: (vocab_size, where it was read) of the model, checked against every id.
    `stop_tokens`: generation.stop_tokens, resolved to ids into every shard's metadata.
    `think_end_token`: dataset.think_end_token (conversation categories split answers at it)."""
    from tokenmill.tokenization.tokenizer import (
        load_tokenizer,
        resolve_token_ids,
        tokenizer_fingerprint,
    )

    tok = as_section(tok_cfg, "tokenizer")
    if num_shards < 1:
        raise TokenizeError(f"--shards must be >= 1, got {num_shards}")
    if shard_by not in shards.SHARD_BY:
        raise TokenizeError(f"--shard-by must be one of {list(shards.SHARD_BY)}, got {shard_by!r}")
    if max_prompt_tokens < 1:
        raise TokenizeError(f"--max-prompt-tokens must be >= 1, got {max_prompt_tokens}")
    start = time.monotonic()
    if tokenizer is None:
        tokenizer = load_tokenizer(tok, basedir)
    fingerprint, _ = tokenizer_fingerprint(tok, basedir, tokenizer)
    vocab, vocab_source = model_vocab
    if vocab is not None and len(tokenizer) > vocab:
        raise TokenizeError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab} "
            f"({vocab_source}): tokenizer.path and generation.model do not belong together"
        )
    encoder = Encoder(tokenizer, thaw(tok.chat_template_kwargs))
    summary = Summary(category, fingerprint)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spill_dir = Path(tempfile.mkdtemp(prefix=".tokenize-spill-", dir=out_dir))
    pf = pq.ParquetFile(prompts)
    if pf.metadata.num_rows <= chunk_rows:
        workers = 1  # starting processes costs more than a single chunk
    common_meta = {
        contracts.META_TOKENIZER_FINGERPRINT: fingerprint,
        contracts.META_CATEGORY: category,
        META_NUM_SHARDS: str(num_shards),
        META_MAX_PROMPT_TOKENS: str(max_prompt_tokens),
    }
    # With one shard, placement cannot differ: no key. By prompt_id neither, so shards written
    # before shard_by existed read the same.
    placed_later = shard_by == shards.BY_PREFIX and num_shards > 1
    if placed_later:
        common_meta[contracts.META_SHARD_BY] = shard_by
    if stop_tokens is not None:
        try:
            stop_ids = resolve_token_ids(tokenizer, stop_tokens)
        except ValueError as exc:
            raise TokenizeError(f"generation.stop_tokens: {exc}") from None
        common_meta[META_STOP_TOKENS] = json.dumps(stop_tokens, ensure_ascii=False)
        common_meta[META_STOP_TOKEN_IDS] = json.dumps(stop_ids)
    if contracts.is_regenerated(prompts):
        shutil.rmtree(spill_dir, ignore_errors=True)
        common_meta[contracts.META_CONTEXT] = contracts.CONTEXT_REGENERATED
        return _tokenize_conversations(
            pf, tokenizer, tok, common_meta, summary, num_shards, max_prompt_tokens,
            out_dir, rejected_path, think_end_token, start, placed_later,
        )  # fmt: skip
    try:
        spills = [ShardSpill(spill_dir, i) for i in range(num_shards)]
        gathered = Gathered(spill_dir) if placed_later else None
        rejected_writer = contracts.ParquetWriter(
            rejected_path, contracts.REJECTED, STAGE, common_meta
        )
        with rejected_writer:
            rows = Rows(summary, spills, max_prompt_tokens, rejected_writer, placed_later)
            batches = pf.iter_batches(
                batch_size=chunk_rows, columns=["prompt_id", "source", "messages", "tools"]
            )
            results = _chunk_results(batches, encoder, workers, tok, basedir)
            last_report = time.monotonic()
            # closing: an error here shuts the encoding pool down at once, not at GC time.
            with contextlib.closing(results):
                for batch, result in results:
                    if vocab is not None:
                        _check_vocab(batch, result, vocab, vocab_source)
                    _route(batch, result, rows, spills, gathered)
                    rows.flush()
                    if time.monotonic() - last_report > 30:
                        last_report = time.monotonic()
                        print(f"tokenize {category}: {summary.records_in} prompts", flush=True)
            rows.finish()
        if gathered is not None:
            common_meta[contracts.META_ASSIGNMENT] = gathered.place(spills)
        for i, spill in enumerate(spills):
            spill.finish()
            writer = contracts.ParquetWriter(
                shards.shard_path(out_dir, i),
                contracts.TOKENIZED,
                STAGE,
                spill.metadata(common_meta, i),
            )
            with writer:
                for batch in spill.row_groups():
                    writer.write(batch)
                writer.write_schema_if_empty()
    finally:
        shutil.rmtree(spill_dir, ignore_errors=True)
    summary.seconds = time.monotonic() - start
    return summary


def _check_vocab(batch, result: ChunkResult, vocab: int, source: str) -> None:
    bad = np.flatnonzero((result.flat >= vocab) | (result.flat < 0))
    if len(bad):
        row = int(np.searchsorted(np.cumsum(result.lengths), bad[0], side="right"))
        raise TokenizeError(
            f"prompt {batch.column('prompt_id')[row].as_py()}: token id "
            f"{int(result.flat[bad[0]])} is outside the model's vocabulary (vocab_size {vocab}, "
            f"{source}): tokenizer.path and generation.model do not belong together"
        )


def _route(batch, result, rows: Rows, spills: list[ShardSpill], gathered=None) -> None:
    """Check every row of a batch (Rows), reject, and hand kept rows to their shard (or, with
    `gathered`, to the category's spill, to be placed at the end)."""
    ids = batch.column("prompt_id").to_pylist()
    n = len(ids)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(result.lengths, out=offsets[1:])
    shard_arr = np.full(n, -1, dtype=np.int64)
    keep = np.zeros(n, dtype=bool)
    for i, pid in enumerate(ids):
        shard_arr[i], reason, detail = rows.admit(pid)
        if reason is None and i in result.errors:
            reason, detail = result.errors[i]
        if reason is None:
            reason, detail = rows.length_reason(int(result.lengths[i]))
        if reason is None:
            keep[i] = True
            continue
        rows.reject(
            int(shard_arr[i]), reason, detail, batch.column("source")[i].as_py(), pid,
            batch.column("messages")[i].as_py(), batch.column("tools")[i].as_py(),
        )  # fmt: skip
    kept_idx = np.flatnonzero(keep)
    if not len(kept_idx):
        return
    lengths = result.lengths[kept_idx]
    list_offsets = np.zeros(len(kept_idx) + 1, dtype=np.int64)
    np.cumsum(lengths, out=list_offsets[1:])
    if len(kept_idx) == n:
        values = result.flat
    else:  # gather the kept rows' ids (rejected rows may own tokens too, e.g. too_long)
        shift = np.repeat(offsets[kept_idx] - list_offsets[:-1], lengths)
        values = result.flat[np.arange(int(list_offsets[-1]), dtype=np.int64) + shift]
    table = pa.table(
        {
            "prompt_id": batch.column("prompt_id").take(pa.array(kept_idx)),
            "prompt_ids": pa.ListArray.from_arrays(
                pa.array(list_offsets.astype(np.int32)), pa.array(values, type=pa.int32())
            ),
            "num_prompt_tokens": pa.array(lengths.astype(np.int32)),
        },
        schema=contracts.TOKENIZED,
    )
    rows.kept(int(lengths.sum()), len(kept_idx))
    if gathered is not None:
        gathered.add(table, values, list_offsets)
    else:
        _to_spills(table, shard_arr[kept_idx], spills)


def _to_spills(table: pa.Table, shard_of_row: np.ndarray, spills: list[ShardSpill]) -> None:
    """Each row of `table` to the spill of its shard, keeping the rows' order in each."""
    order = np.argsort(shard_of_row, kind="stable")
    table = table.take(pa.array(order))
    sorted_shards = shard_of_row[order]
    bounds = np.flatnonzero(np.diff(sorted_shards)) + 1
    for lo, hi in zip(
        np.concatenate([[0], bounds]), np.concatenate([bounds, [len(order)]]), strict=True
    ):
        spills[int(sorted_shards[lo])].add(table.slice(int(lo), int(hi - lo)))


# ---------------------------------------------------------------------------------------------
# Conversation rows (context: regenerated)


def _tokenize_conversations(
    pf, tokenizer, tok, common_meta, summary, num_shards, max_prompt_tokens, out_dir,
    rejected_path, think_end_token, start, placed_later=False,
) -> Summary:  # fmt: skip
    """One TOKENIZED_CONVERSATIONS row per conversation, in the shard of its prompt_id: the
    variant of the prompt path that encodes a whole conversation per row (checks, counts,
    rejected rows and shard metadata are the prompt path's: Rows, ShardCounts). Rows are
    rendered one conversation at a time (apply_chat_template once per turn, and once more per
    dataset answer) and held in memory per shard: conversation categories are small next to
    prompt categories. The template's prefix-exactness (tokenization/conversations.py) goes
    into every shard's metadata next to the tokenizer fingerprint."""
    from tokenmill.tokenization import conversations as conv
    from tokenmill.tokenization.tokenizer import resolve_token_ids

    kwargs = thaw(tok.chat_template_kwargs)
    if common_meta.get(META_STOP_TOKEN_IDS):
        stop_ids = json.loads(common_meta[META_STOP_TOKEN_IDS])
    elif tokenizer.eos_token_id is not None:
        stop_ids = [int(tokenizer.eos_token_id)]
    else:
        raise TokenizeError("context: regenerated needs generation.stop_tokens (no eos token)")
    think_end_id = None
    if think_end_token:
        try:
            think_end_id = resolve_token_ids(tokenizer, [think_end_token])[0]
        except ValueError as exc:
            raise TokenizeError(f"dataset.think_end_token: {exc}") from None
        common_meta[contracts.META_THINK_END_ID] = str(think_end_id)
    exact = conv.template_prefix_exact(tokenizer, kwargs, stop_ids, think_end_id)
    common_meta[contracts.META_PREFIX_EXACT] = "true" if exact else "false"
    kept: list[list[dict]] = [[] for _ in range(num_shards)]
    counts = [ShardCounts() for _ in range(num_shards)]
    cols = ["prompt_id", "source", "messages", "tools"]
    keys: list[bytes] = []  # placed_later: each kept conversation's first turn's key
    with contracts.ParquetWriter(rejected_path, contracts.REJECTED, STAGE, common_meta) as w:
        rows = Rows(summary, counts, max_prompt_tokens, w, placed_later)
        for batch in pf.iter_batches(batch_size=CHUNK_ROWS, columns=cols):
            for pid, source, messages_json, tools_json in zip(
                *(batch.column(c).to_pylist() for c in cols), strict=True
            ):
                shard, reason, detail = rows.admit(pid)
                pieces = None
                if reason is None:
                    try:
                        messages, tools = Encoder._parse(messages_json, tools_json)
                    except (ValueError, TypeError) as exc:
                        reason, detail = INVALID_RECORD, _detail(exc)
                if reason is None:
                    try:
                        pieces = conv.conversation_pieces(
                            tokenizer, messages, tools, kwargs, stop_ids, exact
                        )
                    except Exception as exc:  # noqa: BLE001 - the template failed: one row
                        reason, detail = TEMPLATE_ERROR, _detail(exc)
                if reason is None:
                    n = len(pieces["prompt_ids"])
                    reason, detail = rows.length_reason(n, "turn 1: ")
                if reason is not None:
                    rows.reject(shard, reason, detail, source, pid, messages_json, tools_json)
                    continue
                rows.kept(n)
                if placed_later:
                    shard = 0  # placed below, once every conversation is known
                    keys.append(shards.assignment_key(pieces["prompt_ids"]))
                else:
                    counts[shard].kept += 1
                    counts[shard].tokens += n
                kept[shard].append(
                    {"prompt_id": pid, "num_prompt_tokens": n, "messages": messages_json,
                     "tools": tools_json, **pieces}
                )  # fmt: skip
            rows.flush()
        rows.finish()
    if placed_later:
        gathered, kept = kept[0], [[] for _ in range(num_shards)]
        placed = shards.assign(keys, num_shards)
        digest = shards.AssignmentDigest()
        digest.add((row["prompt_id"] for row in gathered), placed)
        common_meta[contracts.META_ASSIGNMENT] = digest.hexdigest()
        for row, s in zip(gathered, placed, strict=True):
            kept[s].append(row)  # in prompt_id order within each shard
            counts[s].records_in += 1
            counts[s].kept += 1
            counts[s].tokens += row["num_prompt_tokens"]
    for i in range(num_shards):
        table = pa.Table.from_pylist(kept[i], schema=contracts.TOKENIZED_CONVERSATIONS)
        contracts.write_table(
            table,
            shards.shard_path(out_dir, i),
            contracts.TOKENIZED_CONVERSATIONS,
            STAGE,
            counts[i].metadata(common_meta, i),
        )
    summary.seconds = time.monotonic() - start
    return summary


# ---------------------------------------------------------------------------------------------
# Command line


def _stop_tokens_arg(value: str | None) -> list | None:
    if value is None:
        return None
    try:
        tokens = json.loads(value)
    except ValueError as exc:
        raise TokenizeError(f"--stop-tokens is not JSON: {exc}") from None
    if not isinstance(tokens, list) or not all(isinstance(t, (str, int)) for t in tokens):
        raise TokenizeError("--stop-tokens must be a JSON list of token strings or ids")
    return tokens


def default_processes(tokenizer, cores: int) -> int:
    """A fast tokenizer already encodes on every core in one process; a slow one needs more."""
    return 1 if getattr(tokenizer, "is_fast", False) else max(1, cores)


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill tokenize", description="prompts of one category -> tokenized shards"
    )
    parser.add_argument(
        "--prompts", required=True, help="prompts Parquet file (sorted by prompt_id)"
    )
    parser.add_argument("--category", required=True)
    parser.add_argument("--shards", type=int, required=True, help="number of shard files")
    parser.add_argument(
        "--shard-by",
        choices=shards.SHARD_BY,
        required=True,
        help="categories.C.shard_by: prefix (prompts sharing a prefix share a shard) or "
        "prompt_id (a hash of it)",
    )
    parser.add_argument(
        "--tokenizer-config", required=True, help="the tokenizer section as JSON (or a JSON file)"
    )
    parser.add_argument("--max-prompt-tokens", type=int, required=True)
    parser.add_argument("--out-dir", required=True, help="writes {out_dir}/000.parquet ...")
    parser.add_argument("--rejected", required=True, help="rejected rows Parquet file")
    parser.add_argument("--basedir", default=".", help="tokenizer paths are relative to this")
    parser.add_argument(
        "--workers", type=int, default=0, help="cores to use (0: all this process may use)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=0,
        help="encoding processes (0: 1 for a fast tokenizer, --workers for a slow one)",
    )
    parser.add_argument(
        "--model", default="", help="generation.model: its config.json vocab_size bounds the ids"
    )
    parser.add_argument("--model-revision", default="", help="generation.revision")
    parser.add_argument(
        "--stop-tokens",
        default=None,
        help="generation.stop_tokens as a JSON list: resolved to ids into the shards' metadata",
    )
    parser.add_argument(
        "--think-end-token",
        default=None,
        help="dataset.think_end_token: where a context: regenerated category splits answers",
    )
    parser.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS, help=argparse.SUPPRESS)
    guards.add_limits_argument(parser)
    args = parser.parse_args(argv)
    try:
        limit = guards.limit_for(STAGE, args.reject_limits)  # ConfigError names the key
        cores = args.workers or available_cores()
        # Rust's thread pool reads this once, at its first use (after the tokenizer loads).
        os.environ.setdefault("RAYON_NUM_THREADS", str(cores))
        from tokenmill.tokenization.tokenizer import load_tokenizer

        tok = load_section(args.tokenizer_config, "tokenizer")  # ConfigError names the key
        stop_tokens = _stop_tokens_arg(args.stop_tokens)
        tokenizer = load_tokenizer(tok, args.basedir)
        model_vocab: tuple[int | None, str] = (None, "")
        if args.model:
            from tokenmill.model import model_vocab_size

            model_vocab = model_vocab_size(args.model, args.basedir, args.model_revision or None)
            if model_vocab[0] is None:
                print(f"tokenize: prompt ids not range-checked: {model_vocab[1]}", flush=True)
        workers = args.processes or default_processes(tokenizer, cores)
        summary = tokenize_category(
            args.prompts,
            args.category,
            args.shards,
            tok,
            args.max_prompt_tokens,
            args.out_dir,
            args.rejected,
            basedir=args.basedir,
            workers=workers,
            chunk_rows=args.chunk_rows,
            tokenizer=tokenizer,
            model_vocab=model_vocab,
            stop_tokens=stop_tokens,
            think_end_token=args.think_end_token or None,
            shard_by=args.shard_by,
        )
    except (TokenizeError, OSError, ValueError) as exc:
        print(f"tokenmill tokenize: error: {exc}", file=sys.stderr)
        return 1
    s = summary
    status = guards.enforce(
        [args.out_dir, args.rejected],
        STAGE,
        args.category,
        s.records_in,
        s.kept,
        args.rejected,
        limit,
        key=f"reject_limits.{STAGE}",
    )
    if status:
        return status
    rate = s.records_in / s.seconds if s.seconds else 0.0
    print(
        f"tokenize {s.category}: {s.records_in} prompts in, {s.kept} kept, {s.rejected} rejected "
        f"{dict(sorted(s.reasons.items()))}; {s.prompt_tokens} prompt tokens; "
        f"{args.shards} shards; {s.seconds:.1f} s ({rate:.0f} prompts/s, {cores} cores, "
        f"{workers} processes); "
        f"tokenizer fingerprint {s.fingerprint}"
    )
    return 0
