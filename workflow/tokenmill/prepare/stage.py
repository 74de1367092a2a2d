"""`tokenmill prepare`: one category's sources -> normalized prompts + rejected rows.

    tokenmill prepare --category NAME --category-config JSON_OR_FILE \\
        --out results/prompts/NAME.parquet --rejected results/rejected/prepare/NAME.parquet \\
        [--basedir DIR]

Records are read in source order (sources as listed, files sorted by path), mapped to
conversations (tokenmill.prepare.formats), cut into prompts by the category's `turns`, deduplicated
by prompt_id (the first occurrence in source order is kept) and, with `max_prompts`, sampled
by ranking sha256(f"{sample_seed}:{prompt_id}"): editing one prompt never reshuffles others.

Counting: the unit is a candidate prompt. A record that fails before turn selection is one
rejected row; a valid record yields one candidate per selected prompt (several with
turns=all), each either kept or rejected (duplicate_prompt, over_max_prompts). So
`tokenmill.records_in` = kept + rejected always holds; `tokenmill.source_records` is the
number of records read. Prompts are sorted by prompt_id, rejected rows by source order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa

from tokenmill.cli import json_arg
from tokenmill.config import load_hook, normalize_source
from tokenmill.contracts import (
    PROMPTS,
    REJECTED,
    ordered_json,
    rejected_table,
    write_table,
)
from tokenmill.prepare import formats
from tokenmill.prepare.sources import SourceError, iter_source

STAGE = "prepare"
CATEGORY_DEFAULTS = {"turns": "last", "max_prompts": None, "sample_seed": 0, "format_options": {}}


class PrepareError(RuntimeError):
    """A problem that stops the whole category (bad config, unreadable source)."""


def with_defaults(category: dict) -> dict:
    """The category config with the schema's defaults for keys that may be missing."""
    cat = dict(category)
    for key, value in CATEGORY_DEFAULTS.items():
        if cat.get(key) is None:
            cat[key] = value
    if not cat.get("sources"):
        raise PrepareError("category config: 'sources' is required (a non-empty list)")
    if cat.get("format") not in formats.FORMATS:
        raise PrepareError(
            f"category config: 'format' must be one of {formats.FORMATS}, got {cat.get('format')!r}"
        )
    if cat["turns"] not in formats.TURNS:
        raise PrepareError(f"category config: 'turns' must be one of {formats.TURNS}")
    if any(normalize_source(s, cat)["format"] == "instruction" for s in cat["sources"]):
        try:
            formats.instruction_columns(cat["format_options"])
        except formats.ColumnClash as exc:
            raise PrepareError(f"category config: format_options.{exc.role}: {exc}") from None
    return cat


def prompt_row(pid: str, source: str, messages: list, tools: list | None) -> dict:
    """One PROMPTS row. Messages and tools keep their source key order: templates render
    tools with tojson, so sorting would change what the model sees."""
    return {
        "prompt_id": pid,
        "source": source,
        "messages": ordered_json(messages),
        "tools": None if tools is None else ordered_json(tools),
    }


def sample_rank(seed: int, pid: str) -> str:
    return hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest()


def _get_hook(cat: dict, basedir: Path, fmt: str):
    if fmt != "hook":
        return None
    if not cat.get("hook"):
        raise PrepareError("category config: format 'hook' needs hook: 'module:function'")
    # Hooks live next to the workflow (e.g. sample/hooks.py -> sample.hooks:fn).
    base = str(basedir.resolve())
    if base not in sys.path:
        sys.path.insert(0, base)
    try:
        return load_hook(cat["hook"])
    except Exception as exc:  # noqa: BLE001 - any import problem stops the category
        raise PrepareError(f"category config: hook '{cat['hook']}': {exc}") from exc


