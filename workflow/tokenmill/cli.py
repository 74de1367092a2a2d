"""`tokenmill <command> ...`: one command per pipeline stage, each implemented in its module.

Modules are imported lazily so that `tokenmill prepare` does not pay for importing torch.
Each module exposes `main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "check-config": ("tokenmill.config", "validate a config file and print it resolved"),
    "prepare": ("tokenmill.prepare.stage", "sources of one category -> normalized prompts"),
    "tokenize": ("tokenmill.tokenization.stage", "prompts of one category -> tokenized shards"),
    "generate": ("tokenmill.generate.stage", "one tokenized shard -> generated token shard"),
    "plan": ("tokenmill.plan", "per category: requests, tokens, GPU-hours still to go"),
    "serve-reference": (
        "tokenmill.testing.reference_api",
        "CPU engine speaking SGLang's native API",
    ),
    "token-facts": (
        "tokenmill.dataset.validate",
        "tokenizer -> the token facts merge, stats and draft-vocab read",
    ),
    "merge": ("tokenmill.dataset.merge", "tokenized + generated shard -> validated training shard"),
    "verdict": ("tokenmill.dataset.verdict", "a category's rejection share over its shards"),
    "export-jsonl": ("tokenmill.dataset.export", "dataset shard -> JSONL of input_ids/loss_mask"),
    "hidden-states": (
        "tokenmill.hidden_states.stage",
        "dataset shard -> the target model's hidden states of its rows",
    ),
    "hidden-states-folder": (
        "tokenmill.hidden_states.training",
        "hidden-state shards -> the run's one training folder per layout",
    ),
    "draft-vocab": ("tokenmill.dataset.draft_vocab", "token counts -> EAGLE-3 draft vocabulary"),
    "stats": ("tokenmill.dataset.stats", "summary statistics, tables and plots"),
    "status": ("tokenmill.status", "how far generation is: per shard, rate, time left, failures"),
    "card": ("tokenmill.dataset.card", "write the dataset card (README.md) of results/dataset"),
    "provenance": ("tokenmill.provenance.manifest", "write provenance.json for a finished run"),
    "verify": ("tokenmill.provenance.verify", "check a directory against a provenance file"),
    "reproduce-config": (
        "tokenmill.provenance.reproduce",
        "config that reproduces a published run",
    ),
    "make-tiny-model": (
        "tokenmill.testing.tiny_model",
        "build the tiny offline tokenizer and model",
    ),
}


def usage() -> str:
    lines = ["usage: tokenmill <command> [options]", "", "commands:"]
    lines += [f"  {name:<16} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"tokenmill: unknown command '{name}'\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)
