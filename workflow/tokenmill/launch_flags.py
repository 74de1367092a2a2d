"""Launch flags of SGLang and vLLM: which can change a generated token and which cannot.

One table (`FLAGS`), grouped by reason. The generation fingerprint (keys.py) leaves the
**operational** flags out of the managed launch command, with their values; every other
argument counts, in order, as written. An unknown flag is token-affecting; a user declares
more operational flags in `generation.launch.operational_flags`. docs/engines.md shows the
same table (`markdown_table()`; tests/test_launch_flags.py keeps them equal).

Parsing: `--flag v` and `--flag=v` for a flag that takes a value, `--flag` alone for a switch.
The number of values per flag is the table's; a user-declared flag takes one value when the
next argument does not start with `-`, none otherwise.

Judgment calls (said here and in the docs): flags that only change how many requests share a
batch (memory fraction, running-request and queue limits, KV pool size) are operational. A
batch's composition already changes from run to run with arrival times, retries and restarts,
so a sample's tokens never depended on it in a way a key could pin; where the user wants
batch-independent numerics, `--enable-deterministic-inference` (token-affecting) is the flag
that gives them. Flags that change how one request is computed (prefill chunking, CUDA graphs,
torch.compile, the radix cache, kernels, dtypes, parallel layout) stay token-affecting.
"""

from __future__ import annotations

from dataclasses import dataclass

OPERATIONAL = "operational"
TOKEN_AFFECTING = "token-affecting"


@dataclass(frozen=True)
class FlagGroup:
    kind: str  # OPERATIONAL or TOKEN_AFFECTING
    reason: str
    flags: dict[str, int]  # flag -> number of values it takes (0: a switch)


FLAGS: tuple[FlagGroup, ...] = (
    # -- operational: left out of the fingerprint
    FlagGroup(
        OPERATIONAL,
        "where the server listens and how nodes find each other",
        {
            "--host": 1,
            "--port": 1,
            "--nccl-port": 1,
            "--node-rank": 1,
            "--dist-init-addr": 1,
            "--nccl-init-addr": 1,
        },
    ),
    FlagGroup(
        OPERATIONAL,
        "logging, tracing and metrics: what the server reports, not what it computes",
        {
            "--log-level": 1,
            "--log-level-http": 1,
            "--log-requests": 0,
            "--log-requests-level": 1,
            "--decode-log-interval": 1,
            "--show-time-cost": 0,
            "--enable-metrics": 0,
            "--enable-metrics-for-all-schedulers": 0,
            "--enable-request-time-stats-logging": 0,
            "--crash-dump-folder": 1,
            "--uvicorn-log-level": 1,
            "--disable-log-requests": 0,
            "--enable-log-requests": 0,
            "--disable-log-stats": 0,
            "--max-log-len": 1,
            "--disable-uvicorn-access-log": 0,
        },
    ),
    FlagGroup(
        OPERATIONAL,
        "timeouts and watchdogs: when a stuck server is given up on",
        {"--watchdog-timeout": 1, "--dist-timeout": 1},
    ),
    FlagGroup(
        OPERATIONAL,
        "credentials (also redacted everywhere)",
        {"--api-key": 1, "--admin-api-key": 1, "--hf-token": 1, "--token": 1},
    ),
    FlagGroup(
        OPERATIONAL,
        "memory and batch capacity: how many requests share a batch (judgment call: batch "
        "composition varies with arrival times anyway; --enable-deterministic-inference makes "
        "numerics independent of it)",
        {
            "--mem-fraction-static": 1,
            "--max-running-requests": 1,
            "--max-queued-requests": 1,
            "--max-total-tokens": 1,
            "--gpu-memory-utilization": 1,
            "--max-num-seqs": 1,
            "--swap-space": 1,
        },
    ),
    # -- token-affecting: in the fingerprint (so is every flag not in this table)
    FlagGroup(
        TOKEN_AFFECTING,
        "which weights and tokenizer: another model is other tokens",
        {
            "--model-path": 1,
            "--model": 1,
            "--revision": 1,
            "--tokenizer-path": 1,
            "--tokenizer": 1,
            "--tokenizer-mode": 1,
            "--load-format": 1,
            "--trust-remote-code": 0,
            "--skip-tokenizer-init": 0,
            "--chat-template": 1,
        },
    ),
    FlagGroup(
        TOKEN_AFFECTING,
        "numerics: dtypes, quantization and kernels change logits",
        {
            "--dtype": 1,
            "--quantization": 1,
            "--kv-cache-dtype": 1,
            "--attention-backend": 1,
            "--sampling-backend": 1,
            "--device": 1,
            "--enable-torch-compile": 0,
            "--disable-cuda-graph": 0,
            "--cuda-graph-max-bs": 1,
            "--enforce-eager": 0,
        },
    ),
    FlagGroup(
        TOKEN_AFFECTING,
        "how one request is computed: prefill chunking and prefix reuse change the reduction order",
        {
            "--chunked-prefill-size": 1,
            "--max-prefill-tokens": 1,
            "--max-num-batched-tokens": 1,
            "--disable-radix-cache": 0,
            "--enable-prefix-caching": 0,
            "--schedule-policy": 1,
        },
    ),
    FlagGroup(
        TOKEN_AFFECTING,
        "parallel layout: tensor, pipeline, data and expert parallelism change reductions",
        {
            "--tp-size": 1,
            "--tp": 1,
            "--tensor-parallel-size": 1,
            "--pp-size": 1,
            "--pipeline-parallel-size": 1,
            "--dp-size": 1,
            "--dp": 1,
            "--data-parallel-size": 1,
            "--ep-size": 1,
            "--expert-parallel-size": 1,
            "--enable-dp-attention": 0,
            "--nnodes": 1,
            "--load-balance-method": 1,
        },
    ),
    FlagGroup(
        TOKEN_AFFECTING,
        "sampling and determinism: seeds, default sampling, deterministic kernels",
        {
            "--random-seed": 1,
            "--seed": 1,
            "--enable-deterministic-inference": 0,
            "--preferred-sampling-params": 1,
            "--generation-config": 1,
        },
    ),
    FlagGroup(
        TOKEN_AFFECTING,
        "what a request may hold: longer or truncated contexts are other answers",
        {"--context-length": 1, "--max-model-len": 1, "--allow-auto-truncate": 0},
    ),
    FlagGroup(
        TOKEN_AFFECTING,
        "speculative decoding and adapters change the distribution or its numerics",
        {
            "--speculative-algorithm": 1,
            "--speculative-draft-model-path": 1,
            "--speculative-num-steps": 1,
            "--speculative-eagle-topk": 1,
            "--speculative-num-draft-tokens": 1,
            "--speculative-config": 1,
            "--lora-paths": 1,
            "--enable-lora": 0,
            "--lora-modules": 1,
        },
    ),
)


