"""`tokenmill status`: how far a run's generation is, from the files alone.

Per declared shard: prompts planned (its tokenized shard), answers journaled or written, its
state and, for a shard that failed, the cause its job recorded. Overall: rows done of planned,
the rate of the attempts running now and the time left at that rate, the output tokens per
second of the finished shards. It reads the journal (generate/journal.py), the jobs' attempt
records (jobs/harness.py) and the generate job records (contracts.GenerateJobRecord), never
SLURM: it works during a run (local or on SLURM, from any machine that sees the folders) and
after it. The controller prints `progress_line` while generate jobs run (the Snakefile).

A top-layer module, like run_summary.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pyarrow.parquet as pq

from tokenmill import contracts, layout
from tokenmill.generate.journal import ShardJournal
from tokenmill.jobs import harness
from tokenmill.keys import generation_fingerprint

STALE_HEARTBEATS = 3  # a "running" attempt silent for this many heartbeats was killed


@dataclass(frozen=True)
class ShardStatus:
    category: str
    shard: str
    planned: int | None  # prompts (conversations) to answer; None: not tokenized yet
    done: int  # answered: written, or journaled so far
    state: str  # done | running | failed | waiting | not tokenized | to regenerate
    cause: str | None = None
    rows_per_s: float | None = None  # a running attempt's rate since it started
    output_tokens: int | None = None  # a written shard's
    generation_s: float | None = None
    turns: bool = False  # a conversation shard (context: regenerated): its journal has turns

    @property
    def answered(self) -> int:
        """Prompts (conversations) answered: a conversation counts once its shard is written."""
        if self.turns:
            return (self.planned or 0) if self.state == "done" else 0
        return self.done


def _journaled(journal_dir: str, category: str, shard: str) -> int:
    """Answers in the shard's journal: the compacted file's rows and the JSONL files' lines
    (one answered prompt each; a torn last line aside)."""
    j = ShardJournal(journal_dir, category, shard)
    n = 0
    if j.live.is_file():
        n += pq.read_metadata(j.live).num_rows
    return n + sum(_lines(p) for p in j.jsonl_files())


# A journal file is append-only while its job runs: the controller's progress line, asked
# every minute, reads only what was appended since (path -> (inode, bytes read, newlines)).
_COUNTED: dict[str, tuple[int, int, int]] = {}


def _lines(path: Path) -> int:
    """Newlines in `path`, reading only the bytes appended since the last call."""
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed below; absent: compacted since listed
    except FileNotFoundError:
        _COUNTED.pop(str(path), None)
        return 0
    with f:
        st = os.fstat(f.fileno())
        inode, offset, n = _COUNTED.get(str(path), (st.st_ino, 0, 0))
        if inode != st.st_ino or st.st_size < offset:  # another file under that name: recount
            offset, n = 0, 0
        f.seek(offset)
        for chunk in iter(lambda: f.read(1 << 20), b""):
            n += chunk.count(b"\n")
            offset += len(chunk)
    _COUNTED[str(path)] = (st.st_ino, offset, n)
    return n


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def shard_status(lay, settings, category: str, shard: str, now: float) -> ShardStatus:
    tokenized = Path(lay.tokenized(category, shard))
    planned = pq.read_metadata(tokenized).num_rows if tokenized.is_file() else None
    turns = settings.categories[category].regenerated
    record_path = Path(lay.generate_record(category, shard))
    if record_path.is_file() and Path(lay.generated(category, shard)).is_file():
        rec = contracts.GenerateJobRecord.read(record_path)
        if rec.generation_fingerprint == generation_fingerprint(settings.generation):
            n = pq.read_metadata(lay.generated(category, shard)).num_rows
            total = planned if planned is not None else n  # a conversation shard: n turns
            return ShardStatus(category, shard, total, total, "done",
                               output_tokens=rec.counts.output_tokens,
                               generation_s=rec.timing.generation_s, turns=turns)  # fmt: skip
        state = "to regenerate"
    else:
        state = "waiting" if planned is not None else "not tokenized"
    done = _journaled(lay.journal, category, shard)
    if planned is not None and not turns:
        done = min(done, planned)  # records of edited prompts stay in the journal a while
    attempts = harness.read_attempts(lay.attempts("generate", category, shard))
    if not attempts:
        return ShardStatus(category, shard, planned, done, state, turns=turns)
    last = attempts[-1]
    beat = settings.jobs.heartbeat_s
    if (
        last.status == "running"
        and now - (_ts(last.started) + last.wall_s) < STALE_HEARTBEATS * beat
    ):
        rate = _attempt_rows(lay, category, shard, last) / max(now - _ts(last.started), 1e-9)
        return ShardStatus(category, shard, planned, done, "running", rows_per_s=rate,
                           turns=turns)  # fmt: skip
    if last.status == "ok":
        return ShardStatus(category, shard, planned, done, state, turns=turns)
    cause = last.cause or harness.KILLED_CAUSE
    if last.status == "running":
        cause = harness.KILLED_CAUSE
    failure = Path(lay.failure_record("generate", category, shard))
    if failure.is_file():
        cause = f"{cause} (a deterministic failure: not retried until the config changes)"
    return ShardStatus(category, shard, planned, done, "failed", cause, turns=turns)


def _attempt_rows(lay, category: str, shard: str, attempt) -> int:
    """Lines the running attempt journaled: its own JSONL file ({shard}.{host}.{pid}.*)."""
    j = ShardJournal(lay.journal, category, shard)
    own = [
        p for p in j.jsonl_files() if p.name.startswith(f"{shard}.{attempt.host}.{attempt.pid}.")
    ]
    return sum(_lines(p) for p in own)


def collect(settings, now: float | None = None) -> list[ShardStatus]:
    lay = layout.Layout.of(settings)
    now = time.time() if now is None else now
    return [
        shard_status(lay, settings, c, s, now)
        for c, shards in layout.declared(settings).items()
        for s in shards
    ]


def run_stopped(settings) -> str | None:
    """The run-wide failure every generate job with this config stops on (jobs/harness.py)."""
    from tokenmill.generate import failure

    path = layout.Layout.of(settings).run_failure_record("generate")
    return harness.shared_failure(path, failure.run_identity(settings.generation), ("", ""))


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h} h {m:02d} min" if h else (f"{m} min {s:02d} s" if m else f"{s} s")


def totals(rows: list[ShardStatus]) -> dict:
    planned = [r.planned for r in rows]
    known = [p for p in planned if p is not None]
    done = sum(r.answered for r in rows)
    # prompt shards only: a conversation shard's journal counts turns, not conversations
    rate = sum(r.rows_per_s or 0.0 for r in rows if r.state == "running" and not r.turns)
    finished = [r for r in rows if r.state == "done" and r.generation_s]
    tokens_per_s = (
        sum(r.output_tokens or 0 for r in finished) / sum(r.generation_s for r in finished)
        if finished
        else None
    )
    untokenized = sum(p is None for p in planned)
    left = sum(known) - sum(r.answered for r in rows if r.planned is not None)
    return {
        "done": done,
        "planned": sum(known),
        "untokenized_shards": untokenized,
        "running": sum(r.state == "running" for r in rows),
        "failed": [r for r in rows if r.state == "failed"],
        "rows_per_s": rate if rate > 0 else None,
        "time_left_s": left / rate if rate > 0 and not untokenized else None,
        "output_tokens_per_s": tokens_per_s,
    }


def progress_line(rows: list[ShardStatus]) -> str:
    t = totals(rows)
    planned = f"{t['planned']:,}" + (
        f" (+ {t['untokenized_shards']} shards not tokenized yet)"
        if t["untokenized_shards"]
        else ""
    )
    share = f" ({t['done'] / t['planned']:.0%})" if t["planned"] else ""
    parts = [f"tokenmill: generate {t['done']:,} of {planned} prompts answered{share}"]
    shards_done = sum(r.state == "done" for r in rows)
    parts.append(f"{shards_done}/{len(rows)} shards done, {t['running']} running")
    if t["rows_per_s"]:
        parts.append(f"{t['rows_per_s']:.1f} prompts/s now")
    if t["time_left_s"] is not None:
        parts.append(f"about {_duration(t['time_left_s'])} left at this rate")
    if t["output_tokens_per_s"]:
        parts.append(f"{t['output_tokens_per_s']:,.0f} output tokens/s (finished shards)")
    if t["failed"]:
        parts.append(f"{len(t['failed'])} failed")
    return ", ".join(parts)


def table_lines(rows: list[ShardStatus]) -> list[str]:
    head = ("category", "shard", "answered", "planned", "state", "answers/s")
    body = [
        (r.category, r.shard,
         f"{r.done:,} turns" if r.turns and r.state != "done" else f"{r.done:,}",
         "?" if r.planned is None else f"{r.planned:,}",
         r.state, f"{r.rows_per_s:.2f}" if r.rows_per_s is not None else "")
        for r in rows
    ]  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        c.rjust(w) if i in (2, 3, 5) else c.ljust(w)
        for i, (c, w) in enumerate(zip(cells, widths, strict=True))
    ).rstrip()
    out = [fmt(head)] + [fmt(b) for b in body]
    failed = [r for r in rows if r.state == "failed"]
    if failed:
        out += ["", "failed shards:"]
        out += [f"  {r.category}/{r.shard}: {r.cause}" for r in failed]
    return out


def main(argv: list[str]) -> int:
    from tokenmill.config import ConfigError, load_config
    from tokenmill.settings import Settings

    parser = argparse.ArgumentParser(
        prog="tokenmill status",
        description="How far the run's generation is: per shard and overall, from the "
        "journal and the jobs' records (during a run or after it).",
    )
    parser.add_argument("--configfile", default="config.yaml", help="the run's config")
    parser.add_argument("--watch", type=float, metavar="S", help="print again every S seconds")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_validated(load_config(args.configfile, "."))
    except (ConfigError, OSError) as exc:
        print(f"tokenmill status: {exc}", file=sys.stderr)
        return 1
    while True:
        rows = collect(settings)
        lines = table_lines(rows) + ["", progress_line(rows)]
        stopped = run_stopped(settings)
        if stopped:
            lines.append(f"tokenmill: the run's generate jobs stop: {stopped}")
        print("\n".join(lines), flush=True)
        if not args.watch:
            return 1 if any(r.state == "failed" for r in rows) else 0
        time.sleep(args.watch)
        print()


PROGRESS_S = 60.0  # the controller's progress line, at most this often (TOKENMILL_PROGRESS_S)


class Progress:
    """The controller's console progress: `progress_line` every PROGRESS_S seconds while a
    generate job runs, when it changed. Started by the Snakefile's onstart, stopped before the
    closing summary; a failure to read never stops the run (the line is skipped)."""

    def __init__(self, settings, interval_s: float | None = None, out=None):
        import threading

        env = os.environ.get("TOKENMILL_PROGRESS_S")
        self.interval_s = interval_s or (float(env) if env else PROGRESS_S)
        self.settings, self.out = settings, out or sys.stderr
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-progress", daemon=True)
        self.last: str | None = None

    def start(self) -> Progress:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():  # onerror may come before onstart started it
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                rows = collect(self.settings)
            except Exception:  # noqa: BLE001 - a file mid-write; the next tick reads it
                continue
            if not any(r.state == "running" for r in rows):
                continue
            line = progress_line(rows)
            if line != self.last:
                print(line, file=self.out, flush=True)
                self.last = line
