"""The few lines that end every run (the Snakefile's onsuccess and onerror call `print_summary`).

Built from what the config declares (layout.py) and what the jobs recorded, never from a listing
of the results folder:

- per category: the rows kept in its declared dataset shards, the rejections of every stage by
  reason (truncated outputs that merge dropped are the `truncated` reason, also counted on
  their own), and which of its jobs failed;
- what the controller retired before the first job (tokenmill/retire.py);
- after a failed run, LAST, so that it is on the screen when the run ends: every failed job with
  its stage, category, shard, cause and log. A GPU job's cause is its last attempt's
  (contracts.Attempt, jobs/harness.py: failed with the exception's line, refused after a
  deterministic failure, interrupted by a signal, or killed without a word); a CPU job's is
  the guard line its log holds (tokenmill/guards.py), else its log's last line. Jobs that fail
  the same way are one line (the first few named).

A top-layer module, like workflow_support.py: it reads the declared files and the records.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq

from tokenmill import layout
from tokenmill.guards import GUARD_PREFIX
from tokenmill.jobs import harness

STAGES = layout.STAGES
GPU_STAGES = ("generate", "hidden_states")
NAMED_PER_CAUSE = 3  # shards named in a line of jobs that failed the same way
MAX_CAUSE_LINES = 8


@dataclass(frozen=True)
class Failure:
    stage: str
    category: str | None
    shard: str | None
    cause: str
    log: str

    @property
    def where(self) -> str:
        return "/".join(p for p in (self.category, self.shard) if p) or "the run"


def rejections(lay: layout.Layout, declared) -> dict[str, dict[str, Counter]]:
    """{category: {stage: Counter(reason)}} from the declared rejected files that exist."""
    out: dict[str, dict[str, Counter]] = {}
    for c, shards in declared.items():
        out[c] = {}
        for stage in STAGES:
            if stage in layout.PER_SHARD_STAGES:
                paths = [lay.rejected(stage, c, s) for s in shards]
            else:
                paths = [lay.rejected(stage, c)]
            for f in filter(lambda p: Path(p).exists(), paths):
                try:
                    reasons = pq.read_table(f, columns=["reason"]).column(0).to_pylist()
                except Exception:  # noqa: BLE001 - a file being written by a running job
                    continue
                out[c].setdefault(stage, Counter()).update(reasons)
    return out


def kept(lay: layout.Layout, declared) -> dict[str, tuple[int, int]]:
    """{category: (rows in its declared dataset shards that exist, shards merged)}."""
    out: dict[str, tuple[int, int]] = {}
    for c, shards in declared.items():
        files = [p for p in (lay.dataset(c, s) for s in shards) if Path(p).exists()]
        out[c] = (sum(pq.read_metadata(f).num_rows for f in files), len(files))
    return out


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def gpu_failures(lay: layout.Layout, settings, since: float) -> list[Failure]:
    """The declared GPU jobs whose last attempt, started since `since`, did not end ok."""
    stages = [s for s in GPU_STAGES if s == "generate" or settings.hidden_states.enabled]
    out = []
    for stage in stages:
        for c, shards in layout.declared(settings).items():
            for s in shards:
                attempts = harness.read_attempts(lay.attempts(stage, c, s))
                if not attempts or attempts[-1].status == "ok":
                    continue
                last = attempts[-1]
                if _ts(last.started) + 1 < since and last.status != "running":
                    continue  # an earlier run's
                cause = last.cause or harness.KILLED_CAUSE
                if last.status == "running":
                    cause = harness.KILLED_CAUSE
                out.append(Failure(stage, c, s, cause, last.log))
    return out


def _cpu_jobs(lay: layout.Layout, settings):
    """(stage, category, shard, log, main output) of the declared CPU jobs."""
    for c, shards in layout.declared(settings).items():
        yield "prepare", c, None, lay.log("prepare", c), lay.prompts(c)
        yield "tokenize", c, None, lay.log("tokenize", c), lay.tokenized_dir(c)
        for s in shards:
            yield "merge", c, s, lay.log("merge", c, s), lay.dataset(c, s)
        yield "verdict", c, None, lay.log("verdict", c), lay.verdict(c)
        yield "token_counts", c, None, lay.log("token_counts", c), lay.category_counts(c)
    yield "token_facts", None, None, lay.log("token_facts"), lay.token_facts()
    yield "stats", None, None, lay.log("stats"), lay.stats_summary()
    yield "card", None, None, lay.log("card"), lay.card()
    yield "provenance", None, None, lay.log("provenance"), lay.provenance()


def cpu_failures(lay: layout.Layout, settings, since: float) -> list[Failure]:
    """The declared CPU jobs that ran since `since` (their log) and left no output: the guard
    line of their log, else its last line."""
    out = []
    for stage, c, s, log, output in _cpu_jobs(lay, settings):
        log_path = Path(log)
        try:
            if log_path.stat().st_mtime + 1 < since or Path(output).exists():
                continue
            text = log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        guard = [line for line in lines if line.startswith(GUARD_PREFIX)]
        cause = guard[0] if guard else (lines[-1] if lines else "no output and an empty log")
        out.append(Failure(stage, c, s, cause, log))
    return out


def failure_lines(failures: list[Failure]) -> list[str]:
    """One line per cause (jobs that failed the same way together), at most MAX_CAUSE_LINES."""
    groups: dict[tuple[str, str], list[Failure]] = {}
    for f in failures:
        groups.setdefault((f.stage, f.cause), []).append(f)
    n = len(failures)
    lines = [f"tokenmill: {n} job{'s' if n != 1 else ''} failed; the cause of each:"]
    for (stage, cause), fs in list(groups.items())[:MAX_CAUSE_LINES]:
        if len(fs) == 1:
            lines.append(f"  {stage} {fs[0].where}: {cause} (log {fs[0].log})")
            continue
        named = ", ".join(f.where for f in fs[:NAMED_PER_CAUSE])
        more = f" and {len(fs) - NAMED_PER_CAUSE} more" if len(fs) > NAMED_PER_CAUSE else ""
        lines.append(f"  {stage} {len(fs)} jobs ({named}{more}): {cause} (log {fs[0].log})")
    rest = list(groups)[MAX_CAUSE_LINES:]
    if rest:
        jobs = sum(len(groups[k]) for k in rest)
        lines.append(f"  and {jobs} more jobs with {len(rest)} other causes (tokenmill status)")
    return lines


def summary_lines(
    lay: layout.Layout, settings, ok: bool, since: float = 0.0, retired=()
) -> list[str]:
    declared = layout.declared(settings)
    failures = [] if ok else gpu_failures(lay, settings, since) + cpu_failures(lay, settings, since)
    head = "tokenmill: run finished" if ok else "tokenmill: run FAILED"
    lines = [head + "; per category:"]
    rej = rejections(lay, declared)
    rows = kept(lay, declared)
    total_truncated = 0
    for c, shards in declared.items():
        failed = Counter(f.stage for f in failures if f.category == c)
        # a failed stage's rejections are in its cause below (a guard removes its outputs): a
        # count from the files it left would contradict the guard's
        stages = {st: n for st, n in rej[c].items() if st not in failed}
        truncated = stages.get("merge", Counter()).get("truncated", 0)
        total_truncated += truncated
        n_rej = sum(sum(s.values()) for s in stages.values())
        parts = [
            f"{stage} " + ", ".join(f"{r} {n}" for r, n in sorted(stages[stage].items()))
            for stage in STAGES
            if stages.get(stage)
        ]
        n_kept, merged = rows[c]
        if merged == len(shards):
            k = f"{n_kept} kept"
        elif merged:
            k = f"{n_kept} kept in {merged} of {len(shards)} shards merged"
        else:
            k = "not merged yet"
        if failed:
            k = ", ".join(f"{st} failed ({n} job{'s' if n != 1 else ''}, cause below)"
                          for st, n in failed.items()) + f"; {k}"  # fmt: skip
            line = f"  {c}: {k}" + (f", {n_rej} rejected by the other stages" if n_rej else "")
        else:
            line = f"  {c}: {k}, {n_rej} rejected"
        if parts:
            line += " (" + "; ".join(parts) + ")"
        if truncated:
            line += f"; {truncated} truncated at max_new_tokens (dropped at merge)"
        lines.append(line)
    lines += [f"  retired: {r.removeprefix('tokenmill: ')}" for r in retired]
    if not ok:
        lines.append(f"  job logs: {Path(lay.results) / 'logs'}")
        if failures:
            lines += failure_lines(failures)
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
    """The time a run started (records and logs older than this are an earlier run's)."""
    return time.time()
