"""Validation of merged samples: vectorized checks over whole batches, one reason code per row.

Every check works on flattened token arrays (values + row offsets), never on Python lists of
tokens. A row fails with the FIRST reason in `REASONS` order that applies (the order goes from
"this row does not belong here" to "this row is too long"), so each rejected row has exactly
one stable reason code:

    duplicate_prompt_id  the prompt_id appears more than once in the generated shard
    sample_key_mismatch  sample_key != keys.sample_key(fingerprint, prompt_ids): the engine
                         answered another prompt or another generation config
    missing_finish       finish_type is null
    aborted              finish_type "abort"
    empty_output         no output token
    truncated            finish_type "length" (only when dataset.reject_truncated)
    token_out_of_range   an input id outside [0, vocab_size) (vocab_size = len(tokenizer))
    missing_stop_token   finish_type "stop" but the last output token is not a stop token
                         (generation.stop_tokens resolved, plus the tokenizer's eos)
    no_think_end         dataset.think_end_token never appears (only when require_think_end)
    too_long             prompt + output tokens > dataset.max_sequence_tokens

`not_generated` and `unknown_prompt_id` are decided by the join in merge.py, not here.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tokenmill.settings import ConfigError, as_section, load_section

REASONS = (
    "duplicate_prompt_id",
    "sample_key_mismatch",
    "missing_finish",
    "aborted",
    "empty_output",
    "truncated",
    "token_out_of_range",
    "missing_stop_token",
    "no_think_end",
    "too_long",
)
# Decided by the join (merge.py): a tokenized prompt without any generated row or generate
# rejection, and a generated row whose prompt_id is not in the tokenized shard.
JOIN_REASONS = ("not_generated", "unknown_prompt_id")
OK = -1


@dataclass(frozen=True)
class Rules:
    vocab_size: int
    stop_ids: tuple[int, ...] = ()
    think_end_id: int | None = None
    think_start_id: int | None = None
    max_sequence_tokens: int = 32768
    reject_truncated: bool = True
    require_think_end: bool = False
    stop_array: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "stop_array", np.asarray(sorted(set(self.stop_ids)), np.int64))


def think_start_token(think_end_token: str | None, configured: str | None = None) -> str | None:
    """The think-open token: dataset.think_start_token, by default think_end_token without "/"
    (<think> for </think>); None without a think-end token."""
    if think_end_token is None:
        return None
    if configured:
        return configured
    return "<" + think_end_token[2:] if think_end_token.startswith("</") else None


def think_ids(tokenizer, think_end_token, configured_start: str | None = None):
    """(think-open id, think-close id): the one think-token rule, used by merge (Rules) and
    stats alike. Both None without a think-end token. A think-end or an explicitly configured
    think-start that is not one token of the tokenizer is an error (ValueError naming it); the
    default think-start (derived from think-end) missing from the tokenizer is None: such a
    tokenizer opens no thinking block, so no output counts as unterminated reasoning."""
    from tokenmill.tokenization.tokenizer import resolve_token_ids

    if think_end_token is None:
        return None, None
    end_id = resolve_token_ids(tokenizer, [think_end_token])[0]
    start = think_start_token(think_end_token, configured_start)
    if start is None:
        return None, end_id
    try:
        start_id = resolve_token_ids(tokenizer, [start])[0]
    except ValueError:
        if configured_start:
            raise
        start_id = None  # the default <think> for </think>: this tokenizer opens no block
    return start_id, end_id


@dataclass(frozen=True)
class TokenFacts:
    """What merge, stats and draft_vocab need of the tokenizer, resolved once per run by the
    `token_facts` rule (`tokenmill token-facts`, results/tokenizer/token_facts.json) so that
    their jobs load no tokenizer: the vocabulary size (len(tokenizer)), the stop ids
    (generation.stop_tokens resolved, then the eos id) and the think-open/think-close ids
    (think_ids). `resolved_from` holds the config values they were resolved from
    (stop_tokens, think_end_token, think_start_token): a reader checks it against its own."""

    vocab_size: int
    stop_ids: tuple[int, ...]
    think_start_id: int | None
    think_end_id: int | None
    resolved_from: dict


def facts_source(dataset=None, generation=None) -> dict:
    """The config values the token facts depend on (besides the tokenizer itself): the think
    tokens of `dataset`, the stop tokens of `generation` (a section left out: not its keys)."""
    source = {}
    if generation is not None:
        source["stop_tokens"] = list(as_section(generation, "generation").stop_tokens)
    if dataset is not None:
        ds = as_section(dataset, "dataset")
        source |= {"think_end_token": ds.think_end_token, "think_start_token": ds.think_start_token}
    return source


def token_facts(dataset, generation, tokenizer) -> TokenFacts:
    """The token facts of the loaded tokenizer for the `dataset:` and `generation:` settings
    (settings objects or section dicts)."""
    from tokenmill.tokenization.tokenizer import resolve_token_ids

    ds = as_section(dataset, "dataset")
    gen = as_section(generation, "generation")
    stop = resolve_token_ids(tokenizer, list(gen.stop_tokens))
    if tokenizer.eos_token_id is not None:
        stop.append(int(tokenizer.eos_token_id))
    start_id, think_id = think_ids(tokenizer, ds.think_end_token, ds.think_start_token)
    return TokenFacts(
        vocab_size=len(tokenizer),
        stop_ids=tuple(int(i) for i in stop),
        think_start_id=start_id,
        think_end_id=think_id,
        resolved_from=facts_source(ds, gen),
    )


# The token facts file (results/tokenizer/token_facts.json): these keys, and
# tokenizer_fingerprint (tokenizer.tokenizer_fingerprint of the tokenizer they came from).
FACTS_KEYS = ("vocab_size", "stop_ids", "think_start_id", "think_end_id", "resolved_from")


def facts_dict(facts: TokenFacts) -> dict:
    return {k: getattr(facts, k) for k in FACTS_KEYS} | {"stop_ids": list(facts.stop_ids)}


def write_token_facts(path, facts: TokenFacts, tokenizer_fingerprint: str) -> None:
    """Write the facts file atomically (indented, sorted keys: the same facts, the same bytes)."""
    from tokenmill import contracts

    obj = facts_dict(facts) | {"tokenizer_fingerprint": tokenizer_fingerprint}
    contracts.write_json_atomic(path, obj)


class TokenFactsError(ValueError):
    """The facts file cannot be used: unreadable, or made for another config or tokenizer."""


def read_token_facts(
    path, dataset=None, generation=None, tokenizer_fingerprint: str | None = None
) -> TokenFacts:
    """The facts file's TokenFacts. With `dataset` / `generation` (settings or section dicts),
    the think tokens / stop tokens it was resolved from must be theirs; with
    `tokenizer_fingerprint` (a tokenized shard's), it must come from that tokenizer
    (TokenFactsError otherwise: the file belongs to another config or tokenizer)."""
    try:
        obj = json.loads(Path(path).read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenFactsError(f"token facts {path}: cannot read it ({exc})") from exc
    missing = [k for k in FACTS_KEYS if k not in obj] if isinstance(obj, dict) else FACTS_KEYS
    if missing:
        raise TokenFactsError(f"token facts {path}: missing {', '.join(missing)}")
    made_from = obj.get("tokenizer_fingerprint")
    if tokenizer_fingerprint and made_from != tokenizer_fingerprint:
        raise TokenFactsError(
            f"token facts {path} come from tokenizer {str(made_from)[:12]}, the shard was "
            f"tokenized with {tokenizer_fingerprint[:12]} (tokenmill.tokenizer_fingerprint): "
            "rerun `tokenmill token-facts` with the shard's tokenizer, or retokenize"
        )
    facts = TokenFacts(
        vocab_size=int(obj["vocab_size"]),
        stop_ids=tuple(int(i) for i in obj["stop_ids"]),
        think_start_id=obj["think_start_id"],
        think_end_id=obj["think_end_id"],
        resolved_from=dict(obj["resolved_from"]),
    )
    want = facts_source(dataset, generation)
    differ = {k: v for k, v in want.items() if facts.resolved_from.get(k) != v}
    if differ:
        have = {k: facts.resolved_from.get(k) for k in differ}
        raise TokenFactsError(
            f"token facts {path} were resolved for {have}, the config has {differ} "
            "(rerun `tokenmill token-facts`)"
        )
    return facts


def rules_from_facts(dataset, facts: TokenFacts) -> Rules:
    """Rules for the `dataset:` settings (or section dict) and the tokenizer's facts."""
    ds = as_section(dataset, "dataset")
    return Rules(
        vocab_size=facts.vocab_size,
        stop_ids=facts.stop_ids,
        think_end_id=facts.think_end_id,
        think_start_id=facts.think_start_id,
        max_sequence_tokens=ds.max_sequence_tokens,
        reject_truncated=ds.reject_truncated,
        require_think_end=ds.require_think_end,
    )


def rules_from_config(dataset, generation, tokenizer) -> Rules:
    """Rules for the `dataset:` settings, the generation stop tokens and the loaded tokenizer
    (`dataset`, `generation`: settings objects, or the sections as dicts, validated here)."""
    return rules_from_facts(dataset, token_facts(dataset, generation, tokenizer))


def row_of_values(offsets: np.ndarray) -> np.ndarray:
    """For flattened list values, the row index of every value."""
    lengths = np.diff(offsets)
    return np.repeat(np.arange(len(lengths)), lengths)


def any_per_row(flags: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Row-wise any() of a boolean value array."""
    n = len(offsets) - 1
    hit = np.flatnonzero(flags)
    out = np.zeros(n, dtype=bool)
    if hit.size:
        out[np.searchsorted(offsets, hit, side="right") - 1] = True
    return out


def first_position(values: np.ndarray, offsets: np.ndarray, token: int) -> np.ndarray:
    """Per row, the 0-based position of the first `token` (-1 when absent)."""
    n = len(offsets) - 1
    out = np.full(n, -1, dtype=np.int64)
    hit = np.flatnonzero(values == token)
    if hit.size:
        rows = np.searchsorted(offsets, hit, side="right") - 1
        # hits are sorted, so the first index of each row is its first occurrence
        rows_u, first = np.unique(rows, return_index=True)
        out[rows_u] = hit[first] - offsets[rows_u]
    return out


def reasoning_counts(
    out_values: np.ndarray,
    out_offsets: np.ndarray,
    think_end_id: int | None,
    unterminated_rows: np.ndarray | None = None,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Reasoning = output tokens up to and including the first think-end; answer = the rest.

    Without think_end_id both are None (null columns). An output without think-end counts as
    all answer (reasoning 0), what a non-thinking turn looks like, unless it is one of the
    `unterminated_rows` (see `unterminated`): then it is all reasoning (answer 0).
    """
    if think_end_id is None:
        return None, None
    out_len = np.diff(out_offsets)
    pos = first_position(out_values, out_offsets, think_end_id)
    reasoning = np.where(pos >= 0, pos + 1, 0)
    if unterminated_rows is not None:
        reasoning = np.where(unterminated_rows, out_len, reasoning)
    return reasoning, out_len - reasoning


def _last_in_prompt(values, offsets, p_len, token) -> np.ndarray:
    """Per row, the last position of `token` inside the prompt part (-1 when absent)."""
    out = np.full(len(offsets) - 1, -1, dtype=np.int64)
    hit = np.flatnonzero(values == token)
    if hit.size:
        rows = np.searchsorted(offsets, hit, side="right") - 1
        pos = hit - offsets[rows]
        keep = pos < p_len[rows]
        np.maximum.at(out, rows[keep], pos[keep])
    return out


def _in_output(values, offsets, p_len, token) -> np.ndarray:
    out = np.zeros(len(offsets) - 1, dtype=bool)
    hit = np.flatnonzero(values == token)
    if hit.size:
        rows = np.searchsorted(offsets, hit, side="right") - 1
        out[rows[hit - offsets[rows] >= p_len[rows]]] = True
    return out


def unterminated(values, offsets, p_len, start_id: int | None, end_id: int | None) -> np.ndarray:
    """Rows of prompt + output ids (`values`/`offsets`, the first `p_len` of each row the
    prompt) whose output never closed a thinking block that was open: no think-end in the
    output, and either the prompt ended inside a block (its last think-open after its last
    think-close: Kimi-K2.5's generation prompt) or the output opened one (Qwen3)."""
    n = len(offsets) - 1
    if start_id is None or end_id is None:
        return np.zeros(n, dtype=bool)
    offsets = np.asarray(offsets, dtype=np.int64)
    p_len = np.asarray(p_len, dtype=np.int64)
    open_in_prompt = _last_in_prompt(values, offsets, p_len, start_id) > _last_in_prompt(
        values, offsets, p_len, end_id
    )
    opened = open_in_prompt | _in_output(values, offsets, p_len, start_id)
    return opened & ~_in_output(values, offsets, p_len, end_id)


def validate(
    rules: Rules,
    prompt_values: np.ndarray,
    prompt_offsets: np.ndarray,
    out_values: np.ndarray,
    out_offsets: np.ndarray,
    finish_type: list | np.ndarray,
    key_ok: np.ndarray,
    duplicate: np.ndarray | None = None,
) -> np.ndarray:
    """Reason index per row (into REASONS), OK (-1) for rows that pass every check."""
    n = len(out_offsets) - 1
    finish = np.asarray(finish_type, dtype=object)
    p_len = np.diff(prompt_offsets)
    o_len = np.diff(out_offsets)
    vocab = rules.vocab_size
    bad_prompt = any_per_row((prompt_values < 0) | (prompt_values >= vocab), prompt_offsets)
    bad_output = any_per_row((out_values < 0) | (out_values >= vocab), out_offsets)
    last = np.full(n, -1, dtype=np.int64)
    nonempty = o_len > 0
    last[nonempty] = out_values[out_offsets[1:][nonempty] - 1]
    stop_ok = np.isin(last, rules.stop_array)
    if rules.require_think_end and rules.think_end_id is not None:
        no_think = first_position(out_values, out_offsets, rules.think_end_id) < 0
    else:
        no_think = np.zeros(n, dtype=bool)
    checks = [
        np.zeros(n, bool) if duplicate is None else np.asarray(duplicate, bool),
        ~np.asarray(key_ok, bool),
        finish == None,  # noqa: E711 - elementwise comparison on an object array
        finish == "abort",
        ~nonempty,
        (finish == "length") & rules.reject_truncated,
        bad_prompt | bad_output,
        (finish == "stop") & ~stop_ok,
        no_think,
        (p_len + o_len) > rules.max_sequence_tokens,
    ]
    reason = np.full(n, OK, dtype=np.int64)
    # Last check first, so that earlier (more fundamental) reasons overwrite later ones.
    for idx in range(len(checks) - 1, -1, -1):
        reason[np.asarray(checks[idx], bool)] = idx
    return reason


def describe(reason: str, **ctx) -> str:
    """A human-readable detail line for a rejected row."""
    texts = {
        "duplicate_prompt_id": "prompt_id appears {count} times in the generated shard",
        "sample_key_mismatch": "generated sample_key {got} != expected {expected}",
        "missing_finish": "finish_type is null",
        "aborted": "the engine aborted the request",
        "empty_output": "no output tokens",
        "truncated": "finish_type length: cut at max_new_tokens ({output} output tokens)",
        "token_out_of_range": "a token id is outside [0, {vocab})",
        "missing_stop_token": "finish stop, but last token {last} is not a stop token {stops}",
        "no_think_end": "think-end token {think} never appears in the output",
        "too_long": "{total} tokens > max_sequence_tokens {limit}",
        "not_generated": "tokenized prompt has no generated row and no generate rejection",
        "unknown_prompt_id": "generated row for a prompt_id not in the tokenized shard",
    }
    try:
        return texts[reason].format(**ctx)
    except (KeyError, IndexError):
        return reason


# --------------------------------------------------------------------------------------------
# The config arguments of the commands that validate (merge, draft-vocab from-config)


def add_config_arguments(parser) -> None:
    """--dataset-config, --generation-config (inline JSON or a file, the section or the whole
    config), the tokenizer's facts: --token-facts (the token_facts rule's file, what the rules
    give) or --tokenizer-config (the tokenizer is loaded in the job: one started by hand), and
    --basedir (a local tokenizer path is relative to it)."""
    for section in ("dataset", "generation"):
        parser.add_argument(f"--{section}-config", required=True, help="JSON object or JSON file")
    facts = parser.add_mutually_exclusive_group(required=True)
    facts.add_argument("--token-facts", help="results/tokenizer/token_facts.json")
    facts.add_argument("--tokenizer-config", help="JSON object or JSON file: load the tokenizer")
    parser.add_argument("--basedir", default=".")


def load_config_arguments(args, prog: str):
    """(dataset, generation, tokenizer or None) settings of add_config_arguments' arguments, or
    None after printing the ConfigError (it names the key) to stderr."""
    try:
        return tuple(
            load_section(value, section) if value is not None else None
            for section, value in (
                ("dataset", args.dataset_config),
                ("generation", args.generation_config),
                ("tokenizer", args.tokenizer_config),
            )
        )
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None


def facts_of_arguments(
    args, dataset, generation, tokenizer, tokenizer_fingerprint: str | None = None
) -> TokenFacts:
    """The token facts of add_config_arguments' arguments: read from --token-facts (checked
    against the dataset and generation settings, and against `tokenizer_fingerprint` when
    given), or resolved by loading the tokenizer of --tokenizer-config. Either way, the same
    TokenFacts."""
    if args.token_facts:
        return read_token_facts(args.token_facts, dataset, generation, tokenizer_fingerprint)
    from tokenmill.tokenization.tokenizer import load_tokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return token_facts(dataset, generation, load_tokenizer(tokenizer, args.basedir))


def main(argv: list[str]) -> int:
    """`tokenmill token-facts`: load the tokenizer once and write the facts merge, stats and
    draft-vocab read (the `token_facts` rule)."""
    import argparse

    from tokenmill.tokenization.tokenizer import load_tokenizer, tokenizer_fingerprint

    parser = argparse.ArgumentParser(
        prog="tokenmill token-facts",
        description="tokenizer -> the vocabulary size, stop ids and think ids of the config",
    )
    for section in ("dataset", "generation", "tokenizer"):
        parser.add_argument(f"--{section}-config", required=True, help="JSON object or JSON file")
    parser.add_argument("--basedir", default=".", help="a local tokenizer path is relative to it")
    parser.add_argument("--out", required=True, help="results/tokenizer/token_facts.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sections = load_config_arguments(args, "tokenmill token-facts")
    if sections is None:
        return 1
    ds, gen, tok_cfg = sections
    tok = load_tokenizer(tok_cfg, args.basedir)
    try:
        facts = token_facts(ds, gen, tok)
    except ValueError as exc:  # a stop or think token that is not one token
        print(f"tokenmill token-facts: {exc}", file=sys.stderr)
        return 1
    fingerprint, _ = tokenizer_fingerprint(tok_cfg, args.basedir, tok)
    write_token_facts(args.out, facts, fingerprint)
    print(f"token facts: {json.dumps(facts_dict(facts), sort_keys=True)}", file=sys.stderr)
    return 0
