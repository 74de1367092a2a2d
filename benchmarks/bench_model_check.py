"""What the full-content model check costs, the first time and the next (issue 19 item 8).

    python benchmarks/bench_model_check.py [--files 4] [--mib 128]

Two directories (ours and a copy, the server's) of config.json + FILES weight files of MIB MiB
each. Floor, measured in the same run: one plain streamed read of both directories (4 MiB
reads, no hashing; the files are in the page cache after being written). Then
`generate.launch.check_model` on the copy: the first check (empty digest cache: sha256 of every
byte of both sides), a second check in a new process (digests from the cache), and a hub-cache
snapshot (links to blobs/<sha256>) against the copy. Prints seconds, the ratio of the first
check to the floor, and how many files each check read. No asserts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenmill import model
from tokenmill.engines import launch


def _write(d: Path, files: int, mib: int) -> None:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"vocab_size": 1000, "model_type": "qwen2"}))
    for i in range(files):
        block = hashlib.sha256(str(i).encode()).digest() * (1 << 15)  # 1 MiB
        with open(d / f"model-{i:05d}.safetensors", "wb") as f:
            for _ in range(mib):
                f.write(block)


def _plain_read(dirs: list[Path]) -> float:
    buf = bytearray(model.HASH_CHUNK)
    t0 = time.perf_counter()
    for d in dirs:
        for p in sorted(d.iterdir()):
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    return time.perf_counter() - t0


def _check(copy: Path, base: Path, ours: str = "ours") -> tuple[float, int]:
    reads: list[str] = []
    real = model.hash_file
    model.hash_file = lambda p: reads.append(str(p)) or real(p)
    try:
        t0 = time.perf_counter()
        how = launch.check_model({"model_path": str(copy)}, {}, {"model": ours}, base)
        wall = time.perf_counter() - t0
    finally:
        model.hash_file = real
    assert "same config.json" in how, how
    return wall, len(reads)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=4)
    p.add_argument("--mib", type=int, default=128)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        os.environ[model.CACHE_ENV] = str(base / "cache")
        ours, copy = base / "ours", base / "server" / "copy"
        _write(ours, a.files, a.mib)
        shutil.copytree(ours, copy)
        total = 2 * a.files * a.mib
        floor = min(_plain_read([ours, copy]) for _ in range(2))
        cold, cold_reads = _check(copy, base)
        code = (
            "import sys, time; from tokenmill import model; from tokenmill.engines import launch\n"
            "model.hash_file = lambda p: sys.exit(f'read {p}')\n"
            "t0 = time.perf_counter()\n"
            f"launch.check_model({{'model_path': {str(copy)!r}}}, {{}}, {{'model': 'ours'}}, "
            f"{str(base)!r})\n"
            "print(time.perf_counter() - t0)"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        if out.returncode:
            print(out.stderr, file=sys.stderr)
            return 1
        warm = float(out.stdout.split()[-1])
        # a hub snapshot of the same files against the copy (the copy's digests are cached now)
        repo = base / "hub" / "models--org--ours"
        snap = repo / "snapshots" / "rev"
        (repo / "blobs").mkdir(parents=True)
        snap.mkdir(parents=True)
        for f in sorted(ours.iterdir()):
            sha = hashlib.sha256(f.read_bytes()).hexdigest()
            os.link(f, repo / "blobs" / sha)
            (snap / f.name).symlink_to(f"../../blobs/{sha}")
        shutil.rmtree(base / "cache")
        hub, hub_reads = _check(copy, base, str(snap))
    print(f"{a.files} files x {a.mib} MiB per side ({total} MiB read by a cold check)")
    print(f"floor (plain read of both sides):   {floor:6.2f} s  {total / floor:7.0f} MiB/s")
    print(f"first check (sha256 of every byte): {cold:6.2f} s  {total / cold:7.0f} MiB/s, "
          f"{cold / floor:5.2f}x the floor, "
          f"{cold_reads} files read")  # fmt: skip
    print(f"second check, new process (cache):  {warm:6.3f} s  0 files read")
    print(f"copy vs hub snapshot, empty cache:  {hub:6.2f} s  {hub_reads} files read "
          f"(the copy's {a.files + 1}; the snapshot's weights by blob name)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
