"""The few lines that end every run (the Snakefile's onsuccess and onerror call `print_summary`).

What the results folder holds at that moment, whatever the targets were (a partial run reports
the categories it reached): per category the prompts kept in the dataset, the rejections of every
stage by reason (truncated outputs that merge dropped are the `truncated` reason, also counted
on their own), and where the outputs and the report are. After a failed run, the guard messages
(tokenmill/guards.py) that the run's jobs wrote to their logs come first: the one line that
says why, instead of a log path to open.

A top-layer module, like workflow_support.py: it reads the results folder only.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from tokenmill import layout
from tokenmill.guards import GUARD_PREFIX

STAGES = layout.STAGES


def rejections(lay: layout.Layout, declared) -> dict[str, dict[str, Counter]]:
    """{category: {stage: Counter(reason)}} from the declared rejected files that exist."""
    out: dict[str, dict[str, Counter]] = {}
    for c, shards in declared.items():
        out[c] = {}
        for stage in STAGES:
            per_shard = stage in layout.PER_SHARD_STAGES
            paths = (
                [lay.rejected(stage, c, s) for s in shards]
                if per_shard
                else [lay.rejected(stage, c)]
            )
            for f in filter(lambda p: Path(p).exists(), paths):
                try:
                    reasons = pq.read_table(f, columns=["reason"]).column(0).to_pylist()
                except Exception:  # noqa: BLE001 - a file being written by a running job
                    continue
                out[c].setdefault(stage, Counter()).update(reasons)
    return out


def kept(lay: layout.Layout, declared) -> dict[str, int | None]:
    """Rows in the declared dataset shards of each category (None: no shard merged yet)."""
    out: dict[str, int | None] = {}
    for c, shards in declared.items():
        files = [p for p in (lay.dataset(c, s) for s in shards) if Path(p).exists()]
        out[c] = sum(pq.read_metadata(f).num_rows for f in files) if files else None
    return out


def guard_failures(results: Path, since: float) -> list[str]:
    """The guard lines in the run's job logs (results/logs, written since `since`)."""
    lines = []
    for log in sorted((results / "logs").rglob("*.log")):
        try:
            if log.stat().st_mtime < since:
                continue
            text = log.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        lines += [line.strip() for line in text.splitlines() if line.startswith(GUARD_PREFIX)]
    return lines


def summary_lines(
    lay: layout.Layout, settings, ok: bool, since: float = 0.0, retired=()
) -> list[str]:
    results = Path(lay.results)
    declared = layout.declared(settings)
    categories = list(declared)
    lines = []
    failures = guard_failures(results, since) if not ok else []
    lines += failures
    head = "tokenmill: run finished" if ok else "tokenmill: run FAILED"
    lines.append(head + "; per category:")
    rej = rejections(lay, declared)
    rows = kept(lay, declared)
    total_truncated = 0
    for c in categories:
        stages = rej[c]
        truncated = stages.get("merge", Counter()).get("truncated", 0)
        total_truncated += truncated
        n_rej = sum(sum(s.values()) for s in stages.values())
        parts = [
            f"{stage} " + ", ".join(f"{r} {n}" for r, n in sorted(stages[stage].items()))
            for stage in STAGES
            if stages.get(stage)
        ]
        k = "not merged yet" if rows[c] is None else f"{rows[c]} kept"
        if any(f"category '{c}'" in f for f in failures):
            k = "stopped by its guard (above)"
        line = f"  {c}: {k}, {n_rej} rejected"
        if parts:
            line += " (" + "; ".join(parts) + ")"
        if truncated:
            line += f"; {truncated} truncated at max_new_tokens (dropped at merge)"
        lines.append(line)
    lines += [f"  retired: {r.removeprefix('tokenmill: ')}" for r in retired]
    if not ok:
        lines.append(f"  job logs: {results / 'logs'}")
        return lines
    dataset = Path(lay.dataset_dir())
    where = [f"dataset {dataset}" + ("" if dataset.is_dir() else " (not written yet)")]
    for name, path in (("statistics", lay.stats_table()), ("provenance", lay.provenance())):
        if Path(path).exists():
            where.append(f"{name} {path}")
    report = Path(lay.report())
    where.append(
        f"report {report}"
        + (
            ""
            if report.exists()
            else f" (not made yet: the same command with --report {report}, as make demo does)"
        )
    )
    if total_truncated:
        lines.append(
            f"  {total_truncated} outputs were truncated at generation.sampling.max_new_tokens "
            "(`tokenmill plan --pilot N` tells the max_new_tokens that keeps a given share)"
        )
    lines.append("  outputs: " + ", ".join(where))
    return lines


def print_summary(
    lay: layout.Layout, settings, ok: bool, since: float = 0.0, retired=(), file=None
) -> None:
    """Print the run's summary (never raises: a summary must not hide the run's own result)."""
    file = file or sys.stderr
    try:
        text = "\n".join(summary_lines(lay, settings, ok, since, retired))
    except Exception as exc:  # noqa: BLE001
        text = f"tokenmill: no run summary ({type(exc).__name__}: {exc})"
    print(text, file=file, flush=True)


def started() -> float:
    """The time a run started (guard lines in logs older than this are an earlier run's)."""
    return time.time()
