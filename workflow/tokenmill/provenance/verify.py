"""`tokenmill verify PROVENANCE [DIR]`: check a copy of a run's outputs against its provenance.

PROVENANCE may be a folder holding a provenance.json: `tokenmill verify results/dataset`
checks the dataset folder (or a copy of it alone) against its own manifest.
DIR defaults to the folder holding PROVENANCE when the manifest's files are there (it lives
in the results folder), else to the results_dir it records. Every listed file must exist with
the listed size and sha256, and each link of the hidden-states training folder must point at
the shard file its manifest says; extra files are warnings. Exit 0 when everything matches, else 1.

`--repair` removes what differs so that the same Snakemake command remakes it and pays for
nothing else (see `repair`): a rerun itself checks the hidden-state row files by size only
(hashing every file at each rerun costs minutes per TB; docs/hidden-states.md), so a file
changed at the same size is found here and mended by the rerun after it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill import contracts, layout
from tokenmill.contracts import sha256_file
from tokenmill.hidden_states import training as hs_training
from tokenmill.provenance.manifest import MANIFEST_NAME
from tokenmill.settings import ConfigError, load_section


def verify(
    manifest: contracts.Provenance, directory, bad: list[str] | None = None
) -> tuple[list[str], list[str]]:
    """(errors, warnings) for `directory` against the manifest's outputs; the paths that
    differ are appended to `bad` (the training folder's as its folder, when its links do)."""
    d = Path(directory)
    errors, warnings = [], []
    bad = [] if bad is None else bad
    listed = {e.path: e for e in manifest.outputs}
    for path, e in sorted(listed.items()):
        p = d / path
        if not p.is_file():
            errors.append(f"missing: {path}")
        elif p.stat().st_size != e.size:
            errors.append(f"size differs: {path} (expected {e.size}, found {p.stat().st_size})")
        elif sha256_file(p) != e.sha256:
            errors.append(f"sha256 differs: {path} (expected {e.sha256})")
        else:
            continue
        bad.append(path)
    config = load_section(manifest.config.resolved, None)
    training = _training_folders(d, config)
    for folder in training:  # its links, each against the shard file it must point at
        rel = folder.relative_to(d).as_posix()
        if f"{rel}/{layout.HIDDEN_STATES_MANIFEST}" not in listed:
            continue
        if not (folder / layout.HIDDEN_STATES_MANIFEST).is_file():
            continue  # reported missing above
        found = hs_training.problems(folder)
        errors += [f"{rel}: {p}" for p in found]
        bad += [rel + "/"] if found else []
    journal = _journal_inside(config)
    links = tuple(f"{f.relative_to(d).as_posix()}/" for f in training)
    extra = extra_files(d, set(listed), journal, links)
    warnings += [f"unexpected extra file: {rel}" for rel in extra]
    return errors, warnings


def _training_folders(d: Path, config) -> list[Path]:
    """The hidden-states training folders the config declares (the run's, each category's),
    in the copy being checked."""
    here = layout.Layout(str(d), config.journal_dir)
    return [Path(here.hidden_states_training_dir(c)) for c in layout.training_folders(config)]


def _journal_inside(config) -> str | None:
    """journal_dir relative to results_dir when it lies inside it (both as the config gives
    them), else None."""
    journal, results = Path(config.journal_dir), Path(config.results_dir)
    if journal.parts[: len(results.parts)] == results.parts and journal != results:
        return "/".join(journal.parts[len(results.parts) :])
    return None


def extra_files(
    directory: Path, listed: set[str], journal: str | None = None, training: tuple[str, ...] = ()
) -> list[str]:
    """Files in `directory` that the manifest does not list: the copy being checked is listed
    here, whatever its origin. Not counted: the provenance files, the report, hidden files, the
    run's logs, benchmarks and retired files (layout.RUN_LOG_DIRS, layout.RETIRED_DIR) and a
    journal kept inside the results folder; nor the links in the `training` folders (relative,
    ending in "/"), which are checked link by link."""
    if not directory.is_dir():
        return []
    skip = (*(f"{d}/" for d in layout.RUN_LOG_DIRS), f"{layout.RETIRED_DIR}/")
    skip += (f"{journal}/",) if journal else ()
    own = {MANIFEST_NAME, f"{layout.DATASET_DIR}/{MANIFEST_NAME}", layout.REPORT}
    extra = []
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if not p.is_file() or rel in listed or rel in own or rel.startswith(skip):
            continue
        if training and p.is_symlink() and rel.startswith(training):  # checked link by link
            continue
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        extra.append(rel)
    return extra


def repair(
    manifest: contracts.Provenance, directory, bad: list[str]
) -> tuple[list[str], list[str]]:
    """Remove what differs so that the same Snakemake command makes it again, paying only for
    what was removed: a hidden-state row file goes with its shard's manifest.json (the job
    reruns and recomputes the rows whose files are missing, the journal holding the others), a
    training folder that differs loses its manifest.json (rebuilt from the shards), any other
    declared file is removed (its rule reruns; a generate job from its journal, no request).
    Returns (what was done, what cannot be repaired this way), one line each."""
    d = Path(directory)
    folders = sorted((manifest.hidden_states or {}), key=len, reverse=True)
    done, left, rows = [], [], {}
    for path in bad:
        if path.endswith("/"):  # the training folder
            (d / path / layout.HIDDEN_STATES_MANIFEST).unlink(missing_ok=True)
            done.append(f"{path}: manifest.json removed (the folder is rebuilt from the shards)")
            continue
        folder = next((f for f in folders if path.startswith(f + "/")), None)
        if folder is not None:
            (d / path).unlink(missing_ok=True)
            rows.setdefault(folder, []).append(path)
        elif path.split("/")[0] == "tokenized":
            left.append(f"{path}: a tokenize checkpoint file; remove results/tokenized/ of "
                        "its category to remake it")  # fmt: skip
        else:
            (d / path).unlink(missing_ok=True)
            done.append(f"{path}: removed (its rule makes it again)")
    for folder, paths in sorted(rows.items()):
        (d / folder / layout.HIDDEN_STATES_MANIFEST).unlink(missing_ok=True)
        done.append(
            f"{folder}: {len(paths)} row file(s) removed with the shard's manifest.json (its job "
            "recomputes those rows only)"
        )
    return done, left


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill verify")
    parser.add_argument("provenance", help="a provenance.json, or a folder holding one")
    parser.add_argument("dir", nargs="?")
    parser.add_argument(
        "--repair",
        action="store_true",
        help="remove what differs so that rerunning the same snakemake command remakes it",
    )
    args = parser.parse_args(argv)
    prov = Path(args.provenance)
    if prov.is_dir():
        prov = prov / MANIFEST_NAME
        if not prov.is_file():
            print(f"tokenmill verify: no {MANIFEST_NAME} in {args.provenance}", file=sys.stderr)
            return 1
    try:
        manifest = contracts.Provenance.read(prov)
    except contracts.RecordError as exc:
        print(f"tokenmill verify: {exc}", file=sys.stderr)
        return 1
    directory = args.dir
    if directory is None:
        first = next(iter(manifest.outputs), None)
        here = prov.parent
        directory = here if first is None or (here / first.path).exists() else None
        directory = directory or Path(manifest.results_dir)
    bad: list[str] = []
    try:
        errors, warnings = verify(manifest, directory, bad)
    except ConfigError as exc:
        print(f"{prov}: config.resolved: {exc}")
        return 1
    for w in warnings:
        print(f"warning: {w}")
    for e in errors:
        print(e)
    n = len(manifest.outputs)
    if errors and args.repair:
        print(f"{len(errors)} of {n} files differ from {prov} in {directory}")
        done, left = repair(manifest, directory, bad)
        for line in done + left:
            print(f"repair: {line}")
        print("repair: now run the same snakemake command again, then tokenmill verify")
        return 1 if left else 0
    if errors:
        print(f"FAILED: {len(errors)} of {n} files differ from {prov} in {directory}")
        return 1
    print(f"OK: {n} files in {directory} match {prov}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
