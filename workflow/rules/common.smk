# Config checks, named input functions and parameters shared by the rules.
import json
import os
import re

from tokenmill import workflow_support as support
from tokenmill.config import ConfigError, check_config
from tokenmill.generate import preemption
from tokenmill.generate.resources import job_resources
from tokenmill.keys import generation_fingerprint
from tokenmill.tokenization.shards import shard_names

# A bad config fails here, before any job starts, with the offending key named: one validation
# against workflow/schemas/config.schema.yaml (defaults filled in), then the semantic checks.
try:
    check_config(config, basedir=".")
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None

RESULTS = config["results_dir"]
CATEGORIES = sorted(config["categories"])
TOKENIZER_FINGERPRINT = support.tokenizer_params_fingerprint(config["tokenizer"], ".")
GENERATION_FINGERPRINT = generation_fingerprint(config["generation"])
if config["reproduce"]:
    from tokenmill.provenance.reproduce import load_manifest, reproduce_problems

    # Refuse to start a reproduction that cannot match: say what differs.
    _problems = reproduce_problems(load_manifest(config["reproduce"]), config, ".")
    if _problems:
        raise WorkflowError(
            f"cannot reproduce {config['reproduce']}:\n  " + "\n  ".join(_problems)
        )
# Histograms written by `tokenmill stats` (stats/length_{metric}_tokens.png).
LENGTH_METRICS = ["prompt", "output", "reasoning", "answer", "total"]


wildcard_constraints:
    category="|".join(re.escape(c) for c in CATEGORIES),
    shard=r"\d+",


def res(path):
    """A path under the results directory."""
    return os.path.join(RESULTS, path)


def shards_of(category):
    return shard_names(config["categories"][category]["shards"])


def category_source_files(wildcards):
    """Local source files of a category (hub sources have no local file to watch)."""
    return support.local_source_files(config["categories"][wildcards.category], ".")


def without_resources(section):
    """A config section minus its SLURM job size: resizing jobs must not rerun their rules."""
    return {k: v for k, v in section.items() if k != "resources"}


def category_json(wildcards):
    category = config["categories"][wildcards.category]
    return json.dumps(without_resources(category), sort_keys=True)


def category_shard_count(wildcards):
    return config["categories"][wildcards.category]["shards"]


def tokenizer_json(wildcards=None):
    return json.dumps(config["tokenizer"], sort_keys=True)


def generation_json(wildcards=None):
    return json.dumps(without_resources(config["generation"]), sort_keys=True)


def dataset_json(wildcards=None):
    return json.dumps(config["dataset"], sort_keys=True)


def tokenized_shard(wildcards):
    """A tokenized shard; waits for the category's tokenize checkpoint."""
    checkpoints.tokenize_prompts.get(category=wildcards.category)
    return res(f"tokenized/{wildcards.category}/{wildcards.shard}.parquet")


def dataset_shard(wildcards):
    """A merged shard. Going through the checkpoint makes Snakemake re-evaluate this job once
    tokenize has run, so an export whose shard did not change is dropped from the plan.
    """
    checkpoints.tokenize_prompts.get(category=wildcards.category)
    return res(f"dataset/{wildcards.category}/{wildcards.shard}.parquet")


def generate_resource(name):
    """One SLURM resource of a generate job, per category and attempt (unset: None)."""

    def value(wildcards, attempt):
        return job_resources(config, wildcards.category, attempt)[name]

    return value


def all_shard_files(pattern):
    return [
        res(pattern.format(category=c, shard=s))
        for c in CATEGORIES
        for s in shards_of(c)
    ]


def final_outputs():
    outputs = all_shard_files("dataset/{category}/{shard}.parquet")
    if config["dataset"]["export_jsonl"]:
        outputs += all_shard_files("export/{category}/{shard}.jsonl")
    outputs += [
        res("stats/summary.json"),
        res("dataset/README.md"),
        res("provenance.json"),
    ]
    if config["reproduce"]:
        outputs.append(res("reproduce/report.json"))
    return outputs


def generate_log_dir(wildcards):
    """The generate job's log folder (client log, engine log)."""
    return res(f"logs/generate/{wildcards.category}/{wildcards.shard}")


def config_json(wildcards=None):
    return json.dumps(config, sort_keys=True)


def final_outputs_except_provenance(wildcards=None):
    return [
        p
        for p in final_outputs()
        if p not in (res("provenance.json"), res("reproduce/report.json"))
    ]


def results_dir(wildcards=None):
    return RESULTS
