# One job per tokenized shard: on SLURM a GPU job that starts the engine, feeds it and stops it.
# The journal lives outside Snakemake's outputs, so a retried or rerun job resumes from it.
rule generate_shard:
    input:
        tokenized=tokenized_shard,
    output:
        generated=LAYOUT.generated("{category}", "{shard}"),
        rejected=LAYOUT.rejected("generate", "{category}", "{shard}"),
        meta=LAYOUT.generate_record("{category}", "{shard}"),
    # Snakemake deletes a rule's log before each attempt: this one holds the current attempt's
    # output only (show-failed-logs prints it). generate.log next to it, which Snakemake does
    # not know, keeps every attempt's (appended, a header line each): a requeued or restarted
    # job, or one waiting for a live lock, never erases an earlier attempt's lines.
    log:
        LAYOUT.attempt_log("generate", "{category}", "{shard}"),
    benchmark:
        LAYOUT.benchmark("generate", "{category}", "{shard}")
    # tee ignores SIGTERM/SIGINT (SLURM signals every process of the job): it keeps copying
    # until generate itself has written its last line and exits.
    conda:
        "../../envs/generate.yaml"
    # No `retries:` here: a rule's own count would override the `--retries 0` that the slurm
    # executor gives the Snakemake inside each job, which then retried inside the allocation.
    # The profile's `retries` is the only count (profiles/*/config.yaml).
    resources:
        # tokenmill.jobs.resources: the category's overrides, GPUs per node (gres and
        # nodes for a multi-node engine), runtime and memory growing with the attempt (capped).
        gpu=generate_resource("gpu"),
        gpu_model=generate_resource("gpu_model"),
        gres=generate_resource("gres"),
        nodes=generate_resource("nodes"),
        cpus_per_task=generate_resource("cpus_per_task"),
        mem_mb=generate_resource("mem_mb"),
        runtime=generate_resource("runtime"),
        qos=generate_resource("qos"),
        constraint=generate_resource("constraint"),
    # Rerun on what shapes the tokens only; the command loads the whole config from the
    # environment (see common.smk): concurrency, retries, timeouts, resources and the harness's
    # settings can change without rerunning a shard.
    params:
        tokenizer=tokenizer_json,
        generation_fingerprint=GENERATION_FINGERPRINT,
        log_dir=generate_log_dir,
    shell:
        # SLURM's restart count from scontrol: the jobstep executor drops SLURM_RESTART_COUNT.
        "restart=$(scontrol show job -o ${{SLURM_JOB_ID:-none}} 2>/dev/null"
        " | grep -o 'Restarts=[0-9]*' | cut -d= -f2 || true); "
        'mkdir -p {params.log_dir:q}; echo "=== tokenmill generate attempt: $(date -u'
        " +%Y-%m-%dT%H:%M:%SZ) host $(hostname) SLURM job ${{SLURM_JOB_ID:-none}} (restart"
        " ${{restart:-0}}) runtime {resources.runtime} min mem {resources.mem_mb}"
        ' MB ===" >> {params.log_dir:q}/generate.log; '
        "tokenmill generate --category {wildcards.category:q} --shard {wildcards.shard}"
        ' --config-json "$TOKENMILL_CONFIG_JSON" --tokenized {input.tokenized:q}'
        " --out {output.generated:q}"
        " --rejected {output.rejected:q} --meta {output.meta:q}"
        ' --journal-dir "$TOKENMILL_JOURNAL_DIR" --log-dir {params.log_dir:q} 2>&1'
        " | ( trap '' TERM INT; exec tee -a {params.log_dir:q}/generate.log ) > {log:q}"
