"""The run as a whole is declared: the published folder is exactly what the config declares.

Each scenario runs the real workflow (Snakemake, the reference engine) on a copy of the
session's finished demo run, as a user would: change the config, run; then restore it and run
again. After every run:

- the run exits 0;
- the dataset folder, the card's configs, the statistics, the provenance, the JSONL exports and
  the draft vocabulary name exactly the configured categories and shards;
- no row is in a category twice (the same sample_key);
- what the config no longer declares is under results/retired/, read by nothing;

and restoring the config sends no request to the engine (the journal kept every sample).
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from helpers import copy_run, failed, snakemake

from tokenmill import layout
from tokenmill.settings import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def run(workdir: Path, config: dict | None) -> tuple[str, int]:
    """Snakemake with `config` (None: the bundled config.yaml): the run's output, and the
    requests its generate jobs sent (the job records it wrote)."""
    args, conf = [], config
    if config is not None:
        (workdir / "changed.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        args = ["--configfile", "changed.yaml"]
    else:
        conf = yaml.safe_load((workdir / "config.yaml").read_text())
    before = records(workdir, conf)
    proc = snakemake(workdir, *args)
    assert proc.returncode == 0, failed(proc)
    after = records(workdir, conf)
    sent = sum(r["counts"]["requested"] for p, r in after.items() if before.get(p) != r)
    return proc.stdout + proc.stderr, sent


def records(workdir: Path, config: dict) -> dict[str, dict]:
    """The generate job records of every declared shard that has one."""
    settings = Settings.from_config(config)
    lay = layout.Layout.of(settings)
    out = {}
    for category, shards in layout.declared(settings).items():
        for shard in shards:
            path = workdir / lay.generate_record(category, shard)
            if path.exists():
                out[str(path)] = json.loads(path.read_text())
    return out


def assert_published_as_declared(workdir: Path, config: dict) -> None:
    settings = Settings.from_config(config)
    declared = layout.declared(settings)
    results = workdir / settings.results_dir
    # The dataset folder: one folder per category holding its declared shards, and the vocab.
    dataset = results / "dataset"
    folders = {p.name for p in dataset.iterdir() if p.is_dir()}
    assert folders == set(declared) | {layout.MAPPING_DIR}, folders
    for category, shards in declared.items():
        names = sorted(p.stem for p in (dataset / category).iterdir())
        assert names == shards, (category, names)
        exports = sorted(p.stem for p in (results / "export" / category).iterdir())
        assert exports == shards, (category, exports)
        keys = [
            k
            for s in shards
            for k in pq.read_table(dataset / category / f"{s}.parquet", columns=["sample_key"])
            .column(0)
            .to_pylist()
        ]
        assert len(keys) == len(set(keys)), f"{category}: a row twice"
    assert {p.name for p in (results / "export").iterdir()} == set(declared)
    # The card's configs load exactly the declared shards.
    card = yaml.safe_load((dataset / "README.md").read_text().split("---")[1])
    configs = {c["config_name"]: c["data_files"][0]["path"] for c in card["configs"]}
    want = {c: [f"{c}/{s}.parquet" for s in shards] for c, shards in declared.items()}
    assert configs == {"all": [f for fs in want.values() for f in fs], **want}
    # Statistics, provenance and draft vocabulary.
    summary = json.loads((results / "stats" / "summary.json").read_text())
    assert set(summary["categories"]) == set(declared)
    assert summary["conservation"]["ok"], summary["conservation"]
    provenance = json.loads((results / "provenance.json").read_text())
    listed = {e["path"] for e in provenance["outputs"]}
    assert {layout.category_of(p) for p in listed} - {None} == set(declared)
    assert not any(p.startswith(layout.RETIRED_DIR + "/") for p in listed)
    assert {e["category"] for e in provenance["engine"]} == set(declared)
    vocab = json.loads((dataset / layout.MAPPING_DIR / layout.MAPPING_SUMMARY).read_text())
    assert set(vocab["draft_coverage_by_category"]) == set(declared)
    # Every published file is declared; nothing else is left outside retired/.
    lay = layout.Layout(str(results), str(workdir / settings.journal_dir))
    assert layout.undeclared(lay, settings) == []


@pytest.fixture
def demo(demo_workdir, tmp_path):
    """A copy of the session's demo run, and its config."""
    workdir = copy_run(demo_workdir, tmp_path / "demo")
    return workdir, yaml.safe_load((workdir / "config.yaml").read_text())


