"""`tokenmill plan`: what the generate stage will cost, before it is paid for.

    tokenmill plan [--configfile config.yaml] [--throughput TOK_S] [--pilot N] [--json]

Per category, from the tokenized shards and the journal (the same keys `tokenmill generate`
computes, read through generate/journal.py's public functions):

    prompts, prompt tokens, shards (tokenized/configured), requests still to send, the mean
    output length and where it comes from, the expected output tokens, job hours, GPU-hours

Output length, best source first: a pilot of this invocation (`--pilot N`: N prompts per
category not yet journaled, chosen by sample key, i.e. a seeded hash order, generated with the
configured engine and sampling; their samples go to the journal, so the run does not pay for
them again), else the samples already in the journal (a measured distribution), else
`sampling.max_new_tokens` (an upper bound). Throughput (output tokens per second of ONE generate
job's engine): `--throughput`, else what the pilot measured (a lower bound: a pilot of a few
requests does not fill the engine's batch the way a shard does). Job hours = tokens to generate /
throughput; GPU-hours = job hours x GPUs per job (gpus x nnodes). Engine start-up (once per job)
is not included. The largest shard's hours are compared with generation.resources.runtime_min.
Each category's generate jobs: the memory, runtime, CPUs and GPUs they ask for at attempts 1, 2
and 3 (the profile's `retries: 2`), from jobs/resources.py, the resolver the rule uses.

A `context: regenerated` category (docs/multi-turn.md) counts conversations as prompts; its
requests still to send are the turns not journaled yet, found by replaying the journal as the
generate job does (generate/conversations.py). That is an upper bound ("<=" in the table): a
conversation ends early at a truncated turn or a tool call the model made differently.

When the generation fingerprint changed since a shard's last generate job (the
`generation-{shard}.json` beside its journal), a warning names the config keys that changed and
how many journaled samples of the shard no longer match (column `invalidated` of --json).

Prefix cache (`cache ceil shards/cat`): of the tokenized prompts' tokens (each prompt once; a
conversation's first turn), the share a cache holding every prefix could serve, in whole
dataset.prefix_cache_block blocks, with an engine per shard as assigned / one engine for the
whole category (prefix_reuse; a gap between them: categories.C.shard_by: prefix closes it).
Per token too in --json (`cache_ceiling`).

Truncation (`cut`, `max_new@keep`): of the outputs the length comes from (pilot or journal), the
share that ended at max_new_tokens (finish "length"; merge drops them), and the max_new_tokens
under which `--keep` (0.95) of them would have finished; unknown (`>max_new_tokens`, and a
warning) when more than 1 - keep were cut, since a cut output's true length is unknown.
GPU-hours of a category on `gpus: 0` (a CPU engine) are "unknown" (null in --json), not 0.

Run it before submitting (the tokenize stage must have run: `snakemake --until
tokenize_prompts ...`); a dry run cannot show it, because the generate jobs are behind the
tokenize checkpoint. `--pilot` starts the engine where it runs: in managed mode run it inside a
GPU allocation (`srun --gres=gpu:8 ... tokenmill plan --pilot 64`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill import contracts, keys, layout, prefix_reuse
from tokenmill.generate import conversations, job, journal
from tokenmill.jobs.resources import category_resources, gpus_per_job, job_resources
from tokenmill.redaction import redact
from tokenmill.settings import ConfigError, Settings, load_config_file

log = logging.getLogger("tokenmill.plan")


class CategoryPlan:
    """One category's shards, keys and journal state."""

    def __init__(
        self, config: dict, category: str, basedir: Path, settings: Settings | None = None
    ):
        self.settings = settings or Settings.from_config(config)
        gen = self.settings.generation
        self.category = category
        self.fingerprint = keys.generation_fingerprint(gen)
        lay = layout.Layout(
            str(basedir / self.settings.results_dir), str(basedir / self.settings.journal_dir)
        )
        self.journal_dir = Path(lay.journal)
        names = layout.declared(self.settings)[category]
        self.shards_configured = len(names)
        self.prompts = self.prompt_tokens = 0
        self.shards: dict[str, list] = {}  # shard -> [(Item, ...)] still to send
        self.shard_metadata: dict = {}  # one tokenized shard's metadata (stop token ids)
        self.wanted: dict[str, str] = {}  # key -> shard
        self.items: dict[str, object] = {}
        self.config, self.basedir = config, basedir
        self.conversation_shards: dict[str, Path] = {}
        self.fingerprint_changes: list[dict] = []  # job.fingerprint_change of each shard
        material = redact(keys.generation_material(gen))
        self.turns_left: dict[str, int] = {}  # conversation shard -> turns not journaled yet
        sends: list[list] = []  # per shard: the compact keys of its (first-turn) prompts
        for name in names:
            path = Path(lay.tokenized(category, name))
            if not path.exists():
                continue
            shard = job.Shard(str(path), self.fingerprint, gen.seed_policy)
            # Stop tokens as ids (tokenize resolved them into every shard's metadata).
            self.shard_metadata = shard.metadata
            self.prompts += len(shard)
            ntok = pq.read_table(path, columns=["num_prompt_tokens"]).column(0)
            self.prompt_tokens += int(pc.sum(ntok).as_py() or 0)
            batches = pq.ParquetFile(path).iter_batches(columns=["prompt_ids"])
            sends.append([k for b in batches for k in prefix_reuse.compact_keys(b.column(0))])
            self.shards[name] = []
            sj = journal.ShardJournal(self.journal_dir, category, name)
            conv = contracts.is_regenerated(path)
            change = job.fingerprint_change(
                sj, self.fingerprint, material, wanted=None if conv else set(shard.keys)
            )
            if change is not None:
                self.fingerprint_changes.append(change)
            if conv:
                self.conversation_shards[name] = path
                continue
            for i in range(len(shard)):
                if len(shard.ids(i)) and shard.keys[i] not in self.wanted:
                    self.wanted[shard.keys[i]] = name
                    self.items[shard.keys[i]] = shard.item(i)
        # what a prefix cache can serve of every prompt once (a conversation: its first turn)
        self.cache_ceiling = prefix_reuse.category_and_shards(
            sends, self.settings.dataset.prefix_cache_block
        )
        self.records: dict = {}
        self.refresh()

    def refresh(self) -> None:
        self.records, _ = journal.load(self.journal_dir, self.category, self.wanted)
        self.pending: dict[str, list] = {}  # conversation shard -> the next turns to send
        for name, path in self.conversation_shards.items():
            convs, records = self._replay(name, path)
            self.pending[name] = convs.pending()
            self.turns_left[name] = convs.turns_left()
            self.records.update(records)

    def _replay(self, name: str, path: Path):
        """The shard's conversations, replayed from the journal exactly as generate does, and
        the journaled records of their answered turns (by key)."""
        from tokenmill import engines

        gen, tok_cfg = self.settings.generation, self.settings.tokenizer
        stop_ids, _ = job.resolve_stop_ids(gen, tok_cfg, str(self.basedir), self.shard_metadata)
        convs = conversations.Conversations(
            path, self.fingerprint, gen.seed_policy, stop_ids, tok_cfg,
            str(self.basedir), engines.for_config(gen).prompt_at_fault,
        )  # fmt: skip
        sj = journal.ShardJournal(self.journal_dir, self.category, name)
        index = sj.open(None)
        try:
            convs.replay(index, sj.search_stale)
            answered = [k for k in convs.answered_keys() if index.has(k)]
            records = {}
            for start in range(0, len(answered), job.FETCH_ROWS):
                ks = answered[start : start + job.FETCH_ROWS]
                records.update(zip(ks, journal.table_to_records(index.fetch(ks)), strict=True))
        finally:
            index.close()
        return convs, records

    @property
    def tokenized(self) -> int:
        return len(self.shards)

    def to_send(self) -> dict[str, list]:
        out: dict[str, list] = {name: [] for name in self.shards}
        for key, name in self.wanted.items():
            if key not in self.records:
                out[name].append(self.items[key])
        for name, items in self.pending.items():
            out[name] = list(items)
        return out

    def requests_left(self) -> dict[str, int]:
        """Requests still to send per shard (conversation shards: every turn not journaled)."""
        return {name: self.turns_left.get(name, len(v)) for name, v in self.to_send().items()}

    def output_lengths(self) -> list[int]:
        return [length for length, _ in self.outputs()]

    def outputs(self) -> list[tuple[int, bool]]:
        """(output length, cut at max_new_tokens) of the journaled answers."""
        return [
            (len(r.get("output_ids") or []), r.get("finish_type") == "length")
            for r in self.records.values()
            if r.get("status") == "ok"
        ]


