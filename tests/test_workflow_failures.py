"""End to end: a config mistake that every request pays for fails the real Snakemake run loudly.

The reference engine (managed) gets `max_new_tokens` larger than its context: every request is
a 400 that blames the prompt ("Requested token count exceeds the model's maximum context
length"). Before, each became a permanent engine_rejected row and the run was green with empty
shards. Now the generate job fails with the counts and the first messages, journals none of
those rejections, and the corrected config gives a green run with rows.
"""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest
import yaml
from helpers import copy_workflow, snakemake

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_all_400_config_fails_loudly_and_caches_nothing(tmp_path):
    workdir = copy_workflow(tmp_path)
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["categories"] = {"chat": {**config["categories"]["chat"], "shards": 1}}
    config["generation"]["sampling"]["max_new_tokens"] = 5000  # the demo model's context: 4096
    (workdir / "bad.yaml").write_text(yaml.safe_dump(config))

    bad = snakemake(workdir, "--configfile", "bad.yaml")
    assert bad.returncode != 0, bad.stdout[-3000:]
    said = bad.stdout + bad.stderr
    assert "Error in rule generate_shard" in said, said[-4000:]
    log = (workdir / "results/logs/generate/chat/000/generate.log").read_text()
    assert "prompts refused by the engine" in log and "max_fraction" in log, log[-3000:]
    assert "exceeds the model's maximum context length" in log
    assert not (workdir / "results/generated/chat/000.parquet").exists()
    journal = workdir / "results/journal/chat"
    statuses = [
        json.loads(line.rsplit("\t", 1)[0])["status"]
        for f in journal.glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    assert "rejected" not in statuses  # nothing cached as a permanent rejection

    config["generation"]["sampling"]["max_new_tokens"] = 16
    (workdir / "fixed.yaml").write_text(yaml.safe_dump(config))
    good = snakemake(workdir, "--configfile", "fixed.yaml")
    assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-5000:]
    rows = pq.read_table(workdir / "results/dataset/chat/000.parquet").num_rows
    assert rows > 0
