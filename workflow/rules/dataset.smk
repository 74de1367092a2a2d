# The tokenizer's facts that merge, stats and draft_vocab need (vocabulary size, stop ids,
# think ids), resolved once per run where the tokenizer is loaded: their jobs load none.
rule token_facts:
    output:
        facts=LAYOUT.token_facts(),
    log:
        LAYOUT.log("token_facts"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    # What the facts depend on; the sections themselves come from the environment (common.smk).
    params:
        tokenizer=tokenizer_json,
        tokenizer_fingerprint=TOKENIZER_FINGERPRINT,
        stop_tokens=stop_tokens_json,
        think_tokens=think_tokens_json,
    shell:
        'tokenmill token-facts --dataset-config "$TOKENMILL_CONFIG_JSON"'
        ' --generation-config "$TOKENMILL_GENERATION_JSON"'
        " --tokenizer-config {params.tokenizer:q} --out {output.facts:q} > {log:q} 2>&1"


rule merge_shard:
    input:
        tokenized=tokenized_shard,
        generated=LAYOUT.generated("{category}", "{shard}"),
        generate_rejected=LAYOUT.rejected("generate", "{category}", "{shard}"),
        token_facts=LAYOUT.token_facts(),
    output:
        dataset=LAYOUT.dataset("{category}", "{shard}"),
        rejected=LAYOUT.rejected("merge", "{category}", "{shard}"),
        # loss-token counts of the shard, from the same pass (the draft vocabulary's input)
        counts=LAYOUT.shard_counts("{category}", "{shard}"),
    log:
        LAYOUT.log("merge", "{category}", "{shard}"),
    benchmark:
        LAYOUT.benchmark("merge", "{category}", "{shard}")
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    # The generation section comes from the environment (see common.smk); its fingerprint is
    # the rerun trigger.
    params:
        dataset=merge_dataset_json,
        generation_fingerprint=GENERATION_FINGERPRINT,
    shell:
        "tokenmill merge --category {wildcards.category:q} --shard {wildcards.shard}"
        " --tokenized {input.tokenized:q} --generated {input.generated:q}"
        " --generate-rejected {input.generate_rejected:q}"
        " --out {output.dataset:q} --rejected {output.rejected:q}"
        " --counts-out {output.counts:q}"
        ' --dataset-config {params.dataset:q} --generation-config "$TOKENMILL_GENERATION_JSON"'
        ' --token-facts {input.token_facts:q} --reject-limits "$TOKENMILL_CONFIG_JSON"'
        " > {log:q} 2>&1"


rule export_jsonl:
    input:
        dataset=dataset_shard,
    output:
        jsonl=LAYOUT.export("{category}", "{shard}"),
    log:
        LAYOUT.log("export", "{category}", "{shard}"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    shell:
        "tokenmill export-jsonl --dataset {input.dataset:q} --out {output.jsonl:q} > {log:q} 2>&1"


# A category's rejection share over all its shards (generate, merge): a shard alone fails only
# on what chance cannot explain (tokenmill/guards.py). Everything that publishes the category
# waits for this verdict through its token sum.
rule judge_category:
    input:
        category_verdict_inputs,
    output:
        verdict=LAYOUT.verdict("{category}"),
    log:
        LAYOUT.log("verdict", "{category}"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    # The limits are operational, as for every guard (not a rerun trigger): a failed verdict
    # leaves no output, so the next run judges again with the limits it is given.
    shell:
        "tokenmill verdict --category {wildcards.category:q}"
        ' --config-json "$TOKENMILL_CONFIG_JSON" --out {output.verdict:q} > {log:q} 2>&1'


rule sum_token_counts:
    input:
        counts=category_counts_files,
        verdict=LAYOUT.verdict("{category}"),
    output:
        counts=LAYOUT.category_counts("{category}"),
    log:
        LAYOUT.log("token_counts", "{category}"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    shell:
        "tokenmill draft-vocab sum --category {wildcards.category:q} --counts {input.counts:q}"
        " --out {output.counts:q} > {log:q} 2>&1"


rule sum_all_token_counts:
    input:
        counts=category_counts_sums(),
    output:
        counts=LAYOUT.all_counts(),
    log:
        LAYOUT.log("token_counts", "_all"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    shell:
        "tokenmill draft-vocab sum --all --counts {input.counts:q} --out {output.counts:q}"
        " > {log:q} 2>&1"


# The EAGLE-3 draft vocabulary (d2t/t2d) when dataset.draft_vocab_size is set: beside the
# dataset's category folders, with no Parquet in it (the card's configs read */*.parquet).
rule draft_vocab:
    input:
        counts=category_counts_sums(),
        token_facts=LAYOUT.token_facts(),
    output:
        summary=LAYOUT.vocab_mapping_summary(),
        files=draft_vocab_files(),
    log:
        LAYOUT.log("draft_vocab"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    # The stop tokens and the model (the always-included ids, the target vocabulary) are in the
    # generation fingerprint; the section itself comes from the environment (see common.smk).
    params:
        dataset=dataset_json,
        generation_fingerprint=GENERATION_FINGERPRINT,
    shell:
        "tokenmill draft-vocab from-config --counts {input.counts:q}"
        ' --dataset-config {params.dataset:q} --generation-config "$TOKENMILL_GENERATION_JSON"'
        " --token-facts {input.token_facts:q} --out-dir $(dirname {output.summary:q})"
        " > {log:q} 2>&1"


rule summarize_stats:
    input:
        # every declared file it reads (tokenmill stats finds them through the layout module;
        # the draft row of the coverage table is the written mapping's coverage)
        declared=stats_inputs,
        token_facts=LAYOUT.token_facts(),
    output:
        summary=report(
            LAYOUT.stats_summary(),
            caption="../report/summary.rst",
            category="Dataset statistics",
        ),
        table=report(
            LAYOUT.stats_table(),
            caption="../report/summary_table.rst",
            category="Dataset statistics",
        ),
        # the landing page's tables (workflow/report/workflow.rst)
        html=report(
            LAYOUT.stats_html(),
            caption="../report/summary_table.rst",
            category="Dataset statistics",
        ),
        plots=report(
            [LAYOUT.length_plot(m) for m in layout.LENGTH_METRICS],
            caption="../report/plots.rst",
            category="Length distributions",
        ),
        coverage=report(
            LAYOUT.coverage_plot(),
            caption="../report/token_coverage.rst",
            category="Token frequencies",
        ),
    log:
        LAYOUT.log("stats"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    # params.config (the config without operational settings) is the rerun trigger; the
    # command reads the whole resolved config from the environment (see common.smk).
    params:
        config=outputs_config_json,
        results=results_dir,
    shell:
        'tokenmill stats --results-dir {params.results:q} --config-json "$TOKENMILL_CONFIG_JSON"'
        " --token-facts {input.token_facts:q} --out-dir $(dirname {output.summary:q})"
        " > {log:q} 2>&1"


rule write_dataset_card:
    input:
        stats=LAYOUT.stats_summary(),
        declared=card_inputs,
    output:
        card=LAYOUT.card(),
    log:
        LAYOUT.log("card"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    params:
        config=outputs_config_json,
        results=results_dir,
    shell:
        'tokenmill card --results-dir {params.results:q} --config-json "$TOKENMILL_CONFIG_JSON"'
        " --stats {input.stats:q} --out {output.card:q} > {log:q} 2>&1"


rule write_provenance:
    input:
        provenance_inputs,
    output:
        provenance=LAYOUT.provenance(),
        # the dataset folder's own manifest: the folder one publishes stands alone
        dataset=LAYOUT.dataset_provenance(),
    log:
        LAYOUT.log("provenance"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    # Which --configfile was given is not a rerun trigger either: the resolved config is.
    params:
        config=outputs_config_json,
        results=results_dir,
    shell:
        "tokenmill provenance --results-dir {params.results:q}"
        ' --config-json "$TOKENMILL_CONFIG_JSON" --configfiles-json "$TOKENMILL_CONFIGFILES_JSON"'
        " --out {output.provenance:q} --dataset-out {output.dataset:q} > {log:q} 2>&1"


rule compare_with_manifest:
    input:
        provenance=LAYOUT.provenance(),
    output:
        report=LAYOUT.reproduce_report(),
    log:
        LAYOUT.log("reproduce"),
    retries: CPU_RETRIES
    conda:
        "../../envs/dataset.yaml"
    params:
        manifest=SETTINGS.reproduce or "",
        results=results_dir,
    shell:
        "tokenmill provenance --compare {params.manifest:q} --results-dir {params.results:q}"
        " --report-only --out {output.report:q} > {log:q} 2>&1"


localrules:
    token_facts,
    judge_category,
    sum_token_counts,
    sum_all_token_counts,
    draft_vocab,
