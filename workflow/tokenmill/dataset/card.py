"""`tokenmill card`: the Hugging Face dataset card (results/dataset/README.md).

    tokenmill card --results-dir results --config-json CONFIG.json \
        --stats results/stats/summary.json --out results/dataset/README.md

The YAML front matter declares one `configs:` entry per category (data_files relative to the
dataset folder) plus a default `all`, so `datasets.load_dataset("results/dataset", name=cat)`
loads one category and `load_dataset("results/dataset")` loads everything.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from tokenmill import contracts, layout
from tokenmill.settings import ConfigError, as_settings, load_section, thaw

COLUMNS = [
    (
        "prompt_id",
        "string",
        "hash of the prompt's messages and tools (the conversation's in a multi-turn "
        "category): one id per distinct prompt, whatever its source",
    ),
    ("category", "string", "dataset category (a config of this dataset)"),
    ("sample_key", "string", "hash of prompt_ids and the generation fingerprint"),
    ("input_ids", "list<int32>", "prompt token ids (chat template applied) + generated ids"),
    ("loss_mask", "list<int8>", "0 over the prompt, 1 over the generated tokens"),
    ("num_prompt_tokens", "int32", "prompt length"),
    ("num_output_tokens", "int32", "generated length, the end-of-turn token included"),
    (
        "num_reasoning_tokens",
        "int32?",
        "generated tokens up to and including think-end (all of "
        "them when a thinking block was opened and never closed)",
    ),
    (
        "num_answer_tokens",
        "int32?",
        "generated tokens after think-end (all of them when no "
        "thinking block was open; 0 when one never closed)",
    ),
    ("num_total_tokens", "int32", "len(input_ids)"),
    ("finish_type", "string", "the engine's finish reason (stop or length)"),
]


def front_matter(files: dict[str, list[str]]) -> dict:
    """One `configs:` entry per category and a default `all`, each naming its shard files
    (paths relative to the dataset folder) as the config declares them: a file the config
    does not declare is never loaded, whatever else lies in the folder."""
    configs = [
        {
            "config_name": "all",
            "data_files": [{"split": "train", "path": [f for fs in files.values() for f in fs]}],
            "default": True,
        }
    ]
    for cat, cat_files in files.items():  # no category is named "all" (config.py)
        configs.append({"config_name": cat, "data_files": [{"split": "train", "path": cat_files}]})
    return {
        "pretty_name": "tokenmill EAGLE-3 drafter training data",
        "tags": ["speculative-decoding", "eagle3", "token-ids", "synthetic"],
        "task_categories": ["text-generation"],
        "configs": configs,
    }


def render(results_dir, config: dict, summary: contracts.StatsSummary | None) -> str:
    config = as_settings(config)
    lay = layout.Layout(str(results_dir), config.journal_dir)
    dataset = Path(lay.dataset_dir())
    shards = {c: [Path(lay.dataset(c, s)) for s in names]
              for c, names in layout.declared(config).items()}  # fmt: skip
    files = {c: [p.relative_to(dataset).as_posix() for p in ps] for c, ps in shards.items()}
    categories = list(shards)
    tok_fps = set()
    for f in (p for ps in shards.values() for p in ps if p.exists()):
        fp = contracts.read_metadata(f).get(contracts.META_TOKENIZER_FINGERPRINT)
        if fp:
            tok_fps.add(fp)
    gen, tok = config.generation, config.tokenizer
    lines = ["---", yaml.safe_dump(front_matter(files), sort_keys=False).rstrip(), "---", ""]
    lines += [
        "# tokenmill EAGLE-3 drafter training data",
        "",
        "Training data for an EAGLE-3 speculative-decoding drafter, stored as **raw token ids**. "
        "Each row is a prompt (the chat template applied by the target model's tokenizer) and "
        "the target model's own response to it, generated token by token through SGLang's "
        "native `/generate` API. No text was decoded, parsed or re-tokenized: `input_ids` is "
        "exactly what the target model saw and produced, the end-of-turn token included.",
        "",
        "## How it was made",
        "",
        f"- Target model: `{gen.model}` (revision `{gen.revision}`), engine `{gen.engine}`",
        f"- Tokenizer: `{tok.path}` (revision `{tok.revision}`), fingerprint "
        + ", ".join(f"`{fp}`" for fp in sorted(tok_fps) or ["unknown"]),
        f"- Chat template kwargs: `{contracts.canonical_json(thaw(tok.chat_template_kwargs))}`",
        f"- Sampling: `{contracts.canonical_json(thaw(gen.sampling))}`, stop tokens "
        f"`{contracts.canonical_json(thaw(gen.stop_tokens))}`, seed policy "
        f"`{gen.seed_policy}`",
        "- Rejected samples (truncated, aborted, missing stop token, too long, ...) are not in "
        "this dataset; they are listed with a reason in the pipeline's `rejected/` folder.",
        "- This folder's `provenance.json` lists each of its files with its sha256, and the "
        "config, tokenizer, model and engine that made them. `tokenmill verify <this folder>` "
        "checks a copy against it; `tokenmill reproduce-config <this folder>/provenance.json "
        "--out repro.yaml` writes the config that regenerates it.",
        "",
        "## Loading",
        "",
        "```python",
        "from datasets import load_dataset",
        'ds = load_dataset("path/to/dataset", name="all", split="train")  # or a category',
        "```",
        "",
        "Configs: " + ", ".join(f"`{c}`" for c in ["all"] + [c for c in categories if c != "all"]),
        "",
        "## Columns",
        "",
        "| column | type | meaning |",
        "|---|---|---|",
    ]
    lines += [f"| `{n}` | {t} | {d} |" for n, t, d in COLUMNS]
    lines += _conversations_section(shards, summary)
    if config.dataset.draft_vocab_size is not None:
        lines += _draft_vocab_section(Path(lay.vocab_mapping_summary()))
    if summary:
        lines += ["", "## Statistics", ""]
        lines += [
            "| category | rows | prompt tokens (mean) | output tokens (mean / p99) | "
            "total tokens (mean / max) | unterminated reasoning |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        scopes = [*summary.categories.items(), ("all", summary.overall)]
        for cat, s in scopes:
            L = s.lengths
            lines.append(
                f"| {cat} | {L['total_tokens'].count} | {_known(L['prompt_tokens'].mean)} | "
                f"{_known(L['output_tokens'].mean)} / {_known(L['output_tokens'].p99)} | "
                f"{_known(L['total_tokens'].mean)} / {_known(L['total_tokens'].max)} | "
                f"{_known(s.reasoning.unterminated)} |"
            )
        g, c = summary.overall.generation, summary.overall.prefix_cache
        lines += [
            "",
            "Unterminated reasoning: outputs that opened a thinking block and never closed it "
            "(their tokens are reasoning, not answer). Generation: "
            f"{_known(g.output_tokens_per_s)} output tokens/s, "
            f"{_known(g.gpu_hours, 3)} GPU-hours, prefix-cache hit rate "
            f"{_known(c.hit_rate, 3)} (unknown: not reported by the engine, or not the "
            "run's own GPUs).",
        ]
    return "\n".join(lines) + "\n"


def _conversations_section(
    shards: dict[str, list[Path]], summary: contracts.StatsSummary | None
) -> list[str]:
    """How the `context: regenerated` categories' rows differ (docs/multi-turn.md)."""
    convs = [
        c for c, paths in shards.items()
        if any(contracts.is_regenerated(f) for f in paths if f.exists())
    ]  # fmt: skip
    if not convs:
        return []
    lines = [
        "",
        "## Multi-turn conversations",
        "",
        "In " + ", ".join(f"`{c}`" for c in convs) + " every assistant turn of a conversation "
        "was regenerated in order, each on top of the target model's own earlier answers "
        "(the dataset's answers were replaced, token-exact). `prompt_id` is the "
        "conversation's id. Where the chat template renders history exactly as generated, a "
        "conversation is one row with `loss_mask` 1 over every regenerated turn's tokens; "
        "otherwise (templates that drop earlier reasoning, such as Kimi-K2.5's and Qwen3's) "
        "each turn is a row, its prompt being what a serving engine feeds the model for that "
        "conversation. A conversation ends early at a tool call the model made differently "
        "from the dataset (the dataset's tool results would answer a call it did not make).",
    ]
    scopes = summary.categories if summary else {}
    rows = [(c, scopes[c].conversations) for c in convs if c in scopes and scopes[c].conversations]
    if rows:
        lines += [
            "",
            "| category | conversations | turns kept | rows: one per conversation | "
            "rows: one per turn | conversation ends |",
            "|---|---:|---:|---:|---:|---|",
        ]
        for cat, c in rows:
            ends = ", ".join(f"{k}: {v}" for k, v in c.ends.items())
            lines.append(
                f"| {cat} | {c.conversations} | {c.turns_kept} | "
                f"{c.conversation_samples} | {c.turn_samples} | {ends} |"
            )
    return lines


