"""Every path of a run, in one place: the results folder and the journal.

The rules (workflow/rules/*.smk, through common.smk), the stage commands, stats, the card,
provenance, verify, the run summary and `tokenmill status` ask this module for a path; none
spells one itself. Methods take a category and a shard, or Snakemake's wildcards
("{category}", "{shard}") to make a rule's pattern.

What a run publishes is declared by its config, never found by listing folders:
`declared(settings)` gives the categories and their shards, and `published_files` every file
the run's rules write under the results folder (hidden-state shard folders as folders, their
files listed by their manifests). Whatever else lies in a published folder (a removed or
renamed category, a shard above a lowered count, an older layout's file) is
`undeclared`: the controller moves it to `retired/` before any job starts (tokenmill/retire.py).

    results/
      prompts/{category}.parquet                   prepare
      tokenized/{category}/{shard}.parquet         tokenize (a checkpoint: the folder is its output)
      generated/{category}/{shard}.parquet         generate, + {shard}.meta.json (the job record)
      dataset/{category}/{shard}.parquet           merge; dataset/README.md (card),
                                                   dataset/provenance.json, dataset/vocab_mapping/
      export/{category}/{shard}.jsonl              export_jsonl
      token_counts/{category}/{shard}.parquet      merge; token_counts/{category}.parquet and
                                                   token_counts/_all.parquet: the sums
      rejected/{prepare,tokenize}/{category}.parquet
      rejected/{generate,merge}/{category}/{shard}.parquet
      hidden_states/{category}/{shard}/            the hidden_states stage, manifest.json last
      hidden_states/{category}/{shard}.job.json    its job record
      hidden_states/all/                           the run's one training folder per layout:
                                                   links to the shard files, manifest.json last
      hidden_states/{category}/all/                the same over one category's shards
                                                   (hidden_states.category_folders)
      tokenizer/token_facts.json, stats/, provenance.json, report.html
      logs/, benchmarks/                           per job (not published)
      retired/                                     what the config no longer declares (not read)
    journal/
      {category}/                                  generate's sample journal (generate/journal.py)
      _jobs/{stage}/{category}/{shard}/            the GPU-job harness (tokenmill/jobs.py): the
                                                   shard lock, attempts.jsonl, failure.json
      _hidden_states/{category}/{shard}.jsonl      the hidden_states row journal

Category names start with a letter or digit (the schema), so `_jobs`, `_hidden_states` and
`token_counts/_all.parquet` never meet one; `vocab_mapping` and `all` are refused as names
(config.py) because the dataset folder and its card use them.

A shared module below the stages: it imports nothing of tokenmill but settings' types.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

# Stages whose jobs run one per shard and write rejected rows per shard (the others: per
# category).
PER_SHARD_STAGES = ("generate", "merge")
STAGES = ("prepare", "tokenize", "generate", "merge")

DATASET_DIR = "dataset"
COUNTS_DIR = "token_counts"
ALL_COUNTS = "_all"  # token_counts/_all.parquet; category names cannot start with "_"
MAPPING_DIR = "vocab_mapping"  # dataset/vocab_mapping/: the draft vocabulary, no Parquet in it
MAPPING_SUMMARY = "vocab_mapping.json"
SPECFORGE_MAPPING = "vocab_mapping.pt"
PROVENANCE = "provenance.json"
CARD = "README.md"
REPORT = "report.html"
RETIRED_DIR = "retired"
VERDICT_DIR = "verdict"  # rejected/verdict/{category}.json
HIDDEN_STATES_MANIFEST = "manifest.json"
HIDDEN_STATES_TRAINING = "all"  # hidden_states/all/: a reserved category name
# Histograms written by `tokenmill stats` (stats/length_{metric}.png) and the coverage curves.
LENGTH_METRICS = ("prompt_tokens", "output_tokens", "reasoning_tokens", "answer_tokens",
                  "total_tokens")  # fmt: skip
COVERAGE_PLOT = "token_coverage.png"
# Folders under results that hold per-job logs and benchmark tables: not published, never
# retired.
RUN_LOG_DIRS = ("logs", "benchmarks")
# Names a category may not take: the dataset folder and its card use them.
RESERVED_CATEGORIES = (MAPPING_DIR, "all")  # "all": also HIDDEN_STATES_TRAINING


def shard_name(shard: int) -> str:
    return f"{shard:03d}"


def shard_names(n: int) -> list[str]:
    """['000', '001', ...]: the fixed set of shard names a category of n shards has."""
    return [shard_name(i) for i in range(n)]


def speculators_mapping_files(draft_size: int) -> tuple[str, str]:
    """(d2t-N.npy, t2d-N.npy): the names `speculators train --draft-vocab-size N` looks for in
    its --data-path before it builds a mapping of its own (speculators 0.9.0,
    train/cli.py parse_vocab_mappings)."""
    return f"d2t-{int(draft_size)}.npy", f"t2d-{int(draft_size)}.npy"


MAPPING_FORMATS = ("speculators", "specforge")


def mapping_format_files(fmt: str, draft_size: int) -> tuple[str, ...]:
    """The file names one draft-vocabulary format writes for a draft size."""
    if fmt == "speculators":
        return speculators_mapping_files(draft_size)
    if fmt == "specforge":
        return (SPECFORGE_MAPPING,)
    raise ValueError(f"format must be one of {list(MAPPING_FORMATS)}, got {fmt!r}")


@dataclass(frozen=True)
class Layout:
    """The paths of one run: `results` and `journal` as the config gives them (relative to the
    workflow folder, or absolute)."""

    results: str
    journal: str

    @classmethod
    def of(cls, settings) -> Layout:
        return cls(str(settings.results_dir), str(settings.journal_dir))

    def _r(self, *parts: str) -> str:
        return os.path.join(self.results, *parts)

    def _j(self, *parts: str) -> str:
        return os.path.join(self.journal, *parts)

    # ---------------------------------------------------------------- per category and shard
    def prompts(self, category: str) -> str:
        return self._r("prompts", f"{category}.parquet")

    def tokenized_dir(self, category: str) -> str:
        return self._r("tokenized", category)

    def tokenized(self, category: str, shard: str) -> str:
        return self._r("tokenized", category, f"{shard}.parquet")

    def generated(self, category: str, shard: str) -> str:
        return self._r("generated", category, f"{shard}.parquet")

    def generate_record(self, category: str, shard: str) -> str:
        """The generate job's record (contracts.GenerateJobRecord)."""
        return self._r("generated", category, f"{shard}.meta.json")

    def rejected(self, stage: str, category: str, shard: str | None = None) -> str:
        """A stage's rejected rows: per category (prepare, tokenize) or per shard."""
        if stage in PER_SHARD_STAGES:
            if shard is None:
                raise ValueError(f"stage {stage} writes its rejected rows per shard")
            return self._r("rejected", stage, category, f"{shard}.parquet")
        return self._r("rejected", stage, f"{category}.parquet")

    def dataset_dir(self) -> str:
        return self._r(DATASET_DIR)

    def dataset(self, category: str, shard: str) -> str:
        return self._r(DATASET_DIR, category, f"{shard}.parquet")

    def export(self, category: str, shard: str) -> str:
        return self._r("export", category, f"{shard}.jsonl")

    def shard_counts(self, category: str, shard: str) -> str:
        return self._r(COUNTS_DIR, category, f"{shard}.parquet")

    def category_counts(self, category: str) -> str:
        return self._r(COUNTS_DIR, f"{category}.parquet")

    def verdict(self, category: str) -> str:
        """The category's rejection verdict over its shards (contracts.CategoryVerdict)."""
        return self._r("rejected", VERDICT_DIR, f"{category}.json")

    def all_counts(self) -> str:
        return self._r(COUNTS_DIR, f"{ALL_COUNTS}.parquet")

    def hidden_states_dir(self, category: str, shard: str) -> str:
        return self._r("hidden_states", category, shard)

    def hidden_states_manifest(self, category: str, shard: str) -> str:
        return self._r("hidden_states", category, shard, HIDDEN_STATES_MANIFEST)

    def hidden_states_training_dir(self, category: str | None = None) -> str:
        """The run's training folder (hidden_states/training.py), beside the category folders,
        or a category's (hidden_states.category_folders), beside its shard folders (shard
        names are digits)."""
        if category is None:
            return self._r("hidden_states", HIDDEN_STATES_TRAINING)
        return self._r("hidden_states", category, HIDDEN_STATES_TRAINING)

    def hidden_states_training_manifest(self, category: str | None = None) -> str:
        return os.path.join(self.hidden_states_training_dir(category), HIDDEN_STATES_MANIFEST)

    def hidden_states_record(self, category: str, shard: str) -> str:
        """The hidden_states job's record (contracts.HiddenStatesJobRecord)."""
        return self._r("hidden_states", category, f"{shard}.job.json")

    # ---------------------------------------------------------------------- run-wide files
    def token_facts(self) -> str:
        return self._r("tokenizer", "token_facts.json")

    def vocab_mapping_dir(self) -> str:
        return self._r(DATASET_DIR, MAPPING_DIR)

    def vocab_mapping_summary(self) -> str:
        return os.path.join(self.vocab_mapping_dir(), MAPPING_SUMMARY)

    def vocab_mapping_files(self, formats: Iterable[str], draft_size: int) -> list[str]:
        return [
            os.path.join(self.vocab_mapping_dir(), name)
            for fmt in formats
            for name in mapping_format_files(fmt, draft_size)
        ]

    def stats_dir(self) -> str:
        return self._r("stats")

    def stats_summary(self) -> str:
        return os.path.join(self.stats_dir(), "summary.json")

    def stats_table(self) -> str:
        return os.path.join(self.stats_dir(), "summary.md")

    def stats_html(self) -> str:
        """summary.md's tables as an HTML fragment: the report's landing page."""
        return os.path.join(self.stats_dir(), "summary.html")

    def length_plot(self, metric: str) -> str:
        return os.path.join(self.stats_dir(), f"length_{metric}.png")

    def coverage_plot(self) -> str:
        return os.path.join(self.stats_dir(), COVERAGE_PLOT)

    def card(self) -> str:
        return self._r(DATASET_DIR, CARD)

    def provenance(self) -> str:
        return self._r(PROVENANCE)

    def dataset_provenance(self) -> str:
        return self._r(DATASET_DIR, PROVENANCE)

    def reproduce_report(self) -> str:
        return self._r("reproduce", "report.json")

    def report(self) -> str:
        return self._r(REPORT)

    def retired_dir(self) -> str:
        return self._r(RETIRED_DIR)

    # ------------------------------------------------------------------- logs and benchmarks
    def log(self, stage: str, category: str | None = None, shard: str | None = None) -> str:
        """A job's log: logs/{stage}.log, logs/{stage}/{category}.log or
        logs/{stage}/{category}/{shard}.log."""
        if category is None:
            return self._r("logs", f"{stage}.log")
        if shard is None:
            return self._r("logs", stage, f"{category}.log")
        return self._r("logs", stage, category, f"{shard}.log")

    def job_log_dir(self, stage: str, category: str, shard: str) -> str:
        """A GPU job's own log folder (its every attempt, the engine's log)."""
        return self._r("logs", stage, category, shard)

    def attempt_log(self, stage: str, category: str, shard: str) -> str:
        """The log Snakemake keeps of a GPU job's current attempt (show-failed-logs)."""
        return os.path.join(self.job_log_dir(stage, category, shard), "attempt.log")

    def job_log(self, stage: str, category: str, shard: str) -> str:
        """Every attempt of a GPU job, appended (a header line each)."""
        return os.path.join(self.job_log_dir(stage, category, shard), f"{stage}.log")

    def benchmark(self, stage: str, category: str, shard: str | None = None) -> str:
        if shard is None:
            return self._r("benchmarks", stage, f"{category}.tsv")
        return self._r("benchmarks", stage, category, f"{shard}.tsv")

    # ------------------------------------------------------------------------------ journal
    def job_dir(self, stage: str, category: str, shard: str) -> str:
        """The GPU-job harness's state of one shard's job (tokenmill/jobs.py)."""
        return self._j("_jobs", stage, category, shard)

    def shard_lock(self, stage: str, category: str, shard: str) -> str:
        return os.path.join(self.job_dir(stage, category, shard), "lock.json")

    def attempts(self, stage: str, category: str, shard: str) -> str:
        return os.path.join(self.job_dir(stage, category, shard), "attempts.jsonl")

    def failure_record(self, stage: str, category: str, shard: str) -> str:
        return os.path.join(self.job_dir(stage, category, shard), "failure.json")

    def run_failure_record(self, stage: str) -> str:
        """A failure every job of the stage shares with this config (the engine refuses the
        requests' shape: generate's fail-fast): the stage's other jobs stop on it."""
        return self._j("_jobs", stage, "run_failure.json")

    def hidden_states_journal(self, category: str, shard: str) -> str:
        return self._j("_hidden_states", category, f"{shard}.jsonl")


