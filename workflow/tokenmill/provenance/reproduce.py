"""Reproducing a published dataset from its provenance.json.

`tokenmill reproduce-config PROVENANCE --out repro.yaml [--results-dir DIR]` writes the run's
resolved config with `reproduce:` pointing at the manifest. `snakemake --configfile repro.yaml`
then refuses to start when this checkout differs from the manifest (tokenizer files and
fingerprint, input files, model and revision, generation fingerprint) and ends with
`{results_dir}/reproduce/report.json`: prepare and tokenize outputs byte for byte, generated
samples one by one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

from tokenmill import contracts
from tokenmill.keys import generation_fingerprint
from tokenmill.provenance.manifest import check_reproducible
from tokenmill.settings import ConfigError, Settings, as_settings


def load_manifest(path) -> contracts.Provenance:
    """The provenance.json at `path` (contracts.RecordError, one line, when it is not one)."""
    return contracts.Provenance.read(path)


def reproduce_problems(
    manifest: contracts.Provenance, config: Settings | dict, basedir="."
) -> list[str]:
    config = as_settings(config)
    problems = check_reproducible(manifest, config, basedir)
    want = manifest.generation.fingerprint
    have = generation_fingerprint(config.generation)
    if want != have:
        problems.append(
            "generation fingerprint (model, sampling, stop tokens, seed policy, launch flags): "
            f"manifest {want[:12]}, config {have[:12]}"
        )
    return problems


def reproduce_config(manifest_path, results_dir: str | None = None) -> dict:
    """The manifest's resolved config, pointed at the manifest; checked against the schema
    (ConfigError names the key of a manifest this version cannot run)."""
    manifest = load_manifest(manifest_path)
    config = json.loads(json.dumps(manifest.config.resolved))
    config["reproduce"] = str(manifest_path)
    if results_dir:
        config["results_dir"] = results_dir
        # A fresh journal: reproducing means generating again, not reading the old samples.
        config["journal_dir"] = str(Path(results_dir) / "journal")
    Settings.from_config(config)
    return config


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill reproduce-config", description=__doc__)
    parser.add_argument("provenance")
    parser.add_argument("--out", required=True)
    parser.add_argument("--results-dir", help="output folder (default: as published)")
    args = parser.parse_args(argv)
    try:
        config = reproduce_config(args.provenance, args.results_dir)
    except contracts.RecordError as exc:
        print(f"tokenmill reproduce-config: {exc}", file=sys.stderr)
        return 1
    except ConfigError as exc:
        print(f"tokenmill reproduce-config: {args.provenance}: {exc}", file=sys.stderr)
        return 1
    Path(args.out).write_text(yaml.safe_dump(config, sort_keys=True))
    print(f"wrote {args.out}")
    return 0