def _known(value, digits: int = 1) -> str:
    """A statistic as the card prints it: "unknown" for None, a float rounded to `digits`
    decimals (summary.json keeps the full value)."""
    if value is None:
        return "unknown"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _draft_vocab_section(path: Path) -> list[str]:
    """What vocab_mapping/ holds, when the pipeline wrote it (dataset.draft_vocab_size)."""
    from tokenmill.dataset import draft_vocab

    if not path.is_file():
        return []
    m = json.loads(path.read_text())
    files = ", ".join(f"`{draft_vocab.MAPPING_DIR}/{f}`" for f in m["files"])
    return [
        "",
        "## Draft vocabulary",
        "",
        f"`{draft_vocab.MAPPING_DIR}/` holds the EAGLE-3 draft vocabulary of this dataset: the "
        f"{m['draft_size']:,} token ids most frequent where `loss_mask` is 1 (out of "
        f"{m['target_vocab_size']:,}"
        + (f"; always in: {m['always_include_ids']}" if m["always_include_ids"] else "")
        + (
            f"; counted over the first {m['max_train_length']:,} tokens of each row"
            if m.get("max_train_length")
            else ""
        )
        + f"), covering {m['draft_coverage']:.2%} of the {m['loss_tokens']:,} loss tokens. "
        f"Files: {files} (`d2t-N.npy`/`t2d-N.npy`: vLLM speculators finds them in its "
        "`--data-path` under these names, or takes `--d2t-path`/`--t2d-path`; "
        "`vocab_mapping.pt` for SpecForge's `model.vocab_mapping_path`; target id = draft id + "
        "`d2t[draft id]`).",
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill card")
    parser.add_argument("--results-dir", default="results")
    parser.add_argument("--config-json", required=True, help="resolved config (file or JSON)")
    parser.add_argument("--stats", help="results/stats/summary.json")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        config = load_section(args.config_json, None)
    except ConfigError as exc:
        print(f"tokenmill card: {exc}", file=sys.stderr)
        return 1
    try:
        summary = contracts.StatsSummary.read(args.stats) if args.stats else None
    except contracts.RecordError as exc:
        print(f"tokenmill card: {exc}", file=sys.stderr)
        return 1
    text = render(args.results_dir, config, summary)
    tmp = contracts.atomic_path(args.out)
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
