"""`tokenmill hidden-states-folder`: the run's one training folder per layout, from its shards
(and, with hidden_states.category_folders, one per category).

    tokenmill hidden-states-folder --out results/hidden_states/all \
        results/hidden_states/C/000/manifest.json ...   (the shard manifests, in declared order)
    tokenmill hidden-states-folder --category C --out results/hidden_states/C/all \
        results/hidden_states/C/000/manifest.json ...   (the category's shards)

A trainer reads one folder: speculators' `--data-path` is a rows folder whose row i has its
states in `hidden_states/hs_{i}.safetensors`, numbered from 0; SpecForge reads a
`rows_{g}-{g+2000}/data_{i}.ckpt` tree. The shard folders are each such a folder on their own;
this one numbers the rows of all of them in the order given (categories, then shards):

    all/speculators/                     the rows folder (every shard's rows, as save_to_disk)
    all/speculators/hidden_states/hs_{i}.safetensors
        -> ../../../C/S/speculators/hidden_states/hs_{j}.safetensors
    all/specforge/rows_{g}-{g+2000}/data_{i}.ckpt
        -> ../../../C/S/specforge/rows_{h}-{h+2000}/data_{j}.ckpt
    all/manifest.json                    written last (contracts.HiddenStatesTrainingManifest)

A category's folder, C/all/, is the same over C's shards only (links one "../" deeper).

The row files are relative symbolic links, never copies: the folder costs the rows' token ids
and one inode per row and layout, and it moves with the results folder. A rebuild (a shard
changed) keeps every link that already points where it should, replaces the others and
removes those past the last row; the rows folder is rewritten only when a shard's rows did.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import sys
from pathlib import Path

from tokenmill import contracts
from tokenmill.hidden_states import layout

log = logging.getLogger("tokenmill.hidden_states")

ROWS_DIR = "speculators"
ROWS_FILE = layout.ROWS_FILES[0]  # data-00000-of-00001.arrow, as save_to_disk names one file


class TrainingFolderError(ValueError):
    """Shards that cannot share one folder (other layer ids, dtype or layouts)."""


def _depth(category: str | None) -> int:
    """Folders between a training folder and hidden_states/: the run's is hidden_states/all/
    (1), a category's hidden_states/C/all/ (2)."""
    return 1 if category is None else 2


def hidden_states_root(out: Path, category: str | None) -> Path:
    """hidden_states/, where the shard folders C/S/ are, from the training folder `out` of the
    run (category None) or of a category."""
    return Path(out).parents[_depth(category) - 1]


def wanted_links(out: Path, manifest: contracts.HiddenStatesTrainingManifest):
    """(link path relative to `out`, its target text) of every row file the manifest
    describes, one at a time (a run's millions of rows are never held at once). A link k
    folders below `out` reaches hidden_states/ with k + depth "../", then C/S/."""
    depth = _depth(manifest.category)
    for s in manifest.shards:
        for lay in manifest.layouts:
            for j in range(s.rows):
                rel = layout.row_path(lay, s.first + j)
                up = "../" * (rel.count("/") + depth)
                yield rel, f"{up}{s.category}/{s.shard}/{layout.row_path(lay, j)}"


def _links_past(out: Path, layouts, rows: int):
    """Our links that are no row below `rows` (the run shrank, or a name we do not make)."""
    for lay in layouts:
        root = os.path.join(out, layout.folder(lay))
        for dirpath, _dirs, names in os.walk(root):
            rel_dir = os.path.relpath(dirpath, out).replace(os.sep, "/")
            for name in names:
                rel = f"{rel_dir}/{name}"
                if not os.path.islink(os.path.join(dirpath, name)):
                    continue
                i = layout.row_index(rel)
                if i is None or i >= rows or layout.row_path(lay, i) != rel:
                    yield rel


def _relink(out: Path, manifest) -> tuple[int, int]:
    """Make the manifest's links so (each atomically: a temporary link renamed over it, only
    where it points elsewhere or is missing); remove the links past its last row. Returns
    (made, removed). Plain strings, not Path objects: this runs once per row and layout."""
    made, dirs = 0, set()
    base = str(out)
    for rel, target in wanted_links(out, manifest):
        p = f"{base}/{rel}"
        try:
            if os.readlink(p) == target:
                continue
        except OSError:
            pass
        folder, name = p.rsplit("/", 1)
        if folder not in dirs:
            os.makedirs(folder, exist_ok=True)
            dirs.add(folder)
        tmp = f"{folder}/.tmp-{name}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        os.symlink(target, tmp)
        os.replace(tmp, p)
        made += 1
    stale = list(_links_past(out, manifest.layouts, manifest.rows))
    for rel in stale:
        os.unlink(f"{base}/{rel}")
    for lay in manifest.layouts:  # folders left empty (a rows_ group past the last row)
        for dirpath, _dirs, _names in os.walk(
            os.path.join(base, layout.folder(lay)), topdown=False
        ):
            if not os.listdir(dirpath):
                os.rmdir(dirpath)
    return made, len(stale)


