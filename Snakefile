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
# Always included (its jobs run only when hidden_states.enabled puts them in `rule all`), so
# that `snakemake --lint` sees its rules too.
include: "workflow/rules/hidden_states.smk"


localrules:
    summarize_stats,
    write_dataset_card,
    write_provenance,
    compare_with_manifest,
    hidden_states_training_folder,
    hidden_states_category_folder,


rule all:
    default_target: True
    input:
        final_outputs(),


# The controller only (never in jobs, dry runs or --report): before the first job, files the
# config no longer declares leave the published folders (tokenmill/retire.py), a machine without
# SLURM's commands gets one sentence, and on SLURM the preemption watchdog starts. At the end,
# one short summary whatever the targets: kept, rejected by reason, truncated, what was
# retired, where the outputs and the report are; after a failure, each failed job's cause first.
if not (workflow.remote_exec or workflow.subprocess_exec):
    from tokenmill import run_summary

    from tokenmill import status

    RUN_STARTED = run_summary.started()
    RETIRED = []
    # While generate jobs run: one progress line when it changes, at most once a minute.
    PROGRESS = status.Progress(SETTINGS)

    onstart:
        _slurm_problem = support.slurm_tools_problem(
            workflow
        ) or support.slurm_cluster_problem(workflow)
        if _slurm_problem:
            raise WorkflowError(_slurm_problem)
        RETIRED.extend(support.on_start(workflow, LAYOUT, SETTINGS))
        PROGRESS.start()

    onsuccess:
        PROGRESS.stop()
        run_summary.print_summary(LAYOUT, SETTINGS, True, RUN_STARTED, RETIRED)

    onerror:
        PROGRESS.stop()
        run_summary.print_summary(LAYOUT, SETTINGS, False, RUN_STARTED, RETIRED)
