"""`tokenmill verdict`: a category's rejection verdict, once its shards are in.

    tokenmill verdict --category C --config-json CONFIG --out results/rejected/verdict/C.json

Generate and merge run one job per shard, and a shard's share of rejections is a sample of its
category's: a shard fails on its own only on a share that chance cannot explain at the limit
(guards.shard_over_limit). The category's share is judged here, over every declared shard, by
the rule every guard applies (guards.over_limit):

    generate: prompts (conversations) it rejected, of those tokenized
              (generation.reject_limit)
    merge:    records it rejected, of those it judged, from each shard's count metadata
              (reject_limits.merge)

Over the limit: ONE guard line on stderr naming the category, the stage, the share and the top
reasons, exit 1, no output; the category's token sum (and so the card, the draft vocabulary,
the statistics and the provenance) waits for this verdict. Otherwise it writes the counts as a
contracts.CategoryVerdict.
"""

from __future__ import annotations

import argparse
import sys

import pyarrow.parquet as pq

from tokenmill import contracts, guards, layout
from tokenmill.settings import ConfigError, RejectLimitSettings, Settings, load_section


def _rows(path: str) -> int:
    return pq.ParquetFile(path).metadata.num_rows


def judge(settings: Settings, category: str, results_dir=None) -> contracts.CategoryVerdict:
    """The category's verdict (its files under `results_dir`, default the config's);
    guards.GuardError (its one line) when a stage is over its limit."""
    lay = layout.Layout(str(results_dir or settings.results_dir), str(settings.journal_dir))
    shards = layout.declared(settings)[category]
    tokenized = sum(_rows(lay.tokenized(category, s)) for s in shards)
    gen_rejected_files = [lay.rejected("generate", category, s) for s in shards]
    gen_rejected = sum(_rows(f) for f in gen_rejected_files)
    # merge's in / kept / rejected, summed over the shards' count metadata
    metas = [contracts.read_metadata(lay.dataset(category, s)) for s in shards]
    merged_in, merged_kept, merged_rejected = (
        sum(int(m[k]) for m in metas) for k in contracts.MERGE_COUNT_KEYS
    )
    stages = (
        ("generate", settings.generation.reject_limit, tokenized, gen_rejected,
         tokenized - gen_rejected, gen_rejected_files),
        ("merge", settings.reject_limits.merge, merged_in, merged_rejected, merged_kept,
         [lay.rejected("merge", category, s) for s in shards]),
    )  # fmt: skip
    verdicts = {}
    for stage, limit, judged, rejected, kept, files in stages:
        key = guards.limit_key(stage)
        why = guards.over_limit(judged, rejected, kept, limit, key=key)
        if why is not None:
            rows = [r for f in files for r in guards.rejected_rows(f)]
            raise guards.GuardError(
                guards.message(
                    stage,
                    category,
                    f"{why} over its {guards.plural(len(shards), 'shard')}",
                    guards.top_reasons(rows),
                    key,
                    outcome="its shards are kept (the journal holds every sample); the "
                    "category's card, statistics and draft vocabulary wait for a verdict",
                )  # fmt: skip
            )
        verdicts[stage] = _stage(judged, rejected, limit)
    return contracts.CategoryVerdict(
        category=category, shards=shards, generate=verdicts["generate"], merge=verdicts["merge"]
    )


def _stage(judged: int, rejected: int, limit: RejectLimitSettings) -> contracts.StageVerdict:
    return contracts.StageVerdict(judged, rejected, limit.max_fraction, limit.min_count)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill verdict", description=__doc__.split("\n")[0])
    parser.add_argument("--category", required=True)
    parser.add_argument("--config-json", required=True, help="the resolved config (or a file)")
    parser.add_argument("--results-dir", help="default: the config's results_dir")
    parser.add_argument("--out", required=True, help="results/rejected/verdict/{category}.json")
    args = parser.parse_args(argv)
    try:
        settings = load_section(args.config_json, None)
        if args.category not in settings.categories:
            raise ConfigError(f"categories: no category '{args.category}'")
        verdict = judge(settings, args.category, args.results_dir)
    except ConfigError as exc:
        print(f"tokenmill verdict: {exc}", file=sys.stderr)
        return 1
    except guards.GuardError as exc:
        guards.remove_outputs([args.out])
        print(exc, file=sys.stderr, flush=True)
        return 1
    verdict.write(args.out)
    g, m = verdict.generate, verdict.merge
    print(
        f"verdict {args.category}: generate rejected {g.rejected} of {g.judged}, merge "
        f"rejected {m.rejected} of {m.judged} over {len(verdict.shards)} shards: within limits",
        file=sys.stderr,
    )
    return 0
