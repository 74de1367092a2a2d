"""Model identity and vocabulary size, read from the model's files on this machine.

A model is named by generation.model: a local directory (relative to the base directory) or a
Hugging Face hub id, found in the local cache (never downloaded). Its config.json gives the
vocabulary size (tokenize and the draft vocabulary bound token ids by it; generate checks it).

Two copies of a model are compared by full content (`content_difference`, which
engines/launch.py's model check uses): config.json and every weight file, by name, size and
sha256 of all their bytes. A file's sha256 is computed once (streamed, HASH_CHUNK at a time)
and cached on disk by (resolved path, size, mtime_ns, inode) in `cache_dir()` (one small file
per entry, written atomically: concurrent jobs never corrupt it, a lost race only costs one
more read); a Hugging Face hub cache snapshot's LFS file is a symlink to blobs/<sha256>, whose
name is taken without reading the file. `weights_fingerprint` folds the same digests into one
value: the model identity the hidden-states journal header records.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
HASH_CHUNK = 4 << 20  # bytes per read when hashing a whole file
HASH_THREADS = 4  # files hashed at once (hashlib releases the GIL on large updates)
CACHE_ENV = "TOKENMILL_CACHE_DIR"
_SHA256_NAME = re.compile(r"[0-9a-f]{64}")

log = logging.getLogger(__name__)


def local_dir(name: str | None, basedir: str | Path = ".") -> Path | None:
    if not name:
        return None
    path = Path(basedir) / name  # an absolute name stays absolute
    return path if path.is_dir() else None


def hub_cache_dir(hub_id: str, revision: str | None) -> Path | None:
    """The local Hugging Face cache snapshot of a hub model (no download), if any."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(hub_id, "config.json", revision=revision)
    return Path(found).parent if isinstance(found, str) else None


def hub_id_of(name: str) -> str | None:
    """`org/name` of a hub id, or of a path inside the Hugging Face cache
    (.../models--org--name/snapshots/<commit>); None for other paths."""
    for part in Path(name).parts:
        if part.startswith("models--"):
            return "/".join(part[len("models--") :].split("--", 1))
    if name.count("/") == 1 and not name.startswith((".", "/")) and not Path(name).exists():
        return name
    return None


def weights_fingerprint(path: Path) -> str | None:
    """One digest of the model's identity: config.json and every weight file, by name and the
    sha256 of its full content (`file_sha256`: from a hub blob's name, the digest cache or one
    streamed read), the same files the model check compares. The hidden-states journal header
    records it. None without a config.json or when a file cannot be read."""
    try:
        files = content_files(path)
        h = hashlib.sha256()
        for name, f in files.items():
            h.update(f"{name}\0{file_sha256(f)[0]}\0".encode())
    except OSError:
        return None
    return h.hexdigest()


# ------------------------------------------------------------------- full-content comparison


def cache_dir() -> Path:
    """Where file digests are cached: $TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill,
    else ~/.cache/tokenmill (on a cluster, a home directory every node mounts)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tokenmill"


def hash_file(path: Path) -> str:
    """sha256 of a file's bytes, streamed HASH_CHUNK at a time (the only reader of weights)."""
    h = hashlib.sha256()
    buf = bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def hub_blob_sha256(path: Path) -> str | None:
    """The sha256 a Hugging Face hub cache already names: a snapshot file that links to
    models--org--name/blobs/<64 hex> (an LFS file, whose blob is named by its content's
    sha256). None for anything else (git blobs are named by a 40-hex sha1: those are read)."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if (
        _SHA256_NAME.fullmatch(target.name)
        and target.parent.name == "blobs"
        and target.parent.parent.name.startswith("models--")
    ):
        return target.name
    return None


def _cache_entry(real: Path, st: os.stat_result) -> tuple[Path, dict]:
    key = {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ino": st.st_ino}
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "sha256" / f"{name}.json", key


def _cached(entry: Path, key: dict) -> str | None:
    try:
        rec = json.loads(entry.read_text())
    except (OSError, ValueError):
        return None
    digest = rec.get("sha256") if isinstance(rec, dict) else None
    same = all(rec.get(k) == v for k, v in key.items())
    return digest if same and isinstance(digest, str) and _SHA256_NAME.fullmatch(digest) else None


def _store(entry: Path, key: dict, digest: str) -> None:
    """Write one cache entry atomically (temporary file, rename); a cache that cannot be
    written is skipped with a warning, never an error."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({**key, "sha256": digest}, f, sort_keys=True)
            os.replace(tmp, entry)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.warning("cannot cache the sha256 of %s in %s: %s", key["path"], entry.parent, exc)