# ------------------------------------------------------------------------- the declared run


def declared(settings) -> dict[str, list[str]]:
    """{category: its shard names}, in category order: what the config declares."""
    return {c: shard_names(settings.categories[c].shards) for c in sorted(settings.categories)}


def shard_files(layout: Layout, category: str, shard: str, settings) -> list[str]:
    """The files the rules write for one shard of a category after tokenize (hidden states:
    the manifest and the job record; the shard folder's files are the manifest's)."""
    files = [
        layout.generated(category, shard),
        layout.generate_record(category, shard),
        layout.rejected("generate", category, shard),
        layout.dataset(category, shard),
        layout.rejected("merge", category, shard),
        layout.shard_counts(category, shard),
    ]
    if settings.dataset.export_jsonl:
        files.append(layout.export(category, shard))
    if settings.hidden_states.enabled:
        files += [
            layout.hidden_states_manifest(category, shard),
            layout.hidden_states_record(category, shard),
        ]
    return files


def category_files(layout: Layout, category: str, settings) -> list[str]:
    """The files the rules write for a category as a whole (the tokenize folder apart)."""
    return [
        layout.prompts(category),
        layout.rejected("prepare", category),
        layout.rejected("tokenize", category),
        layout.verdict(category),
        layout.category_counts(category),
    ]


