# Config checks, named input functions and parameters shared by the rules.
import json
import os
import re
import sys

# No activated venv needed (a fresh shell, a SLURM job), no installed package: the package is
# reached from the workflow's own folder (workflow/tokenmill) here and in every job
# (PYTHONPATH), and the rules' `tokenmill` is workflow/bin/tokenmill, which runs it with the
# first python3 on PATH: the interpreter running Snakemake (its folder comes next; on SLURM the
# job's Snakemake runs the same interpreter from the shared filesystem), or the rule's conda
# environment (envs/*.yaml) when Snakemake activates one. Changing neither the rules' shell
# text nor their params, this reruns nothing.
_PACKAGE_DIR = os.path.join(workflow.basedir, "workflow")
if sys.path[0] != _PACKAGE_DIR:
    sys.path.insert(0, _PACKAGE_DIR)
for _var, _dirs in (
    ("PYTHONPATH", [_PACKAGE_DIR]),
    ("PATH", [os.path.join(_PACKAGE_DIR, "bin"), os.path.dirname(sys.executable)]),
):
    _have = os.environ.get(_var, "").split(os.pathsep)
    if _have[: len(_dirs)] != _dirs:
        os.environ[_var] = os.pathsep.join([*_dirs, *filter(None, _have)])

from tokenmill import layout
from tokenmill import workflow_support as support
from tokenmill.config import (
    ConfigError,
    check_config,
    hub_problems,
    job_environment,
    merge_dataset_config,
    outputs_config,
)
from tokenmill.jobs import preemption
from tokenmill.jobs.resources import job_resources
from tokenmill.keys import generation_fingerprint
from tokenmill.settings import Settings

# A bad config fails here, before any job starts, with the offending key named: one validation
# against workflow/schemas/config.schema.yaml (defaults filled in), then the semantic checks.
try:
    check_config(config, basedir=".")
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None
# The typed, read-only settings of that validated config (tokenmill/settings.py): the helpers
# below read these; `config` itself stays the validated dict Snakemake holds.
SETTINGS = Settings.from_validated(config)
# The controller asks the hub about the repositories the run downloads and the cache lacks
# (a typo fails here in seconds, in one line); jobs do not: a node may have no network.
if not (workflow.remote_exec or workflow.subprocess_exec):
    _hub_problems = hub_problems(SETTINGS, ".")
    if _hub_problems:
        raise WorkflowError("invalid configuration:\n  " + "\n  ".join(_hub_problems))

# Operational settings (concurrency, retries, timeouts, resources, engine start-up limits,
# external URLs, the journal's location) change how a job runs, never its tokens, so changing
# one must rerun nothing. Snakemake reruns a job whose params or shell text changed, so the
# rules take these settings from the environment instead: every job, local or on SLURM, runs
# after this file was parsed with the same config, and its shell inherits the variables.
# The rules' params carry only what shapes the outputs (fingerprints, token-relevant keys).
os.environ.update(job_environment(SETTINGS, workflow.configfiles))

# Snakemake's own "Directory cannot be locked" error after a killed controller is easy to miss
# and does not say how to unlock with this run's profile and config: say it first.
if not (workflow.remote_exec or workflow.subprocess_exec):
    _lock_hint = support.stale_lock_hint(sys.argv)
    if _lock_hint:
        print(_lock_hint, file=sys.stderr)

# A CPU job fails on its data or config (an empty source, a guard, a bad record): the same
# inputs fail the same way, so it is run once, not paid for and printed three times. The
# profiles' retries stay for what can heal: the GPU jobs' time limits, preemption, node loss.
CPU_RETRIES = 0

# Every path of the run comes from the layout module (tokenmill/layout.py), and every
# aggregate's inputs from the categories and shards the config declares: nothing is globbed.
LAYOUT = layout.Layout.of(SETTINGS)
DECLARED = layout.declared(SETTINGS)
CATEGORIES = list(DECLARED)
TOKENIZER_FINGERPRINT = support.tokenizer_params_fingerprint(SETTINGS.tokenizer, ".")
GENERATION_FINGERPRINT = generation_fingerprint(SETTINGS.generation)
if SETTINGS.reproduce:
    from tokenmill.provenance.reproduce import load_manifest, reproduce_problems

    # Refuse to start a reproduction that cannot match: say what differs.
    _problems = reproduce_problems(load_manifest(SETTINGS.reproduce), SETTINGS, ".")
    if _problems:
        raise WorkflowError(
            f"cannot reproduce {SETTINGS.reproduce}:\n  " + "\n  ".join(_problems)
        )


wildcard_constraints:
    category="|".join(re.escape(c) for c in CATEGORIES),
    shard=r"\d+",


def category_source_files(wildcards):
    """Local source files of a category (hub sources have no local file to watch)."""
    return support.local_source_files(SETTINGS.categories[wildcards.category], ".")


def without_resources(section):
    """A config section minus its SLURM job size: resizing jobs must not rerun their rules."""
    return {k: v for k, v in section.items() if k != "resources"}


def category_json(wildcards):
    category = SETTINGS.categories[wildcards.category].raw
    return json.dumps(without_resources(category), sort_keys=True)


def category_shard_count(wildcards):
    return SETTINGS.categories[wildcards.category].shards


def category_shard_by(wildcards):
    return SETTINGS.categories[wildcards.category].shard_by


def tokenizer_json(wildcards=None):
    return json.dumps(SETTINGS.tokenizer.raw, sort_keys=True)


def dataset_json(wildcards=None):
    return json.dumps(SETTINGS.dataset.raw, sort_keys=True)


