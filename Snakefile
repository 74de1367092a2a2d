# tokenmill: EAGLE-3 drafter training data as raw token IDs.
# Stages: prepare -> tokenize (checkpoint) -> generate (GPU) -> merge -> stats, card, provenance.
from snakemake.utils import min_version

min_version("9.0")


# The bundled config is the default; a --configfile given on the command line replaces it
# rather than being merged into it (merging would silently add the sample categories).
if not workflow.overwrite_configfiles:

    configfile: "config.yaml"


# The report's landing page: the run's statistics tables (workflow/report/workflow.rst).
report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/tokenize.smk"
include: "workflow/rules/generate.smk"
include: "workflow/rules/dataset.smk"


if SETTINGS.hidden_states.enabled:

    include: "workflow/rules/hidden_states.smk"


localrules:
    summarize_stats,
    write_dataset_card,
    write_provenance,
    compare_with_manifest,


rule all:
    default_target: True
    input:
        final_outputs(),


# One short summary at the end of every run, whatever its targets: kept, rejected by reason,
# truncated, where the outputs and the report are; after a failure, the guard message first.
if not (workflow.remote_exec or workflow.subprocess_exec):
    from tokenmill import run_summary

    RUN_STARTED = run_summary.started()

    onsuccess:
        run_summary.print_summary(RESULTS, CATEGORIES, ok=True, since=RUN_STARTED)

    onerror:
        run_summary.print_summary(RESULTS, CATEGORIES, ok=False, since=RUN_STARTED)
