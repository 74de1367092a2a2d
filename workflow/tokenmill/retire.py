"""Nothing the config no longer declares stays published.

A removed or renamed category, a lowered shard count, an option turned off (export_jsonl,
hidden_states, a draft vocabulary of another size) or an older layout leave files in the
published folders that no rule of this config writes (layout.undeclared). The controller moves
them to `{results_dir}/retired/` (same relative path; a file retired again replaces the older
copy) before any job starts, removes the folders that became empty, and says so in one line
per category. Nothing reads `retired/`: not the statistics, the card, the provenance, verify or
the trainers' exports. Delete it when the space is wanted.

Moving loses no paid-for sample: generated samples live in the journal (journal_dir), which is
never touched here, so restoring a category or raising its shard count again regenerates
nothing (the generate jobs find every sample in the journal; tests/test_declared_run.py counts
the requests).

A top-layer module (the Snakefile's onstart calls `retire_undeclared`).
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenmill import layout


def retire_undeclared(lay: layout.Layout, settings) -> list[str]:
    """Move every undeclared file under the results folder to retired/; one line per category
    (and one for run-wide files) saying what moved and why."""
    stale = layout.undeclared(lay, settings)
    if not stale:
        return []
    root, dest = Path(lay.results), Path(lay.retired_dir())
    for rel in stale:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(root / rel, target)
    _remove_empty_parents(root, {(root / rel).parent for rel in stale})
    return [_line(cat, rels, settings, dest) for cat, rels in _grouped(stale).items()]


def _grouped(rels: list[str]) -> dict[str | None, list[str]]:
    by_cat = layout.by_category(rels)
    return {c: by_cat[c] for c in sorted(by_cat, key=lambda c: (c is None, c or ""))}


def _line(category: str | None, rels: list[str], settings, dest: Path) -> str:
    n = f"{len(rels)} file{'s' if len(rels) != 1 else ''}"
    where = f"moved to {dest}/"
    if category is None:
        kinds = ", ".join(sorted({_kind(r) for r in rels}))
        return f"tokenmill: {n} the config no longer declares ({kinds}) {where}"
    if category not in settings.categories:
        return (
            f"tokenmill: category '{category}' is not in the config: its {n} {where} "
            "(its samples stay in the journal: restoring the category sends no request)"
        )
    shards = sorted({s for s in map(_shard, rels) if s is not None})
    declared = settings.categories[category].shards
    if shards and all(int(s) >= declared for s in shards):
        return (
            f"tokenmill: category '{category}' has {declared} shard"
            f"{'s' if declared != 1 else ''} now: {n} of shard{'s' if len(shards) != 1 else ''} "
            f"{', '.join(shards)} {where} (their samples stay in the journal and move to "
            "the shards of their prompts)"
        )
    kinds = ", ".join(sorted({_kind(r) for r in rels}))
    return f"tokenmill: category '{category}': {n} the config no longer declares ({kinds}) {where}"


def _kind(rel: str) -> str:
    """What a path is, for the one line: its stage folder (and the dataset's vocab mapping)."""
    parts = rel.split("/")
    if parts[0] == "rejected" and len(parts) > 1:
        return f"rejected/{parts[1]}"
    if parts[0] == layout.DATASET_DIR and len(parts) > 1 and parts[1] == layout.MAPPING_DIR:
        return f"{layout.DATASET_DIR}/{layout.MAPPING_DIR}"
    return parts[0]


def _shard(rel: str) -> str | None:
    """The shard a per-shard path belongs to (None for a per-category file)."""
    parts = rel.split("/")
    if parts[0] == "hidden_states" and len(parts) >= 4:
        return parts[2] if parts[2].isdigit() else None
    name = parts[-1].split(".", 1)[0]
    per_shard = len(parts) == 3 and parts[0] != "rejected" or len(parts) == 4
    return name if per_shard and name.isdigit() else None


def _remove_empty_parents(root: Path, dirs: set[Path]) -> None:
    """Remove the folders that moving left empty, up to (not including) the results folder."""
    for d in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        while d != root and d.is_dir() and root in d.parents and not any(d.iterdir()):
            d.rmdir()
            d = d.parent
