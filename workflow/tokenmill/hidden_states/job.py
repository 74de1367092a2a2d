"""One hidden_states job: every kept row of one dataset shard, exactly once across kills.

Order of work:
1. read the shard's rows (row i = the i-th row of the dataset shard, see layout.py);
2. open the shard's journal (`{journal_dir}/hidden_states/{category}/{shard}.jsonl`, outside
   the results: Snakemake deletes a failed job's outputs). Its first line is the stage
   fingerprint (model weights, layer ids, dtype, backend); a journal of another fingerprint is
   started afresh. Each later line is one finished row: {i, key (a hash of its input_ids and
   loss_mask), files {path: [size, sha256]}};
3. a row is done when the journal lists it with the same key and each of its files exists
   with the journaled size; every other row is computed, its files written atomically
   (temporary file, fsync, rename), then its journal line appended and fsynced. A kill between
   a rename and the journal line leaves a complete file that the next run rewrites with the
   same bytes: one file per row, never a partial one. The backend cuts its batches from all
   rows of the shard, so a row is computed in the same batch whether or not the job was
   killed before (hf.py): a resumed job writes the bytes of an uninterrupted one;
4. files of no current row (a shard that shrank), temporary files and `.lock` files are
   removed; the speculators rows folder is written (save_to_disk, deterministic);
5. manifest.json (the rule's output, written last and atomically) lists every file with its
   size and sha256.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from tokenmill import contracts, keys
from tokenmill.hidden_states import layout

log = logging.getLogger("tokenmill.hidden_states")


row_key = keys.row_key  # the one owner: keys.py


def read_rows(dataset: Path):
    """(input_ids, loss_mask) numpy arrays of every row of a dataset shard, in file order."""
    t = pq.read_table(dataset, columns=["input_ids", "loss_mask"])
    ids, ioff = contracts.list_arrays(t.column("input_ids"), dtype="<i8")
    mask, moff = contracts.list_arrays(t.column("loss_mask"), dtype="<i8")
    return [(ids[ioff[i] : ioff[i + 1]], mask[moff[i] : moff[i + 1]]) for i in range(t.num_rows)]


class Journal:
    """The shard's finished rows (see the module docstring), append-only."""

    def __init__(self, path: Path, fingerprint: dict):
        self.path = path
        self.fingerprint = fingerprint
        self.done: dict[int, dict] = {}
        path.parent.mkdir(parents=True, exist_ok=True)
        header = keys.journal_header(fingerprint)
        lines = path.read_text().splitlines() if path.exists() else []
        if lines and lines[0] == header:
            for line in lines[1:]:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line torn by a kill: its row is recomputed
                self.done[rec["i"]] = rec
        else:
            if lines:
                log.info("journal %s: another fingerprint, starting afresh", path)
            contracts_tmp = contracts.atomic_path(path)
            contracts_tmp.write_text(header + "\n")
            os.replace(contracts_tmp, path)
        self._fh = open(path, "a")  # noqa: SIM115 - closed by close()
        self._lock = threading.Lock()

    def add(self, i: int, key: str, files: dict[str, list]) -> None:
        """Append one row's line, fsynced (from any writer thread: one line at a time)."""
        rec = {"i": i, "key": key, "files": files}
        with self._lock:
            self._fh.write(contracts.canonical_json(rec) + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self.done[i] = rec

    def close(self) -> None:
        self._fh.close()


def is_done(rec: dict | None, key: str, out_dir: Path, wanted: list[str]) -> bool:
    if rec is None or rec.get("key") != key or sorted(rec.get("files", {})) != sorted(wanted):
        return False
    for rel, (size, _sha) in rec["files"].items():
        p = out_dir / rel
        if not p.is_file() or p.stat().st_size != size:
            return False
    return True


def clean_leftovers(out_dir: Path, keep: set[str] | None = None) -> list[str]:
    """Remove temporary and lock files (and, given `keep`, every file not in it)."""
    removed = []
    if not out_dir.is_dir():
        return removed
    for p in sorted(out_dir.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(out_dir).as_posix()
        stale = keep is not None and rel not in keep and rel != layout.MANIFEST
        if layout.is_leftover(p.name) or stale:
            p.unlink()
            removed.append(rel)
    for d in sorted((p for p in out_dir.rglob("*") if p.is_dir()), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    return removed


def write_rows_folder(out_dir: Path, rows, fingerprint: str) -> list[str]:
    """speculators' rows: a `datasets` save_to_disk folder (input_ids, loss_mask, seq_len; torch
    format), written beside its hidden_states/ folder. The dataset's fingerprint is fixed (the
    shard's content hash) so state.json is deterministic."""
    import datasets
    import pyarrow as pa

    table = pa.table(
        {
            "input_ids": pa.array([r[0] for r in rows], type=pa.list_(pa.int64())),
            "loss_mask": pa.array([r[1] for r in rows], type=pa.list_(pa.int64())),
            "seq_len": pa.array([len(r[0]) for r in rows], type=pa.int64()),
        }
    )
    ds = datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint=fingerprint)
    ds.set_format(type="torch")  # as speculators' own prepare-data saves it (its loader
    # compares token_ids with input_ids as tensors)
    final = out_dir / "speculators"
    final.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".tmp-rows-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    datasets.disable_progress_bars()
    ds.save_to_disk(str(tmp))
    names = sorted(p.name for p in tmp.iterdir())
    for name in names:
        os.replace(tmp / name, final / name)
    tmp.rmdir()
    return [f"speculators/{n}" for n in names]


def run_shard(
    *,
    category: str,
    shard: str,
    dataset: Path,
    out_dir: Path,
    journal_path: Path,
    backend_factory,
    fingerprint: dict,
    layouts: tuple[str, ...],
    batch_tokens: int,
    max_batch_rows: int | str,
    describe: dict,
) -> dict:
    """Write the shard's files (see the module docstring); returns the manifest and what was
    computed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_leftovers(out_dir)
    rows = read_rows(dataset)
    row_keys = [row_key(ids, mask) for ids, mask in rows]
    journal = Journal(journal_path, fingerprint)
    wanted = {i: [layout.row_path(lay, i) for lay in layouts] for i in range(len(rows))}
    todo = [
        i
        for i in range(len(rows))
        if not is_done(journal.done.get(i), row_keys[i], out_dir, wanted[i])
    ]
    log.info(
        "%s/%s: %d rows, %d already done, %d to compute",
        category, shard, len(rows), len(rows) - len(todo), len(todo),
    )  # fmt: skip
    t0 = time.monotonic()
    tokens = 0
    with contextlib.ExitStack() as stack:
        stack.callback(journal.close)
        if todo:
            backend = backend_factory()
            stack.callback(backend.close)
            writer = stack.enter_context(
                RowWriter(out_dir, journal, layouts, batch_tokens, writer_threads(layouts))
            )
            all_ids = {i: r[0].tolist() for i, r in enumerate(rows)}
            for rs in backend.run(all_ids, todo, batch_tokens, max_batch_rows):
                ids, mask = rows[rs.index]
                writer.put(rs, ids, mask, row_keys[rs.index])
                tokens += len(ids)
    wall = time.monotonic() - t0
    if todo:
        log.info("%d rows, %d tokens in %.1f s", len(todo), tokens, wall)
    keep = {rel for rels in wanted.values() for rel in rels}
    if "speculators" in layouts:
        keep |= {f"speculators/{n}" for n in layout.ROWS_FILES}
    removed = clean_leftovers(out_dir, keep)
    if removed:
        log.info("removed %d stale or temporary files", len(removed))
    shard_hash = hashlib.sha256("".join(row_keys).encode()).hexdigest()[:32]
    if "speculators" in layouts:
        write_rows_folder(out_dir, rows, shard_hash)
    files = []
    for rel in sorted(keep):
        rec = None
        i = layout.row_index(rel)
        if i is not None:
            rec = journal.done[i]["files"].get(rel)
        size, sha = rec if rec else (None, None)
        p = out_dir / rel
        if size is None or p.stat().st_size != size:
            size, sha = p.stat().st_size, contracts.sha256_file(p)
        files.append(contracts.ManifestFile(path=rel, size=size, sha256=sha))
    manifest = contracts.HiddenStatesManifest(
        category=category,
        shard=shard,
        rows=len(rows),
        tokens=int(sum(len(r[0]) for r in rows)),
        rows_key=shard_hash,
        fingerprint=fingerprint,
        layouts=list(layouts),
        layer_ids=list(describe["layer_ids"]),
        dtype=describe["dtype"],
        bytes=sum(f.size for f in files),
        files=files,
    )
    text = json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n"
    layout.write_atomic(out_dir / layout.MANIFEST, text.encode())
    return manifest, Work(rows=len(todo), tokens=tokens, seconds=round(wall, 3))


def writer_threads(layouts) -> int:
    """Threads writing rows: one, or for gzipped rows every CPU the job has but one (gzip makes
    about 33 MB/s of a row's bytes per core, benchmarks/bench_ckpt_gzip.py, far below what a
    GPU computes; zlib releases the GIL)."""
    if not any(layout.is_gzipped(lay) for lay in layouts):
        return 1
    return max(1, len(os.sched_getaffinity(0)) - 1)


class RowWriter:
    """Writes rows' files and journal lines on background threads (writer_threads) while the
    backend computes the next batch: serializing, hashing and fsyncing a batch's files overlaps
    the next forward instead of adding to it (the forward releases the GIL). A row's journal
    line follows its files. At most `max_tokens` tokens' states wait (one batch's worth; at
    least one row), so host memory stays at about two batches, and a slow writer holds the
    forward back. A write's error is raised by the next `put` or on exit; on exit every row
    given is written and journaled first."""

    def __init__(self, out_dir: Path, journal: Journal, layouts, max_tokens: int, threads=1):
        self.out_dir, self.journal, self.layouts = out_dir, journal, tuple(layouts)
        self.max_tokens = max_tokens
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="hs-writer")
        self._pending: deque = deque()  # (future, tokens), oldest first
        self._tokens = 0

    def __enter__(self) -> RowWriter:
        return self

    def __exit__(self, *exc) -> None:
        try:
            while self._pending:
                self._wait_oldest()
        finally:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def put(self, rs, ids, mask, key: str) -> None:
        n = len(ids)
        while self._pending and self._tokens + n > self.max_tokens:
            self._wait_oldest()
        self._pending.append((self._pool.submit(self._write, rs, ids, mask, key), n))
        self._tokens += n

    def _wait_oldest(self) -> None:
        future, n = self._pending.popleft()
        self._tokens -= n
        future.result()

    def _write(self, rs, ids, mask, key: str) -> None:
        import torch

        files = {}
        t_ids = torch.from_numpy(ids.copy())
        for lay in self.layouts:
            if lay == "speculators":
                data = layout.speculators_bytes(t_ids, rs.states)
            else:
                n, h = rs.states.shape[1], rs.states.shape[2]
                aux = rs.states[:, :-1].reshape(-1, (n - 1) * h)
                data = layout.specforge_bytes(
                    t_ids,
                    torch.from_numpy(mask.copy()),
                    rs.normed_last().unsqueeze(0),
                    aux.unsqueeze(0),
                    gzipped=layout.is_gzipped(lay),
                )
            rel = layout.row_path(lay, rs.index)
            (self.out_dir / rel).parent.mkdir(parents=True, exist_ok=True)
            layout.write_atomic(self.out_dir / rel, data)
            files[rel] = [len(data), hashlib.sha256(data).hexdigest()]
        self.journal.add(rs.index, key, files)


@dataclass(frozen=True)
class Work:
    """What a job computed (not what it found done): rows, their tokens, the seconds it took."""

    rows: int
    tokens: int
    seconds: float


def verify_shard(out_dir: Path) -> list[str]:
    """Problems of a shard folder against its manifest (missing, size or sha256 differs,
    files it does not list)."""
    manifest = contracts.HiddenStatesManifest.read(out_dir / layout.MANIFEST)
    problems = []
    listed = {f.path: f for f in manifest.files}
    for rel, f in sorted(listed.items()):
        p = out_dir / rel
        if not p.is_file():
            problems.append(f"missing: {rel}")
        elif p.stat().st_size != f.size or contracts.sha256_file(p) != f.sha256:
            problems.append(f"differs: {rel}")
    for p in sorted(out_dir.rglob("*")):
        rel = p.relative_to(out_dir).as_posix()
        if p.is_file() and rel not in listed and rel != layout.MANIFEST:
            problems.append(f"not listed: {rel}")
    return problems
