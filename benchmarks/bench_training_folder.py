"""Time and peak memory of building the run's hidden-states training folder
(hidden_states/training.py), against a floor measured in the same run.

    python benchmarks/bench_training_folder.py [--shards 100] [--rows 2000] [--tokens 2000]

Writes --shards shard folders of --rows rows each (both layouts) as the stage leaves them: the
row files empty (a link costs the same whatever its target holds), the speculators rows folder
with rows of --tokens token ids, and manifest.json. Then, each in a fresh process (peak RSS
from /usr/bin/time's %M):
- floor: a bare loop making the same number of symlinks in an empty folder, then one copy of
  the shards' rows Arrow files into one file, fsynced (the bytes the rows folder must hold);
- first build: `tokenmill hidden-states-folder` over every shard, into an empty folder;
- rebuild, nothing changed (every link checked, none made; the rows folder kept);
- rebuild after the first shard lost a row: every later row moves down one number (all links
  but the first shard's remade) and the rows folder is rewritten.
Prints seconds, links per second and each build's time over the floor; no asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenmill import contracts
from tokenmill.hidden_states import job, layout

BIN = Path(sys.executable).parent
LAYOUTS = ("speculators", "specforge")


def write_shard(root: Path, category: str, shard: str, rows: int, tokens: int, seed: int):
    out = root / "hidden_states" / category / shard
    rng = np.random.default_rng(seed)
    data = [
        (rng.integers(0, 100_000, tokens, dtype=np.int64), np.ones(tokens, dtype=np.int64))
        for _ in range(rows)
    ]
    files = []
    for i in range(rows):
        for lay in LAYOUTS:
            p = out / layout.row_path(lay, i)
            p.parent.mkdir(parents=True, exist_ok=True)
            p.touch()
            files.append(contracts.ManifestFile(layout.row_path(lay, i), 0, ""))
    key = f"{category}-{shard}-{rows}"
    for rel in job.write_rows_folder(out, data, key):
        files.append(contracts.ManifestFile(rel, (out / rel).stat().st_size, ""))
    m = contracts.HiddenStatesManifest(
        category=category, shard=shard, rows=rows, tokens=rows * tokens, rows_key=key,
        fingerprint={}, layouts=list(LAYOUTS), layer_ids=[2, 16, 29, 32], dtype="bfloat16",
        bytes=0, files=files,
    )  # fmt: skip
    (out / layout.MANIFEST).write_text(json.dumps(m.to_json()))
    return out / layout.MANIFEST


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """(seconds, peak RSS in KiB, stdout) of a fresh process."""
    t0 = time.perf_counter()
    p = subprocess.run(
        ["/usr/bin/time", "-f", "MAXRSS %M", *cmd], capture_output=True, text=True, check=False
    )
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(p.stdout + p.stderr)
    rss = int(re.search(r"MAXRSS (\d+)", p.stderr).group(1))
    return dt, rss, p.stdout


FLOOR = """
import os, shutil, sys
root, n, arrows = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
for lay in ("a", "b"):
    for g in range(0, n, 2000):
        d = os.path.join(root, lay, str(g))
        os.makedirs(d)
        for i in range(g, min(g + 2000, n)):
            os.symlink(f"../../../x/{i}", os.path.join(d, str(i)))
with open(os.path.join(root, "rows.arrow"), "wb") as out:
    for a in arrows:
        with open(a, "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)
    os.fsync(out.fileno())
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=100)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-training-"))
    try:
        t0 = time.perf_counter()
        manifests = [
            write_shard(root, f"c{s % 4}", f"{s // 4:03d}", args.rows, args.tokens, s)
            for s in range(args.shards)
        ]
        manifests.sort()
        rows = args.shards * args.rows
        links = rows * len(LAYOUTS)
        print(f"{args.shards} shards x {args.rows} rows x {args.tokens} tokens: {rows} rows, "
              f"{links} links (setup {time.perf_counter() - t0:.0f} s)")  # fmt: skip
        out = root / "hidden_states" / "all"
        build = [str(BIN / "tokenmill"), "hidden-states-folder", "--out", str(out)]
        build += [str(m) for m in manifests]
        floor_dir = root / "floor"
        floor_dir.mkdir()
        arrows = [str(m.parent / "speculators" / layout.ROWS_FILES[0]) for m in manifests]
        floor_cmd = [sys.executable, "-c", FLOOR, str(floor_dir), str(rows), *arrows]
        floor, floor_rss, _ = timed(floor_cmd)
        results = [("floor: symlink loop + copy of the rows", floor, floor_rss, "")]
        dt, rss, so = timed(build)
        results.append(("first build", dt, rss, so.splitlines()[0]))
        dt, rss, so = timed(build)
        results.append(("rebuild, nothing changed", dt, rss, so.splitlines()[0]))
        # the first shard loses its last row: everything after it moves down one number
        first = contracts.HiddenStatesManifest.read(manifests[0])
        shutil.rmtree(manifests[0].parent)
        write_shard(root, first.category, first.shard, args.rows - 1, args.tokens, 0)
        dt, rss, so = timed(build)
        results.append(("rebuild, first shard one row shorter", dt, rss, so.splitlines()[0]))
        print(f"{'':40} {'seconds':>8} {'links/s':>9} {'x floor':>8} {'peak MiB':>9}")
        for name, dt, rss, _ in results:
            print(f"{name:40} {dt:8.1f} {links / dt:9.0f} {dt / floor:8.2f} {rss / 1024:9.0f}")
        for name, *_, line in results[1:]:
            print(f"  {name}: {line}")
        du = subprocess.run(["du", "-sk", str(out)], capture_output=True, text=True).stdout
        print(f"training folder on disk: {int(du.split()[0]) / 1024:.0f} MiB "
              f"(rows folder and link inodes)")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    raise SystemExit(main())