def file_sha256(path: Path) -> tuple[str, str]:
    """(sha256 of the file's content, where it came from: "hub blob", "cache" or "read").
    OSError when the file cannot be read."""
    named = hub_blob_sha256(path)
    if named:
        return named, "hub blob"
    real = path.resolve()
    st = real.stat()
    entry, key = _cache_entry(real, st)
    digest = _cached(entry, key)
    if digest:
        return digest, "cache"
    t0 = time.monotonic()
    digest = hash_file(real)
    after = real.stat()
    if (after.st_size, after.st_mtime_ns) == (st.st_size, st.st_mtime_ns):  # not changed meanwhile
        _store(entry, key, digest)
    log.info(
        "sha256 of %s (%.2f GiB) read in %.1fs", real, st.st_size / 2**30, time.monotonic() - t0
    )
    return digest, "read"


def content_files(path: Path) -> dict[str, Path]:
    """What the model check compares: config.json and every weight file (WEIGHT_SUFFIXES) of
    the directory, by name. OSError without a config.json."""
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    weights = sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    return {"config.json": cfg, **{p.name: p for p in weights}}


def content_difference(mine: Path, theirs: Path) -> str | None:
    """None when both directories hold the same config.json and weight files, byte for byte
    (the same names, sizes and sha256 of every byte); else the first difference, naming the
    file. Names and sizes are compared first (no read); digests come from a hub blob name, the
    cache or one streamed read. OSError when a file cannot be read."""
    a, b = content_files(mine), content_files(theirs)
    if a.keys() != b.keys():
        only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
        return (
            f"other weight files (only in {str(mine)!r}: {only_a}; "
            f"only in {str(theirs)!r}: {only_b})"
        )
    for name in a:
        sa, sb = a[name].stat().st_size, b[name].stat().st_size
        if sa != sb:
            return f"{name} differs: {sa} bytes in {str(mine)!r}, {sb} in {str(theirs)!r}"
    sources: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        pairs = [(n, pool.submit(file_sha256, a[n]), pool.submit(file_sha256, b[n])) for n in a]
        try:
            for name, fa, fb in pairs:
                (da, wa), (db, wb) = fa.result(), fb.result()
                sources[wa] = sources.get(wa, 0) + 1
                sources[wb] = sources.get(wb, 0) + 1
                if da != db:
                    return (
                        f"{name} differs: sha256 {da[:16]}... in {str(mine)!r}, "
                        f"{db[:16]}... in {str(theirs)!r}"
                    )
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    log.info(
        "%s and %s: %d files equal by full content (sha256 from %s)",
        mine, theirs, len(a), ", ".join(f"{k}: {v}" for k, v in sorted(sources.items())),
    )  # fmt: skip
    return None


def model_vocab_size(model: str | None, basedir: str | Path = ".", revision: str | None = None):
    """(vocab_size, where it was read) from the model's config.json when it is on this machine
    (a local directory, or a hub id in the local Hugging Face cache); (None, why) otherwise."""
    if not model:
        return None, "no generation.model"
    local = local_dir(model, basedir)
    hub = hub_id_of(model) if local is None else None
    where = local or (hub_cache_dir(hub, revision) if hub else None)
    if where is None:
        return None, f"{model!r} is not a local directory nor in the Hugging Face cache"
    try:
        cfg = json.loads((where / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return None, f"cannot read {where / 'config.json'}: {exc}"
    # Multimodal configs keep the language model's vocabulary in text_config.
    vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    if not isinstance(vocab, int):
        return None, f"{where / 'config.json'} has no vocab_size"
    return vocab, str(where / "config.json")
