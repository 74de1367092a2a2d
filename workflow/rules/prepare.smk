rule prepare_prompts:
    input:
        sources=category_source_files,
    output:
        prompts=LAYOUT.prompts("{category}"),
        rejected=LAYOUT.rejected("prepare", "{category}"),
    log:
        LAYOUT.log("prepare", "{category}"),
    benchmark:
        LAYOUT.benchmark("prepare", "{category}")
    retries: CPU_RETRIES
    conda:
        "../../envs/prepare.yaml"
    params:
        category=category_json,
    shell:
        "tokenmill prepare --category {wildcards.category:q} --category-config {params.category:q}"
        " --out {output.prompts:q} --rejected {output.rejected:q}"
        ' --reject-limits "$TOKENMILL_CONFIG_JSON" > {log:q} 2>&1'