def truncation(outputs: list[tuple[int, bool]], keep: float) -> dict:
    """The share of outputs cut at max_new_tokens, and the max_new_tokens under which a share
    `keep` of them would have finished (an output of L tokens, its stop token included, needs
    max_new_tokens >= L). A cut output's true length is unknown (at least max_new_tokens), so
    the answer is None when more than 1 - keep were cut: raise max_new_tokens and pilot again."""
    n = len(outputs)
    cut = sum(1 for _, c in outputs if c)
    need = None
    if n and cut <= (1 - keep) * n:
        lengths = sorted(length for length, c in outputs if not c)
        rank = max(math.ceil(keep * n), 1)  # the rank-th shortest output must finish
        need = lengths[rank - 1] if rank <= len(lengths) else None
    return {
        "truncated": cut,
        "truncated_share": round(cut / n, 4) if n else None,
        "max_new_tokens_for_keep": need,
    }


def _row(
    cp: CategoryPlan, config: dict, throughput: float | None, pilot: dict | None, keep: float
) -> dict:
    gen = cp.settings.generation
    todo = cp.requests_left()
    n_send = sum(todo.values())
    outputs = (pilot or {}).get("outputs") or []
    if outputs:
        source = f"pilot n={len(outputs)}"
        if pilot["refused"]:  # asked for more; the engine refused some
            source += f" of {pilot['asked']} ({pilot['refused']} refused)"
    else:
        outputs = cp.outputs()
        source = f"journal n={len(outputs)}" if outputs else "max_new_tokens (upper bound)"
    lengths = [length for length, _ in outputs]
    mean_out = sum(lengths) / len(lengths) if lengths else float(gen.sampling["max_new_tokens"])
    res = category_resources(config, cp.category)
    row = {
        "category": cp.category,
        "prompts": cp.prompts,
        "prompt_tokens": cp.prompt_tokens,
        "shards": cp.shards_configured,
        "shards_tokenized": cp.tokenized,
        "journaled": len(cp.records),
        "invalidated": sum(c["records"] for c in cp.fingerprint_changes),
        "to_send": n_send,
        # block-aligned (dataset.prefix_cache_block), per token in the --json
        "cache_ceiling": {
            "block": cp.cache_ceiling[0].block,
            "category_per_block": cp.cache_ceiling[0].share("per_block"),
            "category_per_token": cp.cache_ceiling[0].share("per_token"),
            "shards_per_block": cp.cache_ceiling[1].share("per_block"),
            "shards_per_token": cp.cache_ceiling[1].share("per_token"),
        },
        "to_send_upper_bound": bool(cp.conversation_shards),
        "mean_output_tokens": round(mean_out, 1),
        "output_source": source,
        "expected_output_tokens": round(n_send * mean_out),
        "gpus_per_job": gpus_per_job(config, cp.category),
        "runtime_min": res.runtime_min,
        # what each generate job of the category asks SLURM for, attempt by attempt (the rule's
        # own resources: jobs/resources.py)
        "job_resources": job_request(config, cp.category),
        "job_hours": None,
        "gpu_hours": None,
        "largest_shard_min": None,
        **truncation(outputs, keep),
    }
    if pilot and pilot.get("asked") is not None:
        row["pilot_asked"], row["pilot_refused"] = pilot["asked"], pilot["refused"]
    if throughput:
        row["job_hours"] = round(row["expected_output_tokens"] / throughput / 3600, 3)
        # gpus: 0 (a CPU engine) has no GPU-hours: unknown, not 0
        if row["gpus_per_job"]:
            row["gpu_hours"] = round(row["job_hours"] * row["gpus_per_job"], 3)
        biggest = max(todo.values(), default=0)
        row["largest_shard_min"] = round(biggest * mean_out / throughput / 60, 1)
    return row


