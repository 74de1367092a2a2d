rule prepare_prompts:
    input:
        sources=category_source_files,
    output:
        prompts=res("prompts/{category}.parquet"),
        rejected=res("rejected/prepare/{category}.parquet"),
    log:
        res("logs/prepare/{category}.log"),
    benchmark:
        res("benchmarks/prepare/{category}.tsv")
    conda:
        "../envs/prepare.yaml"
    params:
        category=category_json,
    shell:
        "tokenmill prepare --category {wildcards.category:q} --category-config {params.category:q}"
        " --out {output.prompts:q} --rejected {output.rejected:q} > {log:q} 2>&1"