def test_removing_a_category_unpublishes_it_and_restoring_costs_no_request(demo):
    workdir, config = demo
    changed = json.loads(json.dumps(config))
    del changed["categories"]["agent"]
    out, _ = run(workdir, changed)
    assert "tokenmill: category 'agent' is not in the config: its" in out
    assert_published_as_declared(workdir, changed)
    assert (workdir / "results" / "retired" / "dataset" / "agent" / "000.parquet").is_file()
    _, sent = run(workdir, None)
    assert_published_as_declared(workdir, config)
    assert sent == 0


def test_renaming_a_category_publishes_the_new_name_only(demo):
    workdir, config = demo
    changed = json.loads(json.dumps(config))
    changed["categories"]["agents"] = changed["categories"].pop("agent")
    out, _ = run(workdir, changed)
    assert "tokenmill: category 'agent' is not in the config" in out
    assert_published_as_declared(workdir, changed)
    _, sent = run(workdir, None)
    assert_published_as_declared(workdir, config)
    assert sent == 0


def test_lowering_then_raising_shards_publishes_each_row_once(demo):
    workdir, config = demo
    changed = json.loads(json.dumps(config))
    changed["categories"]["function_calling"]["shards"] = 2
    out, sent = run(workdir, changed)
    assert "tokenmill: category 'function_calling' has 2 shards now: " in out
    assert "of shard 002 moved to" in out
    assert_published_as_declared(workdir, changed)
    assert sent == 0  # the journal moved the samples to the shards of their prompts
    _, sent = run(workdir, None)
    assert_published_as_declared(workdir, config)
    assert sent == 0


def test_changing_max_new_tokens_regenerates_and_restoring_costs_nothing(demo):
    workdir, config = demo
    changed = json.loads(json.dumps(config))
    changed["generation"]["sampling"]["max_new_tokens"] += 16
    # two categories, so that the suite regenerates two, not five (the other three retire and
    # come back from the journal with the restore, as in the removal scenario)
    changed["categories"] = {c: changed["categories"][c] for c in ("chat", "code")}
    _, sent = run(workdir, changed)
    assert_published_as_declared(workdir, changed)
    assert sent > 0
    _, sent = run(workdir, None)
    assert_published_as_declared(workdir, config)
    assert sent == 0


def dataset_rows(workdir: Path, config: dict) -> dict[str, dict[str, tuple]]:
    """category -> sample_key -> (shard, input_ids) of the published dataset."""
    settings = Settings.from_config(config)
    out: dict[str, dict[str, tuple]] = {}
    for category, shards in layout.declared(settings).items():
        rows = out.setdefault(category, {})
        for shard in shards:
            path = workdir / settings.results_dir / "dataset" / category / f"{shard}.parquet"
            t = pq.read_table(path, columns=["prompt_id", "sample_key", "input_ids"])
            ids = t.column("prompt_id").to_pylist()
            assert ids == sorted(ids), f"{category}/{shard}: not in prompt_id order"
            for key, input_ids in zip(
                t.column("sample_key").to_pylist(), t.column("input_ids").to_pylist(), strict=True
            ):
                rows[key] = (shard, input_ids)
    return out


def test_switching_shard_by_moves_rows_without_a_request_and_back(demo):
    """The demo's categories place rows by prefix (the default). Two of them placed by the
    prompt_id's hash instead: the rows move to other shards (the journal follows them by the
    assignment's digest), no request is sent, and every row and token is as before; back to
    prefix shards, again no request."""
    workdir, config = demo
    before = dataset_rows(workdir, config)
    changed = json.loads(json.dumps(config))
    # prompts with tools, and conversations (each switch reruns the category's jobs)
    for category in ("function_calling", "multiturn"):
        changed["categories"][category]["shard_by"] = "prompt_id"
    _, sent = run(workdir, changed)
    assert_published_as_declared(workdir, changed)
    assert sent == 0
    after = dataset_rows(workdir, changed)
    for category, rows in before.items():
        assert {k: v[1] for k, v in after[category].items()} == {
            k: v[1] for k, v in rows.items()
        }, category
    moved = sum(
        after["function_calling"][k][0] != s for k, (s, _) in before["function_calling"].items()
    )
    assert moved > 0, "no row changed shard: the test shows nothing"
    _, sent = run(workdir, None)
    assert_published_as_declared(workdir, config)
    assert sent == 0
    assert dataset_rows(workdir, config) == before
