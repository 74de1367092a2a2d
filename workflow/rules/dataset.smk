rule merge_shard:
    input:
        tokenized=tokenized_shard,
        generated=res("generated/{category}/{shard}.parquet"),
        generate_rejected=res("rejected/generate/{category}/{shard}.parquet"),
    output:
        dataset=res("dataset/{category}/{shard}.parquet"),
        rejected=res("rejected/merge/{category}/{shard}.parquet"),
    log:
        res("logs/merge/{category}/{shard}.log"),
    benchmark:
        res("benchmarks/merge/{category}/{shard}.tsv")
    params:
        dataset=dataset_json,
        generation=generation_json,
        tokenizer=tokenizer_json,
    shell:
        "tokenmill merge --category {wildcards.category:q} --shard {wildcards.shard}"
        " --tokenized {input.tokenized:q} --generated {input.generated:q}"
        " --generate-rejected {input.generate_rejected:q}"
        " --out {output.dataset:q} --rejected {output.rejected:q}"
        " --dataset-config {params.dataset:q} --generation-config {params.generation:q}"
        " --tokenizer-config {params.tokenizer:q} > {log:q} 2>&1"


rule export_jsonl:
    input:
        dataset=dataset_shard,
    output:
        jsonl=res("export/{category}/{shard}.jsonl"),
    log:
        res("logs/export/{category}/{shard}.log"),
    shell:
        "tokenmill export-jsonl --dataset {input.dataset:q} --out {output.jsonl:q} > {log:q} 2>&1"


rule summarize_stats:
    input:
        dataset=all_shard_files("dataset/{category}/{shard}.parquet"),
        meta=all_shard_files("generated/{category}/{shard}.meta.json"),
        merge_rejected=all_shard_files("rejected/merge/{category}/{shard}.parquet"),
    output:
        summary=report(
            res("stats/summary.json"),
            caption="../report/summary.rst",
            category="Dataset statistics",
        ),
        table=report(
            res("stats/summary.md"),
            caption="../report/summary_table.rst",
            category="Dataset statistics",
        ),
        plots=report(
            expand(res("stats/length_{metric}_tokens.png"), metric=LENGTH_METRICS),
            caption="../report/plots.rst",
            category="Length distributions",
        ),
    log:
        res("logs/stats.log"),
    params:
        config=config_json,
        results=results_dir,
    shell:
        "tokenmill stats --results-dir {params.results:q} --config-json {params.config:q}"
        " --out-dir $(dirname {output.summary:q}) > {log:q} 2>&1"


rule write_dataset_card:
    input:
        stats=res("stats/summary.json"),
        dataset=all_shard_files("dataset/{category}/{shard}.parquet"),
    output:
        card=res("dataset/README.md"),
    log:
        res("logs/card.log"),
    params:
        config=config_json,
        results=results_dir,
    shell:
        "tokenmill card --results-dir {params.results:q} --config-json {params.config:q}"
        " --stats {input.stats:q} --out {output.card:q} > {log:q} 2>&1"


rule write_provenance:
    input:
        final_outputs_except_provenance,
    output:
        provenance=res("provenance.json"),
    log:
        res("logs/provenance.log"),
    params:
        config=config_json,
        results=results_dir,
        configfiles=workflow.configfiles,
    shell:
        "tokenmill provenance --results-dir {params.results:q} --config-json {params.config:q}"
        " --configfiles {params.configfiles:q} --out {output.provenance:q} > {log:q} 2>&1"


rule compare_with_manifest:
    input:
        provenance=res("provenance.json"),
    output:
        report=res("reproduce/report.json"),
    log:
        res("logs/reproduce.log"),
    params:
        manifest=config["reproduce"] or "",
        results=results_dir,
    shell:
        "tokenmill provenance --compare {params.manifest:q} --results-dir {params.results:q}"
        " --report-only --out {output.report:q} > {log:q} 2>&1"
