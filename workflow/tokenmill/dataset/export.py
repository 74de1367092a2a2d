"""`tokenmill export-jsonl`: dataset shards as JSONL rows of {input_ids, loss_mask}, the
pre-tokenized layout SpecForge and vLLM speculators read. Streams by record batch.

The pipeline writes one file per dataset shard (results/export/{category}/{shard}.jsonl,
speculators reads the folder). SpecForge's `data.prompts_path` is one file, and its draft
vocabulary breaks equal counts by the id seen first, so the order of the rows matters: give
`--dataset` a category folder or the dataset folder and the shards are concatenated in one
fixed order (category name, then shard name), e.g.

    tokenmill export-jsonl --dataset results/dataset --out train.jsonl
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tokenmill.contracts import atomic_path


def jsonl_lines(input_ids: pa.ListArray, loss_mask: pa.ListArray) -> str:
    """JSONL text for a batch, built by Arrow string kernels (no Python loop over tokens)."""
    if len(input_ids) == 0:
        return ""
    ids = pc.binary_join(input_ids.cast(pa.list_(pa.string())), ",")
    mask = pc.binary_join(loss_mask.cast(pa.list_(pa.string())), ",")
    lines = pc.binary_join_element_wise(
        '{"input_ids":[', ids, '],"loss_mask":[', mask, "]}", ""
    ).to_pylist()
    return "\n".join(lines) + "\n"


def dataset_shards(items: Iterable) -> list[Path]:
    """The shards to export, in the one export order: a file as given; a category folder: its
    *.parquet; the dataset folder: */*.parquet (categories, then shards, by name). Files given
    one by one keep the order given."""
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = sorted(p.glob("*.parquet")) or sorted(p.glob("*/*.parquet"))
            if not found:
                raise FileNotFoundError(f"no dataset shards in {p}")
            out += found
        else:
            raise FileNotFoundError(f"no such dataset shard or folder: {p}")
    return out


def export_jsonl(dataset_path, out_path, batch_size: int = 4096) -> int:
    """Write one shard, or several (a list, in its order), to one JSONL file; the row count."""
    paths: Sequence = dataset_path if isinstance(dataset_path, (list, tuple)) else [dataset_path]
    rows = 0
    tmp = atomic_path(out_path)
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for path in paths:
                parquet = pq.ParquetFile(path)
                for batch in parquet.iter_batches(batch_size, columns=["input_ids", "loss_mask"]):
                    out.write(jsonl_lines(batch.column("input_ids"), batch.column("loss_mask")))
                    rows += batch.num_rows
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tokenmill export-jsonl",
        description=__doc__.split("\n\n")[0],
        epilog="Several shards or a folder: one file, categories then shards by name.",
    )
    parser.add_argument(
        "--dataset",
        required=True,
        nargs="+",
        help="results/dataset/{category}/{shard}.parquet files, a category folder, or the "
        "dataset folder",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    shards = dataset_shards(args.dataset)
    rows = export_jsonl(shards, args.out)
    print(f"wrote {rows} rows of {len(shards)} shards to {args.out}")
    return 0