DEFAULT_KEEP = 0.95  # --keep
PLANNED_ATTEMPTS = 3  # attempts shown: profiles/slurm's `retries: 2` gives a job three


def job_request(config, category: str) -> dict:
    """The memory (MB), runtime (minutes), CPUs and GPUs one generate job of `category` asks
    for at attempts 1..PLANNED_ATTEMPTS, from the resolver the generate rule uses."""
    asked = [job_resources(config, category, n) for n in range(1, PLANNED_ATTEMPTS + 1)]
    first = asked[0]
    return {
        "mem_mb": [r["mem_mb"] for r in asked],
        "runtime_min": [r["runtime"] for r in asked],
        "cpus": first["cpus_per_task"],
        "gpus_per_job": gpus_per_job(config, category),
        "nodes": first["nodes"],
    }


def format_requests(rows: list[dict]) -> list[str]:
    """One line per category: what its generate jobs ask for at each attempt."""
    lines = []
    for r in rows:
        j = r["job_resources"]
        mem = "/".join(str(m) for m in j["mem_mb"])
        runtime = "/".join(str(m) for m in j["runtime_min"])
        nodes = f" on {j['nodes']} nodes" if j["nodes"] > 1 else ""
        attempts = "/".join(str(n) for n in range(1, len(j["mem_mb"]) + 1))
        lines.append(
            f"generate job {r['category']}: mem {mem} MB, runtime {runtime} min at attempts "
            f"{attempts}; {j['cpus']} CPUs, {j['gpus_per_job']} GPUs{nodes} (generation.resources)"
        )
    return lines