def vocab_files(layout: Layout, settings) -> list[str]:
    """The draft vocabulary's files ([] without dataset.draft_vocab_size), summary first."""
    ds = settings.dataset
    if ds.draft_vocab_size is None:
        return []
    return [layout.vocab_mapping_summary()] + layout.vocab_mapping_files(
        ds.draft_vocab_formats, ds.draft_vocab_size
    )


def stats_files(layout: Layout) -> list[str]:
    """What `tokenmill stats` writes."""
    return [
        layout.stats_summary(),
        layout.stats_table(),
        layout.stats_html(),
        layout.coverage_plot(),
    ] + [layout.length_plot(m) for m in LENGTH_METRICS]


def published_files(layout: Layout, settings, tokenized_dirs: bool = False) -> list[str]:
    """Every file the run's rules write under the results folder, in a fixed order (the
    provenance files and the reproduction report apart). The tokenize checkpoint's folders
    stand for their shards with `tokenized_dirs` (what Snakemake can ask for)."""
    files = []
    for category, shards in declared(settings).items():
        files += category_files(layout, category, settings)
        if tokenized_dirs:
            files.append(layout.tokenized_dir(category))
        else:
            files += [layout.tokenized(category, s) for s in shards]
        for shard in shards:
            files += shard_files(layout, category, shard, settings)
    files += [layout.token_facts(), layout.all_counts()]
    files += [layout.hidden_states_training_manifest(c) for c in training_folders(settings)]
    files += vocab_files(layout, settings)
    return files + stats_files(layout) + [layout.card()]