def _data_files(rows_dir: Path) -> list[str]:
    """The Arrow files of a save_to_disk folder, in order (its state.json)."""
    state = json.loads((rows_dir / "state.json").read_text())
    return [f["filename"] for f in state["_data_files"]]


def _write_rows(out: Path, shard_dirs: list[tuple[Path, int]], fingerprint: str) -> list[str]:
    """speculators' rows folder of every shard's rows, in order: the shards' Arrow record
    batches copied into one Arrow stream file as datasets writes it, read through plain file
    reads (not memory maps), so memory holds one batch whatever the run's size. dataset_info.json
    is the first shard's; state.json names the one file and a fixed fingerprint (deterministic
    bytes). The hidden_states/ links beside it are left alone."""
    import pyarrow as pa

    final = out / ROWS_DIR
    final.mkdir(parents=True, exist_ok=True)
    first = shard_dirs[0][0] / ROWS_DIR
    tmp = final / f".tmp-{ROWS_FILE}"
    writer = schema = None
    try:
        with pa.OSFile(str(tmp), "wb") as sink:
            for shard_dir, rows in shard_dirs:
                found = 0
                for name in _data_files(shard_dir / ROWS_DIR):
                    with pa.OSFile(str(shard_dir / ROWS_DIR / name)) as src:
                        reader = pa.ipc.open_stream(src)
                        if writer is None:
                            schema = reader.schema
                            writer = pa.ipc.new_stream(sink, schema)
                        elif not reader.schema.equals(schema, check_metadata=True):
                            raise TrainingFolderError(f"{src}: another schema than {first}'s")
                        for batch in reader:
                            writer.write_batch(batch)
                            found += batch.num_rows
                if found != rows:  # a shard folder rewritten while its manifest stayed
                    raise TrainingFolderError(
                        f"{shard_dir / ROWS_DIR}: {found} rows, its manifest {rows}"
                    )
            writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final / ROWS_FILE)
    finally:
        tmp.unlink(missing_ok=True)
    state = json.loads((first / "state.json").read_text())
    state |= {"_data_files": [{"filename": ROWS_FILE}], "_fingerprint": fingerprint}
    layout.write_atomic(
        final / "state.json", (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
    )
    layout.write_atomic(final / "dataset_info.json", (first / "dataset_info.json").read_bytes())
    names = (ROWS_FILE, "dataset_info.json", "state.json")
    for p in final.iterdir():  # the previous build's other Arrow files, if any
        if p.is_file() and not p.is_symlink() and p.name not in names:
            p.unlink()
    return [f"{ROWS_DIR}/{n}" for n in sorted(names)]


def build(
    out: Path, shard_manifests: list[Path], category: str | None = None
) -> contracts.HiddenStatesTrainingManifest:
    """The training folder `out` over the shards whose manifests are given, in that order:
    the run's (hidden_states/all/) or, given `category`, that category's (hidden_states/C/all/,
    its shards only)."""
    out = Path(out)
    if not shard_manifests:
        raise TrainingFolderError("no hidden-state shards to put in a training folder")
    shards, first, tokens, keys = [], 0, 0, []
    base = None
    root = hidden_states_root(out, category)
    for path in map(Path, shard_manifests):
        m = contracts.HiddenStatesManifest.read(path)
        if path.parent != root / m.category / m.shard:  # the layout's shard folder
            raise TrainingFolderError(f"{path}: not a shard folder of {root} (C/S/)")
        if category is not None and m.category != category:
            raise TrainingFolderError(f"{path}: a shard of {m.category}, not of {category}")
        shape = (m.layouts, m.layer_ids, m.dtype)
        if base is None:
            base = shape
        elif shape != base:
            raise TrainingFolderError(
                f"{path}: layouts, layer ids, dtype {shape} differ from the first shard's {base}"
            )
        shards.append(
            contracts.TrainingShard(
                category=m.category, shard=m.shard, first=first, rows=m.rows,
                manifest_sha256=contracts.sha256_file(path),
            )
        )  # fmt: skip
        first += m.rows
        tokens += m.tokens
        keys.append(m.rows_key)
    layouts, layer_ids, dtype = base
    manifest_path = out / layout.MANIFEST
    old = _previous(manifest_path)
    manifest_path.unlink(missing_ok=True)  # the folder is incomplete until it is rewritten
    out.mkdir(parents=True, exist_ok=True)
    draft = contracts.HiddenStatesTrainingManifest(
        rows=first, tokens=tokens, layouts=list(layouts), layer_ids=list(layer_ids),
        dtype=dtype, shards=shards, rows_files=[], category=category,
    )  # fmt: skip
    made, removed = _relink(out, draft)
    rows_key = hashlib.sha256("".join(keys).encode()).hexdigest()[:32]
    rows_files = old.rows_files if old is not None and _same_rows(old, draft, out) else None
    if "speculators" in layouts and rows_files is None:
        dirs = [(root / s.category / s.shard, s.rows) for s in shards]
        names = _write_rows(out, dirs, rows_key)
        rows_files = [
            contracts.ManifestFile(
                path=n, size=(out / n).stat().st_size, sha256=contracts.sha256_file(out / n)
            )
            for n in names
        ]
    manifest = draft.replace(rows_files=rows_files or [])
    text = json.dumps(manifest.to_json(), indent=1, sort_keys=True) + "\n"
    layout.write_atomic(manifest_path, text.encode())
    log.info(
        "%s: %d rows of %d shards; %d links made, %d removed, rows folder %s",
        out, first, len(shards), made, removed, "kept" if old and rows_files is old.rows_files
        else "written",
    )  # fmt: skip
    return manifest


def _previous(path: Path) -> contracts.HiddenStatesTrainingManifest | None:
    if not path.is_file():
        return None
    try:
        return contracts.HiddenStatesTrainingManifest.read(path)
    except contracts.RecordError:
        return None  # another version: rebuilt whole


def _same_rows(old, new, out: Path) -> bool:
    """The previous rows folder holds the same rows (same shards, same shard manifests) and
    its files are on disk as listed."""
    if [(s.category, s.shard, s.rows, s.manifest_sha256) for s in old.shards] != [
        (s.category, s.shard, s.rows, s.manifest_sha256) for s in new.shards
    ]:
        return False
    return bool(old.rows_files) and all(
        (out / f.path).is_file() and (out / f.path).stat().st_size == f.size for f in old.rows_files
    )


def problems(out: Path) -> list[str]:
    """What differs between the training folder `out` and its manifest: a shard manifest
    changed since (the folder is stale), a link missing, pointing elsewhere or at nothing, a
    link the manifest does not describe, a rows file missing or changed."""
    out = Path(out)
    manifest = contracts.HiddenStatesTrainingManifest.read(out / layout.MANIFEST)
    root = hidden_states_root(out, manifest.category)
    found = []
    for s in manifest.shards:
        shard_manifest = root / s.category / s.shard / layout.MANIFEST
        if not shard_manifest.is_file():
            found.append(f"missing: shard {s.category}/{s.shard} ({shard_manifest})")
        elif contracts.sha256_file(shard_manifest) != s.manifest_sha256:
            found.append(f"stale: shard {s.category}/{s.shard} changed after the folder was built")
    for rel, target in wanted_links(out, manifest):
        p = out / rel
        try:
            have = os.readlink(p)
        except OSError:
            found.append(f"missing link: {rel}")
            continue
        if have != target:
            found.append(f"link differs: {rel} -> {have} (expected {target})")
        elif not p.exists():
            found.append(f"dangling link: {rel} -> {have}")
    past = sorted(_links_past(out, manifest.layouts, manifest.rows))
    found += [f"not listed: {rel}" for rel in past]
    for f in manifest.rows_files:
        p = out / f.path
        if not p.is_file():
            found.append(f"missing: {f.path}")
        elif p.stat().st_size != f.size or contracts.sha256_file(p) != f.sha256:
            found.append(f"differs: {f.path}")
    return found


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="tokenmill hidden-states-folder", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", required=True, type=Path, help="the training folder")
    p.add_argument(
        "--category",
        help="the folder is this category's, hidden_states/C/all/ (default: the run's)",
    )
    p.add_argument("manifests", nargs="+", type=Path, help="shard manifests, in order")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    try:
        m = build(args.out, args.manifests, args.category)
    except (TrainingFolderError, contracts.RecordError) as exc:
        print(f"tokenmill hidden-states-folder: {exc}", file=sys.stderr)
        return 1
    print(f"{args.out}: {m.rows} rows, {m.tokens} tokens, layouts {', '.join(m.layouts)}")
    return 0
