# A checkpoint: it rewrites every shard of the category, but unchanged shards come out
# byte-identical, so (with --max-checksum-file-size above the shard size, set in the
# profiles) Snakemake reruns only the downstream jobs of shards whose bytes changed.
checkpoint tokenize_prompts:
    input:
        prompts=res("prompts/{category}.parquet"),
    output:
        shards=directory(res("tokenized/{category}")),
        rejected=res("rejected/tokenize/{category}.parquet"),
    log:
        res("logs/tokenize/{category}.log"),
    benchmark:
        res("benchmarks/tokenize/{category}.tsv")
    threads: workflow.cores
    params:
        tokenizer=tokenizer_json,
        tokenizer_fingerprint=TOKENIZER_FINGERPRINT,
        shards=category_shard_count,
        max_prompt_tokens=config["max_prompt_tokens"],
    shell:
        "tokenmill tokenize --prompts {input.prompts:q} --category {wildcards.category:q}"
        " --shards {params.shards} --tokenizer-config {params.tokenizer:q}"
        " --max-prompt-tokens {params.max_prompt_tokens} --workers {threads}"
        " --out-dir {output.shards:q} --rejected {output.rejected:q} > {log:q} 2>&1"
