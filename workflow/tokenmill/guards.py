"""The rejection guards every stage asks: too much refused, or nothing kept, fails the job.

One rule, one config shape ({max_fraction, min_count}, `$defs/reject_limit` in the schema, which
holds every default): prepare, tokenize and merge read theirs from `reject_limits.<stage>`,
generate from `generation.reject_limit` (its RejectionGuard judges a shard's end with
`over_limit` too, and may stop a shard early on top; docs/engines.md).

A category is judged by its share: it fails when

  * at least `min_count` of its records were rejected and they are more than `max_fraction` of
    those judged (reasons a stage rejects by design, prepare's duplicate_prompt and
    over_max_prompts, are neither counted nor judged), or
  * it kept nothing (an empty source, or every record rejected).

Prepare and tokenize judge a category in their own job. Generate and merge run a job per
shard, and a shard's share is a sample of its category's: 16 shards of 600 prompts at a true
3.9 % refusal rate put one shard over 5 % in most runs. So a shard fails only on a share that
chance cannot explain at the limit (`shard_over_limit`: at least `min_count` rejected, and the
Chernoff bound on the chance of that many or more from a true rate of exactly `max_fraction`,
exp(-n KL(share || max_fraction)), is below GUARD_ALPHA = 1e-9), or when it kept nothing with
two or more rejected; the category's verdict on its share comes once its shards are in
(`tokenmill verdict`, the judge_category rule, which the category's token sum and so the card,
draft vocabulary, statistics and provenance wait for).

`max_fraction: 1.0` turns a stage's guard off. The failure is ONE line on stderr, starting with
GUARD_PREFIX and naming the category, the stage, the share and the top reasons with an example
location (the run summary, tokenmill/run_summary.py, repeats it at the end of a failed run); the
stage then removes its outputs, so nothing half-written is left looking complete.

A shared module below the stages: it imports no stage.
"""

from __future__ import annotations

import math
import shutil
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import pyarrow.parquet as pq

from tokenmill.settings import RejectLimitSettings, load_section

GUARD_PREFIX = "tokenmill guard:"
TOP_REASONS = 3  # reasons named in the message
# A shard fails on its share only when a true rate at the limit gives that many rejections
# or more with a chance below this (the Chernoff bound, `chance_at_limit`). At 1e-9 a run of
# 500 shards, each looked at after every refusal, stays far from a false trip; a systemic
# failure still stops a shard within a few prompts (all refused at a 5 % limit: 7 prompts; half
# refused: 25).
GUARD_ALPHA = 1e-9


class GuardError(RuntimeError):
    """A stage rejected too much, or kept nothing; str() is the one-line message."""


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def add_limits_argument(parser) -> None:
    """--reject-limits, the one way a stage command gets its guard's limit: the rules pass the
    run's whole config ("$TOKENMILL_CONFIG_JSON": operational, so not a rerun trigger); a
    command run on its own without it takes the schema's defaults."""
    parser.add_argument(
        "--reject-limits",
        default="{}",
        help="reject_limits as JSON or a file (the section, or the whole config); default: "
        "the schema's",
    )


def limit_key(stage: str) -> str:
    """The config key of a stage's limit, as the guard's line names it."""
    return "generation.reject_limit" if stage == "generate" else f"reject_limits.{stage}"


def limit_for(stage: str, value) -> RejectLimitSettings:
    """`reject_limits.<stage>` of `value` (--reject-limits: inline JSON, a file, the section or
    the whole config). ConfigError names the key."""
    return getattr(load_section(value or {}, "reject_limits"), stage)


def chance_at_limit(rejected: int, judged: int, limit: float) -> float:
    """An upper bound on the chance that `judged` records at a true rejection rate of `limit`
    give `rejected` or more: the Chernoff bound exp(-n KL(k/n || limit)) (1.0 when the share
    is not above the limit)."""
    if judged <= 0 or rejected <= limit * judged:
        return 1.0
    q = rejected / judged
    if limit <= 0.0:
        return 0.0
    kl = q * math.log(q / limit)
    if q < 1.0:
        kl += (1 - q) * math.log((1 - q) / (1 - limit))
    return math.exp(-judged * kl)


def over_limit(
    judged: int, rejected: int, kept: int, limit: RejectLimitSettings, *, key: str, shard=False
) -> str | None:
    """Why `rejected` of `judged` records passes `limit` (None: it does not). `key` names the
    limit's config key in the answer. A category (`shard` false) is judged by its share; a
    shard by `shard_over_limit`."""
    if shard:
        return shard_over_limit(judged, rejected, kept, limit, key=key)
    lim = limit.max_fraction
    if lim >= 1.0:
        return None
    share = rejected / judged if judged else 0.0
    if rejected >= limit.min_count and share > lim:
        return f"{rejected} of {judged} rejected ({share:.1%} > {key}.max_fraction {lim:.1%})"
    if kept == 0 and rejected >= 1:
        return f"{rejected} of {judged} rejected ({share:.1%}): nothing kept"
    return None