def operational_flags() -> dict[str, int]:
    """flag -> number of values, for every flag the table calls operational."""
    return {f: n for g in FLAGS if g.kind == OPERATIONAL for f, n in g.flags.items()}


def kind_of(flag: str) -> str:
    """OPERATIONAL or TOKEN_AFFECTING; a flag the table does not know is token-affecting."""
    for g in FLAGS:
        if flag in g.flags:
            return g.kind
    return TOKEN_AFFECTING


def token_affecting_args(command: list[str], extra_operational=()) -> list[str]:
    """The command without its operational flags and their values: what the fingerprint
    hashes. `extra_operational`: flags the user declared operational (config)."""
    table = operational_flags()
    extra = {f.split("=", 1)[0] for f in extra_operational} - set(table)
    out: list[str] = []
    i = 0
    while i < len(command):
        arg = command[i]
        flag = arg.split("=", 1)[0]
        if arg.startswith("-") and (flag in table or flag in extra):
            if "=" in arg:
                skip = 0
            elif flag in table:
                skip = table[flag]
            else:  # user-declared: a value follows unless the next argument is a flag
                nxt = command[i + 1] if i + 1 < len(command) else "-"
                skip = 0 if nxt.startswith("-") else 1
            i += 1 + skip
            continue
        out.append(arg)
        i += 1
    return out


def markdown_table() -> str:
    """The table as docs/engines.md shows it."""
    lines = ["| kind | flags | why |", "|---|---|---|"]
    for g in FLAGS:
        flags = ", ".join(f"`{f}`" if n == 0 else f"`{f} v`" for f, n in g.flags.items())
        lines.append(f"| {g.kind} | {flags} | {g.reason} |")
    return "\n".join(lines) + "\n"
