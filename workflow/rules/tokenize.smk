# A checkpoint: it rewrites every shard of the category, but unchanged shards come out
# byte-identical, so (with --max-checksum-file-size above the shard size, set in the
# profiles) Snakemake reruns only the downstream jobs of shards whose bytes changed.
checkpoint tokenize_prompts:
    input:
        prompts=LAYOUT.prompts("{category}"),
    output:
        shards=directory(LAYOUT.tokenized_dir("{category}")),
        rejected=LAYOUT.rejected("tokenize", "{category}"),
    log:
        LAYOUT.log("tokenize", "{category}"),
    benchmark:
        LAYOUT.benchmark("tokenize", "{category}")
    retries: CPU_RETRIES
    conda:
        "../../envs/tokenize.yaml"
    threads: workflow.cores
    params:
        tokenizer=tokenizer_json,
        tokenizer_fingerprint=TOKENIZER_FINGERPRINT,
        shards=category_shard_count,
        shard_by=category_shard_by,
        max_prompt_tokens=SETTINGS.max_prompt_tokens,
        # Prompt ids are range-checked against this model's vocab_size (its config.json).
        model=SETTINGS.generation.model or "",
        model_revision=SETTINGS.generation.revision or "",
        # Resolved to ids here, where the tokenizer is loaded: the GPU job needs no tokenizer.
        stop_tokens=stop_tokens_json,
        think_end_token=think_end_token,
    shell:
        "tokenmill tokenize --prompts {input.prompts:q} --category {wildcards.category:q}"
        " --shards {params.shards} --shard-by {params.shard_by}"
        " --tokenizer-config {params.tokenizer:q}"
        " --model={params.model:q} --model-revision={params.model_revision:q}"
        " --max-prompt-tokens {params.max_prompt_tokens} --workers {threads}"
        " --stop-tokens {params.stop_tokens:q} --think-end-token={params.think_end_token:q}"
        " --out-dir {output.shards:q} --rejected {output.rejected:q}"
        ' --reject-limits "$TOKENMILL_CONFIG_JSON" > {log:q} 2>&1'