def tokenize_command(configfile: str = "config.yaml") -> str:
    """The one command that makes the tokenized shards plan reads (CPU only, no engine)."""
    return f"snakemake --profile profiles/local --configfile {configfile} --until tokenize_prompts"


def make_plan(
    config: dict,
    basedir: Path,
    throughput: float | None,
    pilot_n: int = 0,
    keep: float = DEFAULT_KEEP,
    configfile: str = "config.yaml",
) -> dict:
    settings = Settings.from_config(config)  # validated: a partial config fails naming the key
    plans = {c: CategoryPlan(config, c, basedir, settings) for c in sorted(settings.categories)}
    pilot = run_pilot(settings, basedir, plans, pilot_n) if pilot_n else None
    measured = (pilot or {}).get("throughput")
    used = throughput or measured
    rows = [_row(p, config, used, (pilot or {}).get(c), keep) for c, p in plans.items()]
    warnings = []
    for p in plans.values():
        warnings += [job.change_message(c) for c in p.fingerprint_changes]
    untokenized = [r for r in rows if r["shards_tokenized"] < r["shards"]]
    if untokenized:
        which = ", ".join(
            f"{r['category']} {r['shards_tokenized']}/{r['shards']}" for r in untokenized
        )
        warnings.append(
            f"shards not tokenized yet ({which}): the numbers count only what is; run first "
            f"(CPU only, no engine): {tokenize_command(configfile)}"
        )
    for r in rows:
        if r["largest_shard_min"] and r["largest_shard_min"] > r["runtime_min"]:
            warnings.append(
                f"{r['category']}: the largest shard needs ~{r['largest_shard_min']:.0f} min of "
                f"generation at {used:.0f} tok/s, more than runtime_min={r['runtime_min']}: "
                "more shards, or a longer runtime for this category (categories.X.resources)"
            )
        if r["truncated"] and r["max_new_tokens_for_keep"] is None:
            warnings.append(
                f"{r['category']}: {r['truncated_share']:.1%} of the outputs measured "
                f"({r['output_source']}) were cut at max_new_tokens="
                f"{settings.generation.sampling['max_new_tokens']} and merge drops them: raise "
                f"it (and pilot again) to keep {keep:.0%}"
            )

    from tokenmill.hidden_states.stage import estimate

    expected = {r["category"]: r["prompt_tokens"] + r["prompts"] * r["mean_output_tokens"]
                for r in rows}  # fmt: skip
    return {
        "hidden_states": estimate(settings, basedir, expected),
        "throughput_tok_s": used,
        "throughput_source": "--throughput" if throughput else ("pilot" if measured else None),
        "pilot": {
            k: v for k, v in (pilot or {}).items() if k in ("requests", "wall_s", "output_tokens")
        }
        or None,
        "keep": keep,
        "max_new_tokens": settings.generation.sampling["max_new_tokens"],
        "categories": rows,
        "warnings": warnings,
    }


