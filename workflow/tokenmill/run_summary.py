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

from tokenmill.guards import GUARD_PREFIX

STAGES = ("prepare", "tokenize", "generate", "merge")
REPORT = "report.html"


def _category_of(stage: str, path: Path, rejected_dir: Path) -> str:
    rel = path.relative_to(rejected_dir / stage)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def rejections(results: Path, categories) -> dict[str, dict[str, Counter]]:
    """{category: {stage: Counter(reason)}} from results/rejected/<stage>/..."""
    out: dict[str, dict[str, Counter]] = {c: {} for c in categories}
    rejected_dir = results / "rejected"
    for stage in STAGES:
        for f in sorted((rejected_dir / stage).rglob("*.parquet")):
            cat = _category_of(stage, f, rejected_dir)
            if cat not in out:
                continue
            try:
                reasons = pq.read_table(f, columns=["reason"]).column(0).to_pylist()
            except Exception:  # noqa: BLE001 - a file being written by a running job
                continue
            out[cat].setdefault(stage, Counter()).update(reasons)
    return out


def kept(results: Path, categories) -> dict[str, int | None]:
    """Rows in results/dataset/<category>/*.parquet (None: no shard merged yet)."""
    out: dict[str, int | None] = {}
    for c in categories:
        files = sorted((results / "dataset" / c).glob("*.parquet"))
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


def summary_lines(results: str | Path, categories, ok: bool, since: float = 0.0) -> list[str]:
    results = Path(results)
    lines = []
    failures = guard_failures(results, since) if not ok else []
    lines += failures
    head = "tokenmill: run finished" if ok else "tokenmill: run FAILED"
    lines.append(head + "; per category:")
    rej = rejections(results, categories)
    rows = kept(results, categories)
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
    if not ok:
        lines.append(f"  job logs: {results / 'logs'}")
        return lines
    dataset = results / "dataset"
    where = [f"dataset {dataset}" + ("" if dataset.is_dir() else " (not written yet)")]
    for name, path in (
        ("statistics", results / "stats" / "summary.md"),
        ("provenance", results / "provenance.json"),
    ):
        if path.exists():
            where.append(f"{name} {path}")
    report = results / REPORT
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


def print_summary(results, categories, ok: bool, since: float = 0.0, file=None) -> None:
    """Print the run's summary (never raises: a summary must not hide the run's own result)."""
    file = file or sys.stderr
    try:
        text = "\n".join(summary_lines(results, sorted(categories), ok, since))
    except Exception as exc:  # noqa: BLE001
        text = f"tokenmill: no run summary ({type(exc).__name__}: {exc})"
    print(text, file=file, flush=True)


def started() -> float:
    """The time a run started (guard lines in logs older than this are an earlier run's)."""
    return time.time()
