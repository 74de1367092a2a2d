"""Benchmark: what `hidden_states.layouts: [specforge-gzip]` saves and costs against plain
SpecForge rows (`specforge`), on activations of a real hidden size.

    .venv/bin/python benchmarks/bench_ckpt_gzip.py [--hidden 4096] [--layers 8] [--tokens 1024]
        [--rows 2] [--dtype bfloat16]

Builds a random-weight Qwen2 decoder of --layers layers and --hidden width (HF's initial scale,
std 0.02) in --dtype, runs --rows rows of --tokens random ids through it, makes each row's
SpecForge file as the stage does (layout.specforge_bytes: aux layers [2, L//2, L-3], the
final-normed last layer), and prints per row and in all: the plain file's bytes, the gzip
file's bytes and their ratio, the seconds to make each (serialize; serialize + gzip) and to read
each back from a file (in the page cache) as SpecForge's load_feature_file does, as MB/s of
plain bytes and as a ratio to the plain side measured in the same run.

Random weights are not a trained model's: trained activations have outlier channels and a wider
spread of exponents, which may compress differently (not measured here).
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
import shutil
import sys
import tempfile
import time

import torch

from tokenmill.hidden_states import layout


def activations(hidden: int, layers: int, tokens: int, rows: int, dtype: torch.dtype):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 512), max_position_embeddings=max(4096, tokens),
    )  # fmt: skip
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    ids_all = torch.randint(10, config.vocab_size, (rows, tokens))
    aux_ids = layout.default_layers(layers)[:-1]
    out = []
    with torch.inference_mode():
        for r in range(rows):
            ids = ids_all[r : r + 1]
            h = model.model(input_ids=ids, output_hidden_states=True).hidden_states
            aux = torch.cat([h[k][0] for k in aux_ids], dim=-1).unsqueeze(0)
            out.append((ids[0].clone(), h[layers][0].unsqueeze(0).clone(), aux.clone()))
    return out


def read_as_specforge(path: str) -> dict:
    """SpecForge 0.2.0's load_feature_file (runtime/data_plane/feature_store.py): a .gz is read
    whole through gzip and torch.load from memory; a .ckpt is memory-mapped. Every tensor is
    then copied once, so that both sides touch every byte (a memory map alone reads nothing)."""
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            data = torch.load(io.BytesIO(f.read()), weights_only=False)
    else:
        data = torch.load(path, weights_only=False, mmap=True)
    return {k: v.clone() for k, v in data.items()}


def timed(fn, *args):
    t0 = time.perf_counter()
    value = fn(*args)
    return value, time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(layout.DTYPE_BYTES))
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    rows = activations(args.hidden, args.layers, args.tokens, args.rows, dtype)
    print(f"model: {args.layers} layers, H {args.hidden}, {args.dtype}, random weights; "
          f"{args.rows} rows of {args.tokens} tokens")  # fmt: skip
    totals = dict(plain=0, gz=0, make=0.0, make_gz=0.0, read=0.0, read_gz=0.0)
    tmp = tempfile.mkdtemp(prefix="bench-ckpt-gzip-")
    for r, (ids, last, aux) in enumerate(rows):
        mask = torch.ones_like(ids)
        plain, t_make = timed(layout.specforge_bytes, ids, mask, last, aux)
        gz, t_make_gz = timed(layout.specforge_bytes, ids, mask, last, aux, True)
        paths = [os.path.join(tmp, f"data_{r}.ckpt" + ext) for ext in ("", ".gz")]
        for path, data in zip(paths, (plain, gz), strict=True):
            with open(path, "wb") as f:
                f.write(data)
        _, t_read = timed(read_as_specforge, paths[0])
        back, t_read_gz = timed(read_as_specforge, paths[1])
        assert torch.equal(back["aux_hidden_state"], aux)  # lossless
        for k, v in dict(plain=len(plain), gz=len(gz), make=t_make, make_gz=t_make_gz,
                         read=t_read, read_gz=t_read_gz).items():  # fmt: skip
            totals[k] += v
    shutil.rmtree(tmp)
    mb = totals["plain"] / 1e6
    print(f"\nplain bytes {totals['plain']:,}, gzip bytes {totals['gz']:,}: "
          f"ratio {totals['gz'] / totals['plain']:.3f} "
          f"({totals['plain'] / (args.rows * args.tokens):,.0f} -> "
          f"{totals['gz'] / (args.rows * args.tokens):,.0f} bytes per token)")  # fmt: skip
    print(f"{'side':<22} {'plain s':>8} {'gzip s':>8} {'gzip MB/s':>10} {'x plain':>8}")
    for side, a, b in (
        ("make (serialize)", "make", "make_gz"),
        ("read (as SpecForge)", "read", "read_gz"),
    ):
        print(f"{side:<22} {totals[a]:>8.3f} {totals[b]:>8.3f} {mb / totals[b]:>10.0f} "
              f"{totals[b] / totals[a]:>7.1f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
