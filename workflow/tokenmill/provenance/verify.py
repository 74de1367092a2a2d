"""`tokenmill verify PROVENANCE [DIR]`: check a copy of a run's outputs against its provenance.

PROVENANCE may be a folder holding a provenance.json: `tokenmill verify results/dataset`
checks the dataset folder (or a copy of it alone) against its own manifest.
DIR defaults to the folder holding PROVENANCE when the manifest's files are there (it lives
in the results folder), else to the results_dir it records. Every listed file must exist with
the listed size and sha256; extra files are warnings. Exit 0 when everything matches, else 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenmill import contracts, layout
from tokenmill.contracts import sha256_file
from tokenmill.provenance.manifest import MANIFEST_NAME
from tokenmill.settings import ConfigError, load_section


def verify(manifest: contracts.Provenance, directory) -> tuple[list[str], list[str]]:
    """(errors, warnings) for `directory` against the manifest's outputs."""
    d = Path(directory)
    errors, warnings = [], []
    listed = {e.path: e for e in manifest.outputs}
    for path, e in sorted(listed.items()):
        p = d / path
        if not p.is_file():
            errors.append(f"missing: {path}")
        elif p.stat().st_size != e.size:
            errors.append(f"size differs: {path} (expected {e.size}, found {p.stat().st_size})")
        elif sha256_file(p) != e.sha256:
            errors.append(f"sha256 differs: {path} (expected {e.sha256})")
    config = load_section(manifest.config.resolved, None)
    journal = _journal_inside(config)
    warnings += [f"unexpected extra file: {rel}" for rel in extra_files(d, set(listed), journal)]
    return errors, warnings


def _journal_inside(config) -> str | None:
    """journal_dir relative to results_dir when it lies inside it (both as the config gives
    them), else None."""
    journal, results = Path(config.journal_dir), Path(config.results_dir)
    if journal.parts[: len(results.parts)] == results.parts and journal != results:
        return "/".join(journal.parts[len(results.parts) :])
    return None


def extra_files(directory: Path, listed: set[str], journal: str | None = None) -> list[str]:
    """Files in `directory` that the manifest does not list: the copy being checked is listed
    here, whatever its origin. Not counted: the provenance files, the report, hidden files, the
    run's logs, benchmarks and retired files (layout.RUN_LOG_DIRS, layout.RETIRED_DIR) and a
    journal kept inside the results folder."""
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
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        extra.append(rel)
    return extra


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill verify")
    parser.add_argument("provenance", help="a provenance.json, or a folder holding one")
    parser.add_argument("dir", nargs="?")
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
    try:
        errors, warnings = verify(manifest, directory)
    except ConfigError as exc:
        print(f"{prov}: config.resolved: {exc}")
        return 1
    for w in warnings:
        print(f"warning: {w}")
    for e in errors:
        print(e)
    n = len(manifest.outputs)
    if errors:
        print(f"FAILED: {len(errors)} of {n} files differ from {prov} in {directory}")
        return 1
    print(f"OK: {n} files in {directory} match {prov}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