def stats_inputs(layout: Layout, settings) -> list[str]:
    """What `tokenmill stats` reads: every declared stage output and rejected file of every
    category (the tokenize folders for their shards), the token counts, the token facts and
    the draft vocabulary's summary."""
    files = []
    for category, shards in declared(settings).items():
        files += category_files(layout, category, settings)
        files.append(layout.tokenized_dir(category))
        for shard in shards:
            files += [
                layout.generated(category, shard),
                layout.generate_record(category, shard),
                layout.rejected("generate", category, shard),
                layout.dataset(category, shard),
                layout.rejected("merge", category, shard),
            ]
    files += [layout.all_counts(), layout.token_facts()]
    if settings.dataset.draft_vocab_size is not None:
        files.append(layout.vocab_mapping_summary())
    return files


def published_dirs(layout: Layout, settings) -> list[str]:
    """Folders the run owns whole (their files come and go with their job): the tokenize
    checkpoint's folders and the hidden-state shard folders."""
    out = []
    for category, shards in declared(settings).items():
        out.append(layout.tokenized_dir(category))
        if settings.hidden_states.enabled:
            out += [layout.hidden_states_dir(category, s) for s in shards]
    out += [layout.hidden_states_training_dir(c) for c in training_folders(settings)]
    return out


def training_folders(settings) -> list[str | None]:
    """The hidden-states training folders the run builds, by category (None: the run's own,
    then each category's with hidden_states.category_folders); [] without the stage."""
    hs = settings.hidden_states
    if not hs.enabled:
        return []
    return [None] + (list(declared(settings)) if hs.category_folders else [])