COLUMNS = [
    ("category", "category"),
    ("prompts", "prompts"),
    ("prompt_tokens", "prompt tok"),
    ("shards", "shards"),
    ("to_send", "to send"),
    ("mean_output_tokens", "mean out"),
    ("output_source", "out from"),
    ("expected_output_tokens", "exp. out tok"),
    ("job_hours", "job h"),
    ("gpu_hours", "GPU h"),
    ("truncated_share", "cut"),
    ("max_new_tokens_for_keep", "max_new@keep"),
    ("cache_ceiling", "cache ceil shards/cat"),
]


UPPER_BOUNDED = ("to_send", "expected_output_tokens", "job_hours", "gpu_hours")


def format_table(plan: dict) -> str:
    rows = plan["categories"]
    total = {"category": "total", "output_source": ""}
    for key in ("prompts", "prompt_tokens", "to_send", "expected_output_tokens"):
        total[key] = sum(r[key] for r in rows)
    total["shards"] = sum(r["shards"] for r in rows)
    for key in ("job_hours", "gpu_hours"):
        vals = [r[key] for r in rows]
        total[key] = round(sum(vals), 3) if all(v is not None for v in vals) else None
    if any(r["job_hours"] is not None and r["gpu_hours"] is None for r in rows):
        total["gpu_hours"] = None  # unknown for a category on gpus: 0
    total["mean_output_tokens"] = ""
    total["truncated_share"] = total["max_new_tokens_for_keep"] = None
    total["to_send_upper_bound"] = any(r["to_send_upper_bound"] for r in rows)

    def cell(r, key):
        v = r.get(key)
        if key == "shards" and "shards_tokenized" in r and r["shards_tokenized"] != r["shards"]:
            return f"{r['shards_tokenized']}/{r['shards']}"
        if key == "gpu_hours" and v is None and r.get("job_hours") is not None:
            return "unknown"  # gpus: 0
        if key == "truncated_share":
            return "-" if v is None else f"{v:.1%}"
        if key == "cache_ceiling":
            if not v or v["category_per_block"] is None:
                return "-"
            return f"{v['shards_per_block']:.2f}/{v['category_per_block']:.2f}"
        if key == "max_new_tokens_for_keep" and v is None and r.get("truncated"):
            return f">{plan['max_new_tokens']}"
        if v is not None and key in UPPER_BOUNDED and r["to_send_upper_bound"]:
            return f"<={v}"  # conversations may end before their last turn
        return "-" if v is None else str(v)

    table = [[title for _, title in COLUMNS]]
    table += [[cell(r, k) for k, _ in COLUMNS] for r in [*rows, total]]
    widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
    lines = [
        "  ".join(
            c.ljust(w) if i in (0, 6) else c.rjust(w)
            for i, (c, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    tput = plan["throughput_tok_s"]
    if not tput:
        lines.append("throughput: not given (--throughput TOK_S, or --pilot N): no hours")
    elif plan["throughput_source"] == "--throughput":
        lines.append(f"throughput: {tput:g} output tok/s per generate job (--throughput)")
    else:
        pilot = plan["pilot"] or {}
        lines.append(
            f"throughput: {_tok_s(tput)} output tok/s per generate job (pilot: "
            f"{pilot.get('output_tokens')} output tokens of {pilot.get('requests')} requests in "
            f"{pilot.get('wall_s')} s, engine start-up excluded)"
        )
    lines += format_requests(rows)
    lines.append(
        f"cut: outputs that ended at max_new_tokens={plan['max_new_tokens']} (merge drops "
        f"them); max_new@keep: the max_new_tokens under which {plan['keep']:.0%} of them "
        "would have finished (--keep)"
    )
    from tokenmill.hidden_states.stage import format_estimate

    lines += format_estimate(plan.get("hidden_states"))
    lines += [f"warning: {w}" for w in plan["warnings"]]
    return "\n".join(lines)


def _tok_s(v: float) -> str:
    return f"{v:.1f}" if v >= 1 else f"{v:.3g}"


# ---------------------------------------------------------------------------------- pilot


def run_pilot(settings: Settings, basedir: Path, plans: dict, n: int) -> dict:
    """Generate up to n not-yet-journaled prompts per category with the configured engine
    (one engine for all categories), journal them, measure lengths and throughput."""
    return asyncio.run(_pilot(settings, basedir, plans, n))


async def _pilot(settings: Settings, basedir: Path, plans: dict, n: int) -> dict:
    from tokenmill import engines
    from tokenmill.engines.launch import ExternalEngines, ManagedEngine
    from tokenmill.generate.client import Client, ClientOptions, Stats

    gen = settings.generation
    api = engines.for_config(gen)
    engines.validate(gen)
    chosen = []  # (category, shard, item)
    for cat, cp in plans.items():
        todo = [(name, it) for name, items in cp.to_send().items() for it in items]
        todo.sort(key=lambda x: x[1].key)  # sample keys are hashes: a seeded, stable sample
        chosen += [(cat, name, it) for name, it in todo[:n]]
    if not chosen:
        return {}
    api_key = job.api_key(gen)
    shard_meta = next((cp.shard_metadata for cp in plans.values() if cp.shard_metadata), {})
    stop_ids, _ = job.resolve_stop_ids(gen, settings.tokenizer, str(basedir), shard_meta)
    opts = ClientOptions.from_config(gen, stop_ids, api_key)
    managed = gen.managed
    log_dir = Path(layout.Layout(str(basedir / settings.results_dir), "").log("plan")).with_suffix(
        ""
    )
    engine = (
        ManagedEngine(gen, log_dir, basedir, api_key, api=api)
        if managed
        else ExternalEngines(gen, api_key, api=api, basedir=basedir)
    )
    where = {it.key: (cat, name) for cat, name, it in chosen}
    writers: dict = {}
    outputs: dict[str, list[tuple[int, bool]]] = {cat: [] for cat in plans}
    refused: dict[str, int] = dict.fromkeys(plans, 0)

    def on_record(rec: dict) -> None:
        cat, name = where[rec["key"]]
        if (cat, name) not in writers:
            writers[cat, name] = journal.JournalWriter(plans[cat].journal_dir, cat, name)
        writers[cat, name].append(rec)
        if rec.get("status") == "ok":
            cut = rec.get("finish_type") == "length"
            outputs[cat].append((len(rec.get("output_ids") or []), cut))
        else:
            refused[cat] += 1

    try:
        await engine.start()
        urls = [engine.url] if managed else engine.urls
        # Started after the engine: the client's own tok/s line and the plan's throughput are
        # the same measurement (output tokens over the requests' wall time).
        stats = Stats()
        client = Client(urls, opts, on_record, engine.alive if managed else None, stats, api=api)
        t0 = stats.started
        await client.run([it for _, _, it in chosen])
        wall = time.monotonic() - t0
    finally:
        for w in writers.values():
            w.close()
        engine.stop()
    for cp in plans.values():
        cp.refresh()
    asked = {cat: sum(1 for c, _, _ in chosen if c == cat) for cat in plans}
    out: dict = {
        cat: {"outputs": v, "asked": asked[cat], "refused": refused[cat]}
        for cat, v in outputs.items()
    }
    out.update(
        requests=len(chosen),
        wall_s=round(wall, 3),
        output_tokens=stats.output_tokens,
        throughput=stats.output_tokens / wall if wall > 0 and stats.output_tokens else None,
    )
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tokenmill plan", description=__doc__.split("\n")[0])
    p.add_argument("--configfile", default="config.yaml")
    p.add_argument("--basedir", default=".")
    p.add_argument(
        "--throughput", type=float, help="output tokens per second of one generate job's engine"
    )
    p.add_argument("--pilot", type=int, default=0, metavar="N", help="pilot N prompts/category")
    p.add_argument(
        "--keep",
        type=float,
        default=DEFAULT_KEEP,
        help="share of outputs that must finish under max_new_tokens (the max_new@keep column)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    a = p.parse_args(argv)
    if not 0 < a.keep <= 1:
        p.error("--keep must be in (0, 1]")
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(levelname)s %(message)s")
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    if a.throughput is not None and not (a.throughput > 0 and math.isfinite(a.throughput)):
        p.error("--throughput must be a positive number")
    basedir = Path(a.basedir)
    try:
        config = Settings.from_config(load_config_file(a.configfile)).raw
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    from tokenmill.engines.launch import EngineError
    from tokenmill.generate.client import GenerationFailed

    try:
        plan = make_plan(config, basedir, a.throughput, a.pilot, a.keep, a.configfile)
    except (EngineError, GenerationFailed, ValueError, OSError) as exc:
        print(f"tokenmill plan: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(plan, indent=2) if a.json else format_table(plan))
    return 0
