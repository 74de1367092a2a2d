# One job per tokenized shard: on SLURM a GPU job that starts the engine, feeds it and stops it.
# The journal lives outside Snakemake's outputs, so a retried or rerun job resumes from it.
rule generate_shard:
    input:
        tokenized=tokenized_shard,
    output:
        generated=res("generated/{category}/{shard}.parquet"),
        rejected=res("rejected/generate/{category}/{shard}.parquet"),
        meta=res("generated/{category}/{shard}.meta.json"),
    log:
        res("logs/generate/{category}/{shard}/generate.log"),
    benchmark:
        res("benchmarks/generate/{category}/{shard}.tsv")
    retries: 2
    conda:
        "../../envs/tokenmill.yaml"
    resources:
        gpu=config["generation"]["resources"]["gpus"],
        cpus_per_task=config["generation"]["resources"]["cpus"],
        mem_mb=config["generation"]["resources"]["mem_mb"],
        runtime=generate_runtime,
        # A multi-node engine (generation.launch.nnodes > 1) needs all its nodes in one job.
        nodes=config["generation"]["launch"]["nnodes"],
    # Rerun on what shapes the tokens only; the whole generation section and the journal's
    # location come from the environment (see common.smk): concurrency, retries, timeouts and
    # resources can change without rerunning a shard.
    params:
        tokenizer=tokenizer_json,
        generation_fingerprint=GENERATION_FINGERPRINT,
        log_dir=generate_log_dir,
    shell:
        "tokenmill generate --category {wildcards.category:q} --shard {wildcards.shard}"
        ' --generation-config "$TOKENMILL_GENERATION_JSON" --tokenizer-config {params.tokenizer:q}'
        " --tokenized {input.tokenized:q} --out {output.generated:q}"
        " --rejected {output.rejected:q} --meta {output.meta:q}"
        ' --journal-dir "$TOKENMILL_JOURNAL_DIR" --log-dir {params.log_dir:q} > {log:q} 2>&1'
