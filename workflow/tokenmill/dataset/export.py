"""`tokenmill export-jsonl`: a dataset shard as JSONL rows of {input_ids, loss_mask}, the
pre-tokenized layout SpecForge and vLLM speculators read. Streams by record batch."""

from __future__ import annotations

import argparse
import os

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


def export_jsonl(dataset_path, out_path, batch_size: int = 4096) -> int:
    rows = 0
    tmp = atomic_path(out_path)
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            parquet = pq.ParquetFile(dataset_path)
            for batch in parquet.iter_batches(batch_size, columns=["input_ids", "loss_mask"]):
                out.write(jsonl_lines(batch.column("input_ids"), batch.column("loss_mask")))
                rows += batch.num_rows
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill export-jsonl", description=__doc__)
    parser.add_argument("--dataset", required=True, help="a results/dataset/... shard")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    rows = export_jsonl(args.dataset, args.out)
    print(f"wrote {rows} rows to {args.out}")
    return 0
