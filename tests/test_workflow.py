"""End to end: the real Snakemake workflow on the bundled sample data, with the reference
engine in managed mode, then the incremental-rebuild promises:

- a second run does nothing;
- editing one prompt reruns prepare and tokenize of that category only, then generate,
  merge and export of exactly one shard (the engine receives exactly one request), and
  every other data file keeps its bytes;
- changing the chat template kwargs re-tokenizes every category.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tokenmill.tokenization.shards import shard_of

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def copy_workflow(dest: Path) -> Path:
    for name in ("Snakefile", "config.yaml", "pyproject.toml"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("workflow", "sample", "profiles"):
        shutil.copytree(
            ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    return dest


def snakemake(workdir: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", HF_HUB_OFFLINE="1")
    return subprocess.run(
        [str(BIN / "snakemake"), "--profile", "profiles/local", "--cores", "2", *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


JOB_HEADER = re.compile(r"^(?:local)?(?:rule|checkpoint) (\w+):$")


def jobs_in(log: str) -> set[tuple[str, str]]:
    """(rule, wildcards) of every job a snakemake log (or dry run) lists."""
    jobs, current = set(), None
    for line in log.splitlines():
        header = JOB_HEADER.match(line.strip())
        if header:
            current = header.group(1)
            jobs.add((current, ""))
            continue
        if current and line.strip().startswith("wildcards:"):
            jobs.discard((current, ""))
            jobs.add((current, line.split(":", 1)[1].strip()))
            current = None
    return jobs


def digests(root: Path, pattern: str) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.glob(pattern))
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = copy_workflow(tmp_path_factory.mktemp("wf"))
    proc = snakemake(workdir)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return workdir


def test_full_pipeline_outputs(finished_run):
    results = finished_run / "results"
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    for category, cat in config["categories"].items():
        shards = sorted((results / "tokenized" / category).glob("*.parquet"))
        assert len(shards) == cat["shards"]
        for shard in shards:
            tokenized = pq.read_table(shard)
            dataset = pq.read_table(results / "dataset" / category / shard.name)
            assert dataset.num_rows <= tokenized.num_rows
            assert (results / "export" / category / (shard.stem + ".jsonl")).exists()
    for name in ("stats/summary.json", "dataset/README.md", "provenance.json"):
        assert (results / name).exists(), name


def test_second_run_does_nothing(finished_run):
    proc = snakemake(finished_run, "-n")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Nothing to be done" in proc.stdout + proc.stderr, proc.stdout[-4000:]


def _edit_one_code_prompt(workdir: Path) -> None:
    path = workdir / "sample/data/code/code_sample.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    record = json.loads(lines[0])
    record["instruction"] += " Use only the standard library."
    lines[0] = json.dumps(record) + "\n"
    path.write_text("".join(lines))


def _prompt_ids(results: Path, category: str) -> set[str]:
    return set(pq.read_table(results / f"prompts/{category}.parquet")["prompt_id"].to_pylist())


def test_editing_one_prompt_reruns_one_shard(finished_run):
    results = finished_run / "results"
    before = digests(results, "*/*/*.parquet") | digests(results, "prompts/*.parquet")
    ids_before = _prompt_ids(results, "code")

    _edit_one_code_prompt(finished_run)
    dry = snakemake(finished_run, "-n")
    assert dry.returncode == 0, dry.stderr[-4000:]
    planned = {job for job in jobs_in(dry.stdout + dry.stderr) if job[1]}
    # The dry run cannot see past the tokenize checkpoint: it plans the whole `code`
    # category (and nothing of any other category); the real run then skips the shards
    # whose bytes did not change.
    assert {wc.split(",")[0] for _, wc in planned} == {"category=code"}, planned
    assert {("prepare_prompts", "category=code"), ("tokenize_prompts", "category=code")} <= planned

    run = snakemake(finished_run)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]

    # The edit removed one prompt and added another: the shards that held them (one, or
    # two when the new prompt hashes elsewhere) are the only ones that may change.
    (old,) = ids_before - _prompt_ids(results, "code")
    (new,) = _prompt_ids(results, "code") - ids_before
    n_shards = yaml.safe_load((finished_run / "config.yaml").read_text())["categories"]["code"][
        "shards"
    ]
    shards = {f"{shard_of(pid, n_shards):03d}" for pid in (old, new)}

    ran = jobs_in(run.stdout + run.stderr)
    per_shard = {(rule, wc) for rule, wc in ran if "shard=" in wc}
    expected = {
        (rule, f"category=code, shard={shard}")
        for rule in ("generate_shard", "merge_shard", "export_jsonl")
        for shard in shards
    }
    assert per_shard == expected, per_shard

    # The engine received exactly one request: the edited prompt.
    requested = sum(
        json.loads((results / f"generated/code/{shard}.meta.json").read_text())["counts"][
            "requested"
        ]
        for shard in shards
    )
    assert requested == 1

    after = digests(results, "*/*/*.parquet") | digests(results, "prompts/*.parquet")
    changed = {path for path in before if before[path] != after.get(path)}
    assert changed == {"prompts/code.parquet"} | {
        f"{stage}/code/{shard}.parquet"
        for stage in ("tokenized", "generated", "dataset")
        for shard in shards
    }, changed


def test_changing_the_chat_template_kwargs_retokenizes_everything(finished_run, tmp_path):
    config = yaml.safe_load((finished_run / "config.yaml").read_text())
    config["tokenizer"]["chat_template_kwargs"] = {"thinking": False}
    configfile = tmp_path / "nothink.yaml"
    configfile.write_text(yaml.safe_dump(config))
    dry = snakemake(finished_run, "-n", "--configfile", str(configfile))
    assert dry.returncode == 0, dry.stderr[-4000:]
    tokenize = {wc for rule, wc in jobs_in(dry.stdout + dry.stderr) if rule == "tokenize_prompts"}
    assert tokenize == {f"category={c}" for c in config["categories"]}, tokenize
    prepare = {wc for rule, wc in jobs_in(dry.stdout + dry.stderr) if rule == "prepare_prompts"}
    assert not prepare, prepare


def tokenmill(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "tokenmill"), *args], cwd=workdir, capture_output=True, text=True, timeout=300
    )


def test_verify_passes_and_names_a_tampered_file(finished_run, tmp_path):
    ok = tokenmill(finished_run, "verify", "results/provenance.json", "results")
    assert ok.returncode == 0, ok.stdout + ok.stderr

    copy = tmp_path / "published"
    shutil.copytree(finished_run / "results", copy)
    victim = copy / "dataset/chat/000.parquet"
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    bad = tokenmill(finished_run, "verify", "results/provenance.json", str(copy))
    assert bad.returncode == 1
    assert "dataset/chat/000.parquet" in bad.stdout + bad.stderr


def test_reproduce_from_provenance_matches_byte_for_byte(finished_run):
    made = tokenmill(
        finished_run,
        "reproduce-config",
        "results/provenance.json",
        "--out",
        "repro.yaml",
        "--results-dir",
        "repro",
    )
    assert made.returncode == 0, made.stderr
    run = snakemake(finished_run, "--configfile", "repro.yaml")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-8000:]
    report = json.loads((finished_run / "repro/reproduce/report.json").read_text())
    stages = report["byte_identical_stages"]
    assert report["ok"] and stages["identical"] and not stages["different"], stages
    samples = report["generated_samples"]
    assert samples["total"] > 0 and samples["identical"] == samples["total"], samples

    # A checkout whose inputs differ from the manifest refuses to start, saying why.
    _edit_one_code_prompt(finished_run)
    refused = snakemake(finished_run, "-n", "--configfile", "repro.yaml")
    assert refused.returncode != 0
    said = refused.stdout + refused.stderr
    assert "cannot reproduce" in said and "code_sample.jsonl" in said, said