def undeclared(layout: Layout, settings) -> list[str]:
    """Files under the results folder that the config does not declare (relative to it,
    sorted): left by a removed or renamed category, a lowered shard count, an option turned
    off or an older layout. The logs, benchmarks, retired files, the report, the provenance
    files and the reproduction report are not counted.

    The one place that lists the results folder: everything else reads what is declared."""
    root = Path(layout.results)
    if not root.is_dir():
        return []
    keep = {_rel(root, p) for p in published_files(layout, settings)}
    keep |= {_rel(root, p) for p in (layout.provenance(), layout.dataset_provenance(),
                                     layout.reproduce_report(), layout.report())}  # fmt: skip
    owned = tuple(_rel(root, d) + "/" for d in published_dirs(layout, settings))
    skip = (*(d + "/" for d in RUN_LOG_DIRS), RETIRED_DIR + "/")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
        if rel_dir.startswith(skip):
            dirnames[:] = []
            continue
        for name in filenames:
            rel = rel_dir + name
            if name.startswith(".") or rel in keep:
                continue
            if rel.startswith(owned) and not _tokenized_extra(rel, settings):
                continue
            found.append(rel)
    return sorted(found)


def _tokenized_extra(rel: str, settings) -> bool:
    """A file in a declared tokenize folder that is not one of its declared shards (the folder
    of a category whose shard count was lowered, before tokenize ran again)."""
    parts = rel.split("/")
    if len(parts) != 3 or parts[0] != "tokenized" or parts[1] not in settings.categories:
        return False
    names = {f"{s}.parquet" for s in shard_names(settings.categories[parts[1]].shards)}
    return parts[2] not in names


def _rel(root: Path, path: str) -> str:
    return os.path.relpath(path, root).replace(os.sep, "/")


def category_of(rel: str) -> str | None:
    """The category a results-relative path belongs to (None for run-wide files)."""
    parts = rel.split("/")
    if parts[0] == "prompts" and len(parts) == 2:
        return parts[1].rsplit(".", 1)[0]
    if parts[0] == "rejected" and len(parts) >= 3:
        return parts[2].rsplit(".", 1)[0] if len(parts) == 3 else parts[2]
    if parts[0] == COUNTS_DIR and len(parts) == 2:
        name = parts[1].rsplit(".", 1)[0]
        return None if name == ALL_COUNTS else name
    if parts[0] == DATASET_DIR and len(parts) >= 3 and parts[1] != MAPPING_DIR:
        return parts[1]
    if parts[:2] == ["hidden_states", HIDDEN_STATES_TRAINING]:
        return None  # the run's training folder
    if parts[0] in ("tokenized", "generated", "export", COUNTS_DIR, "hidden_states"):
        return parts[1] if len(parts) >= 3 else None
    return None


def by_category(rels: Iterable[str]) -> Mapping[str | None, list[str]]:
    out: dict[str | None, list[str]] = {}
    for rel in rels:
        out.setdefault(category_of(rel), []).append(rel)
    return out
