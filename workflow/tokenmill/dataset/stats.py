"""`tokenmill stats`: counts, length distributions, throughput, conservation check, plots.

    tokenmill stats --results-dir results --config-json CONFIG.json --out-dir results/stats

Writes summary.json, summary.md and one PNG histogram per length metric (PLOT_FILES, categories
overlaid). Exits 1 (after writing the summary) when the counts do not add up.

summary.json (keys sorted; "schema": "tokenmill.stats/1"):

    categories.<name> / overall:
      stages.<prepare|tokenize|generate|merge>:
          in, kept, rejected, reasons {code: n}, in_source ("metadata" or "inferred")
      finish_types {stop|length|abort|null: n}          (generated rows)
      lengths.<prompt|output|reasoning|answer|total>_tokens:
          count, sum, mean, p50, p90, p99, max          (dataset rows; linear percentiles)
      prefix_cache: cached_tokens, prompt_tokens, hit_rate (sum cached / sum prompt tokens)
      generation: wall_time_s, output_tokens, output_tokens_per_s, gpus,
                  gpu_hours, output_tokens_per_gpu_hour
      token_coverage: loss_tokens, distinct_ids, vocab_size, top_n [{n, ids, capped, share}],
                  ids_for_share {0.9|0.95|0.99|0.999: ids}   (draft_vocab.coverage_view, from
                  results/token_counts/{category}.parquet and _all.parquet; absent without them)
    conservation: ok, problems [..]

token_coverage.png: the same coverage as curves (share of loss tokens on the top-N ids).

Counting: kept = rows in the stage's output files, rejected = rows in its rejected files,
in = the stage's `tokenmill.records_in` metadata (summed over shards; when every tokenized
shard repeats the category's total, that total), or, where no stage wrote it, the previous
stage's kept ("inferred"). Checks, for every category: in = kept + rejected at each stage, and
each stage's in = the previous stage's kept (merge: generate kept + merge's not_generated).

Throughput: wall time is the sum over generate jobs of the meta files' wall time
(`wall_time_s`, else end - start); output tokens are completion tokens of generated rows.
GPU-hours = wall time x generation.resources.gpus; CPU runs (gpus 0) count as 1 GPU so the
figure stays defined (it is then "per device-hour").
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import contracts
from tokenmill.dataset import draft_vocab

STAGES = ("prepare", "tokenize", "generate", "merge")
METRICS = ("prompt_tokens", "output_tokens", "reasoning_tokens", "answer_tokens", "total_tokens")
PLOT_FILES = tuple(f"length_{m}.png" for m in METRICS)
COVERAGE_PLOT = "token_coverage.png"


def _rows(files) -> int:
    return sum(pq.ParquetFile(f).metadata.num_rows for f in files)


def _int_meta(files, key) -> list[int] | None:
    vals = []
    for f in files:
        v = contracts.read_metadata(f).get(key)
        if v is None:
            return None
        vals.append(int(v))
    return vals


def _reasons(files) -> dict[str, int]:
    out: dict[str, int] = {}
    for f in files:
        for r in pq.read_table(f, columns=["reason"]).column(0).to_pylist():
            out[r] = out.get(r, 0) + 1
    return dict(sorted(out.items()))


def _stage(out_files, rej_files, in_key="tokenmill.records_in", repeated_total=False):
    kept, rejected = _rows(out_files), _rows(rej_files)
    ins = _int_meta(out_files, in_key) if out_files else None
    value = None
    if ins:
        value = sum(ins)
        if repeated_total and len(set(ins)) == 1 and value != kept + rejected:
            value = ins[0]  # every shard carries the category total
    return {
        "in": value,
        "kept": kept,
        "rejected": rejected,
        "reasons": _reasons(rej_files),
        "in_source": "metadata" if value is not None else "inferred",
    }


def distribution(values: np.ndarray) -> dict:
    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        return {
            "count": 0,
            "sum": 0,
            "mean": None,
            "p50": None,
            "p90": None,
            "p99": None,
            "max": None,
        }
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {
        "count": int(values.size),
        "sum": int(values.sum()),
        "mean": round(float(values.mean()), 4),
        "p50": round(float(p50), 4),
        "p90": round(float(p90), 4),
        "p99": round(float(p99), 4),
        "max": int(values.max()),
    }


def _wall_time(meta: dict) -> float:
    for key in ("wall_time_s", "wall_s", "wall_time"):
        if isinstance(meta.get(key), int | float):
            return float(meta[key])
    start, end = (
        meta.get("start_time") or meta.get("start"),
        meta.get("end_time") or meta.get("end"),
    )
    try:
        if isinstance(start, int | float) and isinstance(end, int | float):
            return float(end - start)
        return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()
    except (TypeError, ValueError):
        return 0.0


def _category(results: Path, cat: str, gpus: int) -> tuple[dict, dict]:
    """(summary of one category, raw length arrays for the overall summary and plots)."""
    rej = results / "rejected"
    prompts = [p for p in [results / "prompts" / f"{cat}.parquet"] if p.exists()]
    tokenized = sorted((results / "tokenized" / cat).glob("*.parquet"))
    generated = sorted((results / "generated" / cat).glob("*.parquet"))
    dataset = sorted((results / "dataset" / cat).glob("*.parquet"))
    stages = {}
    if prompts:
        stages["prepare"] = _stage(
            prompts, [p for p in [rej / "prepare" / f"{cat}.parquet"] if p.exists()]
        )
    if tokenized:
        tok_rej = [p for p in [rej / "tokenize" / f"{cat}.parquet"] if p.exists()]
        tok_rej += sorted((rej / "tokenize" / cat).glob("*.parquet"))
        stages["tokenize"] = _stage(tokenized, tok_rej, repeated_total=True)
    if generated:
        stages["generate"] = _stage(generated, sorted((rej / "generate" / cat).glob("*.parquet")))
    if dataset:
        stages["merge"] = _stage(dataset, sorted((rej / "merge" / cat).glob("*.parquet")))
        stages["merge"]["not_generated"] = sum(_int_meta(dataset, "tokenmill.not_generated") or [0])

    finish: dict[str, int] = {}
    cached = prompt_tok = out_tok = 0
    for f in generated:
        t = pq.read_table(
            f, columns=["finish_type", "cached_tokens", "prompt_tokens", "completion_tokens"]
        )
        for k, n in zip(
            *np.unique(np.asarray(t.column(0).fill_null("null")), return_counts=True), strict=True
        ):
            finish[str(k)] = finish.get(str(k), 0) + int(n)
        cached += int(pc.sum(t.column("cached_tokens")).as_py() or 0)
        prompt_tok += int(pc.sum(t.column("prompt_tokens")).as_py() or 0)
        out_tok += int(pc.sum(t.column("completion_tokens")).as_py() or 0)
    wall = 0.0
    for m in sorted((results / "generated" / cat).glob("*.meta.json")):
        wall += _wall_time(json.loads(m.read_text()))

    raw = {m: np.zeros(0, np.int64) for m in METRICS}
    if dataset:
        cols = [f"num_{m}" for m in METRICS]
        parts = [pq.read_table(f, columns=cols) for f in dataset]
        for m in METRICS:
            arrs = [p.column(f"num_{m}").drop_null().to_numpy() for p in parts]
            raw[m] = np.concatenate(arrs).astype(np.int64) if arrs else raw[m]
    summary = {
        "stages": stages,
        "finish_types": dict(sorted(finish.items())),
        "lengths": {m: distribution(raw[m]) for m in METRICS},
        "prefix_cache": _cache(cached, prompt_tok),
        "generation": _throughput(wall, out_tok, gpus),
    }
    return summary, raw


def _cache(cached, prompt_tok):
    return {
        "cached_tokens": cached,
        "prompt_tokens": prompt_tok,
        "hit_rate": round(cached / prompt_tok, 6) if prompt_tok else None,
    }


def _throughput(wall, out_tok, gpus):
    gpu_hours = wall * gpus / 3600
    return {
        "wall_time_s": round(wall, 3),
        "output_tokens": out_tok,
        "output_tokens_per_s": round(out_tok / wall, 3) if wall else None,
        "gpus": gpus,
        "gpu_hours": round(gpu_hours, 6),
        "output_tokens_per_gpu_hour": round(out_tok / gpu_hours, 3) if gpu_hours else None,
    }


def conservation(categories: dict) -> list[str]:
    problems = []
    for cat, s in categories.items():
        prev_kept, prev_name = None, None
        for name in STAGES:
            st = s["stages"].get(name)
            if st is None:
                continue
            feed = prev_kept
            if name == "merge" and feed is not None:
                feed += st.get("not_generated", 0)
            if st["in"] is None:
                st["in"] = feed
            if st["in"] is not None and st["in"] != st["kept"] + st["rejected"]:
                problems.append(
                    f"category {cat}, stage {name}: in={st['in']} != kept={st['kept']} + "
                    f"rejected={st['rejected']}"
                )
            if feed is not None and st["in_source"] == "metadata" and st["in"] != feed:
                problems.append(
                    f"category {cat}, stage {name}: in={st['in']} != {prev_name} kept="
                    f"{prev_kept}"
                    + (f" + not_generated={feed - prev_kept}" if feed != prev_kept else "")
                )
            prev_kept, prev_name = st["kept"], name
    return problems


def collect(results_dir, config: dict) -> tuple[dict, dict]:
    """(summary, {category: raw length arrays})."""
    results = Path(results_dir)
    names = set(config.get("categories", {}))
    for stage_dir in ("tokenized", "generated", "dataset"):
        if (results / stage_dir).is_dir():
            names |= {p.name for p in (results / stage_dir).iterdir() if p.is_dir()}
    names.discard(draft_vocab.MAPPING_DIR)  # results/dataset/vocab_mapping is no category
    if (results / "prompts").is_dir():
        names |= {p.stem for p in (results / "prompts").glob("*.parquet")}
    gpus = int(config.get("generation", {}).get("resources", {}).get("gpus", 1)) or 1
    cats, raws = {}, {}
    for cat in sorted(names):
        cats[cat], raws[cat] = _category(results, cat, gpus)
    problems = conservation(cats)
    overall = _overall(cats, raws, gpus)
    _token_coverage(results, cats, overall, config)
    summary = {
        "schema": "tokenmill.stats/1",
        "categories": cats,
        "overall": overall,
        "conservation": {"ok": not problems, "problems": problems},
    }
    return summary, raws


def _overall(cats, raws, gpus) -> dict:
    stages: dict = {}
    finish: dict = {}
    for s in cats.values():
        for name, st in s["stages"].items():
            o = stages.setdefault(name, {"in": 0, "kept": 0, "rejected": 0, "reasons": {}})
            o["in"] = None if o["in"] is None or st["in"] is None else o["in"] + st["in"]
            o["kept"] += st["kept"]
            o["rejected"] += st["rejected"]
            for k, v in st["reasons"].items():
                o["reasons"][k] = o["reasons"].get(k, 0) + v
        for k, v in s["finish_types"].items():
            finish[k] = finish.get(k, 0) + v
    lengths = {}
    for m in METRICS:
        arrs = [r[m] for r in raws.values()]
        lengths[m] = distribution(np.concatenate(arrs) if arrs else np.zeros(0))
    cached = sum(s["prefix_cache"]["cached_tokens"] for s in cats.values())
    prompt_tok = sum(s["prefix_cache"]["prompt_tokens"] for s in cats.values())
    wall = sum(s["generation"]["wall_time_s"] for s in cats.values())
    out_tok = sum(s["generation"]["output_tokens"] for s in cats.values())
    return {
        "stages": stages,
        "finish_types": dict(sorted(finish.items())),
        "lengths": lengths,
        "prefix_cache": _cache(cached, prompt_tok),
        "generation": _throughput(wall, out_tok, gpus),
    }


def _coverage_counts(results: Path, names) -> dict:
    """{category or "all": dense counts} of the count sums that exist."""
    out = {}
    for name in names:
        path = results / draft_vocab.COUNTS_DIR / f"{name}.parquet"
        if path.is_file():
            out[name] = draft_vocab.read_counts(path)
    return out


def _token_coverage(results: Path, cats: dict, overall: dict, config: dict) -> None:
    draft_size = (config.get("dataset") or {}).get("draft_vocab_size")
    found = _coverage_counts(results, [*cats, draft_vocab.ALL_COUNTS])
    for name, counts in found.items():
        scope = overall if name == draft_vocab.ALL_COUNTS else cats[name]
        scope["token_coverage"] = draft_vocab.coverage_view(counts, draft_size)


def coverage_markdown(summary: dict) -> list[str]:
    """The token-coverage table (empty without counts)."""
    scopes = list(summary["categories"].items()) + [("**all**", summary["overall"])]
    scopes = [(c, s["token_coverage"]) for c, s in scopes if "token_coverage" in s]
    if not scopes:
        return []
    ref = scopes[-1][1]
    head = []
    for row in ref["top_n"]:
        label = f"top {row['n']:,}" + (" (draft)" if row.get("draft") else "")
        head.append(label + (f" (all {row['ids']:,})" if row["capped"] else ""))
    shares = list(ref["ids_for_share"])
    out = ["", "## Token coverage (loss-masked tokens)", ""]
    out += [
        "Share of the tokens the drafter is trained on (loss_mask = 1) that fall on the N most "
        "frequent token ids, i.e. what a draft vocabulary of N ids covers, and the fewest ids "
        f"that cover a share. The vocabulary has {ref['vocab_size']:,} ids; an N above it "
        "takes them all.",
        "",
        "| category | loss tokens | distinct ids | "
        + " | ".join(head)
        + " | "
        + " | ".join(f"ids for {float(x):.1%}" for x in shares)
        + " |",
        "|---|---:|---:|" + "---:|" * (len(head) + len(shares)),
    ]
    for cat, cov in scopes:
        cells = [f"{r['share']:.2%}" for r in cov["top_n"]]
        cells += [_fmt(cov["ids_for_share"][x]) for x in shares]
        out.append(
            f"| {cat} | {_fmt(cov['loss_tokens'])} | {_fmt(cov['distinct_ids'])} | "
            + " | ".join(cells)
            + " |"
        )
    return out


def coverage_plot(results_dir, summary: dict, out_dir: Path) -> Path:
    """token_coverage.png: share of loss tokens on the top-N ids, one curve per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = Path(results_dir)
    found = _coverage_counts(results, [*summary["categories"], draft_vocab.ALL_COUNTS])
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    if found:
        vocab = 1
        for name, counts in found.items():
            total = counts.sum()
            if not total:
                continue
            cum = np.cumsum(np.sort(counts)[::-1]) / total
            seen = max(int(np.count_nonzero(counts)), 1)
            x = np.arange(1, seen + 1)
            is_all = name == draft_vocab.ALL_COUNTS
            ax.plot(
                x,
                cum[:seen],
                color="black" if is_all else None,
                linewidth=2 if is_all else 1,
                label=f"all ({int(total):,} tokens)" if is_all else f"{name} ({int(total):,})",
            )
            vocab = max(vocab, counts.size)
        cov = summary["overall"].get("token_coverage") or {}
        for row in cov.get("top_n", []):
            if row["capped"]:
                continue
            ax.axvline(
                row["n"],
                color="red" if row.get("draft") else "grey",
                linestyle="--",
                linewidth=0.8,
            )
        ax.set_xscale("log")
        ax.set_xlim(1, vocab)
        ax.set_ylim(0, 1.01)
        ax.legend(fontsize=8, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no token counts", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("top-N token ids (log scale; dashed: 8k-64k, red: the draft vocabulary size)")
    ax.set_ylabel("share of loss-masked tokens")
    ax.set_title("Coverage of the loss-masked tokens by the most frequent ids")
    fig.tight_layout()
    path = out_dir / COVERAGE_PLOT
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path


def _fmt(v) -> str:
    return "" if v is None else (f"{v:,}" if isinstance(v, int) else f"{v:,.2f}")


def markdown(summary: dict) -> str:
    scopes = list(summary["categories"].items()) + [("**all**", summary["overall"])]
    out = ["# tokenmill dataset statistics", "", "## Records per stage", ""]
    out += ["| category | stage | in | kept | rejected | reasons |", "|---|---|---:|---:|---:|---|"]
    for cat, s in scopes:
        for name, st in s["stages"].items():
            reasons = ", ".join(f"{k}: {v}" for k, v in st["reasons"].items())
            out.append(
                f"| {cat} | {name} | {_fmt(st['in'])} | {_fmt(st['kept'])} | "
                f"{_fmt(st['rejected'])} | {reasons} |"
            )
    out += ["", "## Token lengths (dataset rows)", ""]
    out += [
        "| category | metric | count | mean | p50 | p90 | p99 | max |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for cat, s in scopes:
        for m, d in s["lengths"].items():
            out.append(
                f"| {cat} | {m} | "
                + " | ".join(_fmt(d[k]) for k in ("count", "mean", "p50", "p90", "p99", "max"))
                + " |"
            )
    out += ["", "## Generation", ""]
    out += [
        "| category | finish types | prefix-cache hit rate | wall time (s) | output tokens | "
        "tokens/s | tokens/GPU-hour |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for cat, s in scopes:
        g, c = s["generation"], s["prefix_cache"]
        finish = ", ".join(f"{k}: {v}" for k, v in s["finish_types"].items())
        out.append(
            f"| {cat} | {finish} | {_fmt(c['hit_rate'])} | {_fmt(g['wall_time_s'])} | "
            f"{_fmt(g['output_tokens'])} | {_fmt(g['output_tokens_per_s'])} | "
            f"{_fmt(g['output_tokens_per_gpu_hour'])} |"
        )
    out += coverage_markdown(summary)
    c = summary["conservation"]
    out += ["", "## Conservation", "", "All counts add up." if c["ok"] else "Counts do NOT add up:"]
    out += [f"- {p}" for p in c["problems"]]
    return "\n".join(out) + "\n"


def plots(raws: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for m, fname in zip(METRICS, PLOT_FILES, strict=True):
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        data = {c: r[m] for c, r in raws.items() if r[m].size}
        if data:
            hi = max(int(v.max()) for v in data.values())
            bins = np.linspace(0, max(hi, 1), 41)
            for c, v in data.items():
                ax.hist(v, bins=bins, alpha=0.5, label=f"{c} (n={v.size})")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(m.replace("_", " "))
        ax.set_ylabel("samples")
        ax.set_title(f"{m.replace('_', ' ')} per sample")
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path, metadata={"Software": None})
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill stats")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--config-json", required=True, help="resolved config (file or JSON)")
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    from tokenmill.cli import json_arg

    summary, raws = collect(args.results_dir, json_arg(args.config_json))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    plots(raws, out)
    coverage_plot(args.results_dir, summary, out)
    if not summary["conservation"]["ok"]:
        print("tokenmill stats: counts do not add up:", file=sys.stderr)
        for p in summary["conservation"]["problems"]:
            print(f"  {p}", file=sys.stderr)
        return 1
    return 0