def prepare(category: str, cat: dict, basedir: str | Path = "."):
    """Run the stage in memory: (prompt rows sorted by prompt_id, rejected rows, counts)."""
    cat = with_defaults(cat)
    basedir = Path(basedir)
    options = cat.get("format_options") or {}
    hooks: dict[str, object] = {}
    kept: dict[str, dict] = {}  # prompt_id -> row (first occurrence)
    order: dict[str, tuple] = {}  # prompt_id -> (record ordinal, turn) for sorting rejections
    rejected: list[tuple] = []  # ((ordinal, turn), row)
    n_records = 0

    def reject(key, reason, detail, rec, pid=None):
        row = dict(
            stage=STAGE,
            category=category,
            reason=reason,
            detail=detail,
            source=rec["source"],
            prompt_id=pid,
            record=rec["raw"],
        )
        rejected.append((key, row))

    for src in cat["sources"]:
        spec = normalize_source(src, cat)
        fmt = spec["format"]
        if fmt not in hooks:
            hooks[fmt] = _get_hook(cat, basedir, fmt)
        try:
            for record in iter_source(spec, basedir):
                n_records += 1
                rec = {"source": record.location, "raw": record.raw}
                key = (n_records, 0)
                if record.data is None:
                    reject(key, formats.UNPARSEABLE, record.error, rec)
                    continue
                try:
                    prompts = formats.to_prompts(
                        record.data, fmt, options, hooks[fmt], cat["turns"]
                    )
                except formats.RecordError as exc:
                    reject(key, exc.reason, exc.detail, rec)
                    continue
                for turn, (pid, messages, tools) in enumerate(prompts):
                    key = (n_records, turn)
                    if pid in kept:
                        first = kept[pid]["source"]
                        reject(key, formats.DUPLICATE_PROMPT, f"same prompt as {first}", rec, pid)
                        continue
                    row = prompt_row(pid, record.location, messages, tools)
                    kept[pid] = {**row, "_raw": record.raw}
                    order[pid] = key
        except SourceError as exc:
            raise PrepareError(str(exc)) from exc

    limit = cat.get("max_prompts")
    if limit is not None and len(kept) > limit:
        seed = int(cat.get("sample_seed") or 0)
        ranked = sorted(kept, key=lambda p: sample_rank(seed, p))
        for pid in ranked[limit:]:
            row = kept.pop(pid)
            detail = f"not among the {limit} prompts chosen with sample_seed {seed}"
            rec = {"source": row["source"], "raw": row["_raw"]}
            reject(order[pid], formats.OVER_MAX_PROMPTS, detail, rec, pid)

    prompts = [{k: v for k, v in kept[p].items() if k != "_raw"} for p in sorted(kept)]
    rejected_rows = [row for _, row in sorted(rejected, key=lambda kr: kr[0])]
    counts = {
        "records_in": len(prompts) + len(rejected_rows),
        "kept": len(prompts),
        "rejected": len(rejected_rows),
        "source_records": n_records,
    }
    return prompts, rejected_rows, counts


def write_outputs(category, prompts, rejected_rows, counts, out, rejected_out) -> None:
    meta = {
        "tokenmill.category": category,
        "tokenmill.records_in": str(counts["records_in"]),
        "tokenmill.kept": str(counts["kept"]),
        "tokenmill.rejected": str(counts["rejected"]),
        "tokenmill.source_records": str(counts["source_records"]),
    }
    table = pa.Table.from_pylist(prompts, schema=PROMPTS) if prompts else PROMPTS.empty_table()
    write_table(table, out, PROMPTS, stage=STAGE, metadata=meta)
    write_table(rejected_table(rejected_rows), rejected_out, REJECTED, stage=STAGE, metadata=meta)


def _load_category_config(value: str) -> dict:
    try:
        return json_arg(value, "--category-config")
    except ValueError as exc:
        raise PrepareError(str(exc)) from None


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill prepare", description="sources of one category -> normalized prompts"
    )
    parser.add_argument("--category", required=True)
    parser.add_argument(
        "--category-config", required=True, help="the category's config as JSON (or a JSON file)"
    )
    parser.add_argument("--out", required=True, help="prompts Parquet file")
    parser.add_argument("--rejected", required=True, help="rejected rows Parquet file")
    parser.add_argument("--basedir", default=".", help="source paths are relative to this")
    args = parser.parse_args(argv)
    try:
        cat = _load_category_config(args.category_config)
        prompts, rejected_rows, counts = prepare(args.category, cat, args.basedir)
    except (PrepareError, OSError, json.JSONDecodeError) as exc:
        print(f"tokenmill prepare [{args.category}]: error: {exc}", file=sys.stderr)
        return 1
    write_outputs(args.category, prompts, rejected_rows, counts, args.out, args.rejected)
    reasons = Counter(r["reason"] for r in rejected_rows)
    summary = ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())) or "none"
    print(
        f"tokenmill prepare [{args.category}]: {counts['source_records']} records, "
        f"{counts['records_in']} candidate prompts: {counts['kept']} kept, "
        f"{counts['rejected']} rejected ({summary})",
        file=sys.stderr,
    )
    return 0