def shard_over_limit(
    judged: int, rejected: int, kept: int, limit: RejectLimitSettings, *, key: str
) -> str | None:
    """Why one shard's `rejected` of `judged` cannot be chance at `limit` (None: it can be, and
    its category's verdict decides): at least min_count rejected and a chance at the limit
    below GUARD_ALPHA, or nothing kept with two or more rejected (one prompt alone says
    little)."""
    lim = limit.max_fraction
    if lim >= 1.0:
        return None
    share = rejected / judged if judged else 0.0
    if rejected >= limit.min_count and chance_at_limit(rejected, judged, lim) < GUARD_ALPHA:
        return (
            f"{rejected} of {judged} rejected ({share:.1%}; a true {lim:.1%}, "
            f"{key}.max_fraction, gives that many with a chance below {GUARD_ALPHA:.0e})"
        )
    if kept == 0 and rejected >= 2:
        return f"{rejected} of {judged} rejected ({share:.1%}): nothing kept"
    return None


def top_reasons(rows: Iterable[dict], n: int = TOP_REASONS) -> str:
    """'reason count (e.g. location: detail), ...' for the `n` most frequent reasons of
    rejected rows (dicts with reason, source, prompt_id, detail)."""
    counts: Counter = Counter()
    example: dict[str, str] = {}
    for r in rows:
        reason = r["reason"]
        counts[reason] += 1
        if reason not in example:
            where = r.get("source") or r.get("prompt_id") or "?"
            detail = " ".join(str(r.get("detail") or "").split())
            if len(detail) > 120:
                detail = detail[:117] + "..."
            example[reason] = f"{where}: {detail}" if detail else str(where)
    parts = [f"{reason} {c} (e.g. {example[reason]})" for reason, c in counts.most_common(n)]
    if len(counts) > n:
        parts.append(f"{len(counts) - n} more reasons")
    return ", ".join(parts)


def rejected_rows(path: str | Path) -> list[dict]:
    """The rows of a rejected file, with the columns a guard message needs."""
    cols = ["reason", "source", "prompt_id", "detail"]
    return pq.read_table(path, columns=cols).to_pylist()


def message(
    stage: str,
    category: str,
    why: str,
    reasons: str,
    key: str,
    shard=None,
    outcome: str = "the stage's outputs were removed",
) -> str:
    where = f"category '{category}'" + (f" shard {shard}" if shard is not None else "")
    text = f"{GUARD_PREFIX} {where}, stage {stage}: {why}"
    if reasons:
        text += f"; top reasons: {reasons}"
    return (
        f"{text}. Fix the data or the config (or raise {key}.max_fraction, 1.0 turns this "
        f"guard off); {outcome}."
    )


def check(
    stage: str,
    category: str,
    n_in: int,
    kept: int,
    rejected_path: str | Path,
    limit: RejectLimitSettings,
    *,
    key: str,
    shard=None,
    exempt: Iterable[str] = (),
    empty_detail: str = "",
) -> None:
    """Raise GuardError when the stage's rejections (read from its rejected file) pass `limit`.
    `exempt`: reasons the stage rejects by design (neither counted nor judged)."""
    if limit.max_fraction >= 1.0:
        return
    if n_in == 0:
        if shard is None:
            why = "no records at all" + (f": {empty_detail}" if empty_detail else "")
            raise GuardError(message(stage, category, why, "", key))
        return
    rows = rejected_rows(rejected_path)
    exempt = set(exempt)
    counted = [r for r in rows if r["reason"] not in exempt]
    judged = n_in - (len(rows) - len(counted))
    why = over_limit(judged, len(counted), kept, limit, key=key, shard=shard is not None)
    if why is not None:
        raise GuardError(message(stage, category, why, top_reasons(counted), key, shard))


def remove_outputs(paths: Iterable[str | Path]) -> None:
    """Remove a failed stage's outputs (files or folders), so that nothing half-written looks
    complete (Snakemake removes a failed job's outputs too; a command run by hand does not)."""
    for p in map(Path, paths):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def enforce(outputs: Iterable[str | Path], *args, **kwargs) -> int:
    """check(*args, **kwargs); on a GuardError print its one line to stderr, remove `outputs`
    and return 1 (the command's exit status), else 0."""
    try:
        check(*args, **kwargs)
    except GuardError as exc:
        remove_outputs(outputs)
        print(exc, file=sys.stderr, flush=True)
        return 1
    return 0