def merge_dataset_json(wildcards=None):
    """The dataset section as merge reads it (export_jsonl is the export rule's business)."""
    return json.dumps(merge_dataset_config(SETTINGS.dataset.raw), sort_keys=True)


def stop_tokens_json(wildcards=None):
    return json.dumps(SETTINGS.generation.raw["stop_tokens"])


def think_tokens_json(wildcards=None):
    """The dataset's think tokens (the token facts' think ids come from them)."""
    ds = SETTINGS.dataset
    return json.dumps([ds.think_end_token, ds.think_start_token])


def think_end_token(wildcards):
    """dataset.think_end_token for a context: regenerated category (it splits the model's
    answers into reasoning and answer there); empty for others, which do not depend on it.
    """
    if not SETTINGS.categories[wildcards.category].regenerated:
        return ""
    return SETTINGS.dataset.think_end_token or ""


def tokenized_shard(wildcards):
    """A tokenized shard; waits for the category's tokenize checkpoint."""
    checkpoints.tokenize_prompts.get(category=wildcards.category)
    return LAYOUT.tokenized(wildcards.category, wildcards.shard)


def dataset_shard(wildcards):
    """A merged shard. Going through the checkpoint makes Snakemake re-evaluate this job once
    tokenize has run, so an export whose shard did not change is dropped from the plan.
    """
    checkpoints.tokenize_prompts.get(category=wildcards.category)
    return LAYOUT.dataset(wildcards.category, wildcards.shard)


def generate_resource(name):
    """One SLURM resource of a generate job, per category and attempt (unset: None)."""

    def value(wildcards, attempt):
        return job_resources(SETTINGS, wildcards.category, attempt)[name]

    return value


def each_shard(path_of):
    """path_of(category, shard) for every declared shard, categories then shards in order."""
    return [path_of(c, s) for c, shards in DECLARED.items() for s in shards]


def category_counts_files(wildcards):
    """The shard counts files of one category (merge writes them)."""
    return [
        LAYOUT.shard_counts(wildcards.category, s) for s in DECLARED[wildcards.category]
    ]


def category_verdict_inputs(wildcards):
    """What a category's verdict reads: every declared shard's merged and generate-rejected
    files (the tokenized shards come before them)."""
    c = wildcards.category
    return [
        path
        for s in DECLARED[c]
        for path in (LAYOUT.dataset(c, s), LAYOUT.rejected("generate", c, s))
    ]


def category_counts_sums():
    return [LAYOUT.category_counts(c) for c in CATEGORIES]


def draft_vocab_files():
    """The trainers' files of the draft vocabulary, by dataset.draft_vocab_formats."""
    ds = SETTINGS.dataset
    if ds.draft_vocab_size is None:
        return []
    return LAYOUT.vocab_mapping_files(ds.draft_vocab_formats, ds.draft_vocab_size)


def draft_vocab_summary():
    """[vocab_mapping.json] when dataset.draft_vocab_size is set, else []."""
    if SETTINGS.dataset.draft_vocab_size is None:
        return []
    return [LAYOUT.vocab_mapping_summary()]


def final_outputs():
    """The default target: every file the config declares (layout.published_files),
    then the provenance and, when reproducing, the comparison with the manifest."""
    outputs = layout.published_files(LAYOUT, SETTINGS, tokenized_dirs=True)
    outputs += [LAYOUT.provenance()]
    if SETTINGS.reproduce:
        outputs.append(LAYOUT.reproduce_report())
    return outputs


def hidden_states_resource(name):
    """One SLURM resource of a hidden_states job, per attempt."""
    from tokenmill.hidden_states.stage import job_resources as hs_job_resources

    def value(wildcards, attempt):
        return hs_job_resources(SETTINGS, attempt)[name]

    return value


def hidden_states_json(wildcards=None):
    """The hidden_states keys that shape its files (the rule's rerun trigger)."""
    return json.dumps(outputs_config(SETTINGS).get("hidden_states"), sort_keys=True)


def category_hidden_states_manifests(wildcards):
    """The hidden-state shard manifests of one category, in shard order."""
    return [
        LAYOUT.hidden_states_manifest(wildcards.category, s)
        for s in DECLARED[wildcards.category]
    ]


def hidden_states_model(wildcards=None):
    return SETTINGS.hidden_states.model or SETTINGS.generation.model


def hidden_states_dir(wildcards):
    return LAYOUT.hidden_states_dir(wildcards.category, wildcards.shard)


def hidden_states_log_dir(wildcards):
    """The hidden_states job's log folder (every attempt, the engine's log)."""
    return LAYOUT.job_log_dir("hidden_states", wildcards.category, wildcards.shard)


def generate_log_dir(wildcards):
    """The generate job's log folder (every attempt, the engine's log)."""
    return LAYOUT.job_log_dir("generate", wildcards.category, wildcards.shard)


def outputs_config_json(wildcards=None):
    """The config without its operational settings: what stats, card and provenance rerun on."""
    return json.dumps(outputs_config(SETTINGS), sort_keys=True)


def provenance_inputs(wildcards=None):
    """What the provenance lists: every declared file."""
    return layout.published_files(LAYOUT, SETTINGS, tokenized_dirs=True)


def stats_inputs(wildcards=None):
    """What `tokenmill stats` reads (it finds the same files through the layout module)."""
    return layout.stats_inputs(LAYOUT, SETTINGS)


def card_inputs(wildcards=None):
    """What `tokenmill card` reads: the dataset shards and the draft vocabulary's summary."""
    return each_shard(LAYOUT.dataset) + draft_vocab_summary()


def results_dir(wildcards=None):
    return LAYOUT.results
