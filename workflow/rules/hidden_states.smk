# The optional hidden_states stage (hidden_states.enabled): one job per dataset shard, on SLURM
# a GPU job like generate. The row files are not Snakemake outputs (Snakemake deletes a failed
# job's outputs): the job resumes from its journal and writes manifest.json last.
rule extract_hidden_states:
    input:
        dataset=dataset_shard,
    output:
        manifest=LAYOUT.hidden_states_manifest("{category}", "{shard}"),
        record=LAYOUT.hidden_states_record("{category}", "{shard}"),
    # As generate's: the current attempt's output (Snakemake's log), and every attempt's
    # appended to hidden_states.log beside it.
    log:
        LAYOUT.attempt_log("hidden_states", "{category}", "{shard}"),
    benchmark:
        LAYOUT.benchmark("hidden_states", "{category}", "{shard}")
    conda:
        "../../envs/hidden_states.yaml"
    resources:
        gpu=hidden_states_resource("gpu"),
        gpu_model=hidden_states_resource("gpu_model"),
        nodes=hidden_states_resource("nodes"),
        cpus_per_task=hidden_states_resource("cpus_per_task"),
        mem_mb=hidden_states_resource("mem_mb"),
        runtime=hidden_states_resource("runtime"),
        qos=hidden_states_resource("qos"),
        constraint=hidden_states_resource("constraint"),
    # Rerun on what shapes the files; batch sizes, device and resources come from the
    # environment's config (see common.smk).
    params:
        hidden_states=hidden_states_json,
        model=hidden_states_model,
        out_dir=hidden_states_dir,
        log_dir=hidden_states_log_dir,
    shell:
        'mkdir -p {params.log_dir:q}; echo "=== tokenmill hidden_states attempt: $(date -u'
        " +%Y-%m-%dT%H:%M:%SZ) host $(hostname) SLURM job ${{SLURM_JOB_ID:-none}} (restart"
        " ${{SLURM_RESTART_COUNT:-0}}) runtime {resources.runtime} min mem {resources.mem_mb}"
        ' MB ===" >> {params.log_dir:q}/hidden_states.log; '
        "tokenmill hidden-states --category {wildcards.category:q} --shard {wildcards.shard}"
        " --dataset {input.dataset:q} --out-dir {params.out_dir:q} --record {output.record:q}"
        ' --config-json "$TOKENMILL_CONFIG_JSON" --journal-dir "$TOKENMILL_JOURNAL_DIR"'
        " --log-dir {params.log_dir:q} 2>&1"
        " | ( trap '' TERM INT; exec tee -a {params.log_dir:q}/hidden_states.log ) > {log:q}"


# The run's one training folder per layout: every declared shard's rows numbered from 0
# (categories, then shards), row files linked, not copied (hidden_states/training.py).
rule hidden_states_training_folder:
    input:
        manifests=each_shard(LAYOUT.hidden_states_manifest),
    output:
        manifest=LAYOUT.hidden_states_training_manifest(),
    log:
        LAYOUT.log("hidden_states_training"),
    conda:
        "../../envs/hidden_states.yaml"
    shell:
        'tokenmill hidden-states-folder --out "$(dirname {output.manifest:q})"'
        " {input.manifests:q} > {log:q} 2>&1"


# With hidden_states.category_folders: the same over one category's shards, hidden_states/C/all/.
rule hidden_states_category_folder:
    input:
        manifests=category_hidden_states_manifests,
    output:
        manifest=LAYOUT.hidden_states_training_manifest("{category}"),
    log:
        LAYOUT.log("hidden_states_training", "{category}"),
    conda:
        "../../envs/hidden_states.yaml"
    shell:
        "tokenmill hidden-states-folder --category {wildcards.category:q}"
        ' --out "$(dirname {output.manifest:q})" {input.manifests:q} > {log:q} 2>&1'
