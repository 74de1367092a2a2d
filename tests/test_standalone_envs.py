"""envs/: one conda environment per rule group, dependencies only, and the engine's
container definition.

What is tested here (no conda channel and no container registry are reachable from the test
machines, so `--software-deployment-method conda` and `apptainer build` themselves are not):
- every rule has a `conda:` directive naming an existing envs/ file, one file per rule group;
- the env files pin exactly what pyproject.toml pins;
- each env holds what its rule group's code imports (its stage folder, the shared modules and
  the command line), directly or through a listed package;
- the rules run from an environment built from those dependencies alone: a venv with only the
  env files' pins (and Snakemake) and NO tokenmill installed runs the demo's reproduction to
  the end, every sample generated again, in a clean environment (`env -i`), the package
  reached from the workflow's folder (conftest's reproduced_run, shared with the reproduce
  test); the training shards are the demo's, byte for byte (e2e, slow; the venv is cached in
  ~/.cache/tokenmill);
- the container definition runs SGLang's server as the documented container command does.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import uv_pip
import yaml
from helpers import ROOT, TEST_CACHE

import tokenmill

ENVS = ROOT / "envs"
RULES = ROOT / "workflow" / "rules"
PACKAGE = ROOT / "workflow" / "tokenmill"
# rule file -> the env of its rule group
GROUPS = {
    "prepare": "prepare",
    "tokenize": "tokenize",
    "generate": "generate",
    "dataset": "dataset",
    "hidden_states": "hidden_states",
}
# package folder -> rule group (the folders the group's commands import)
STAGE_DIRS = {
    "prepare": ["prepare"],
    "tokenize": ["tokenization"],
    "generate": ["generate"],
    "dataset": ["dataset", "provenance"],
    "hidden_states": ["hidden_states"],
}
SHARED = ["cli.py", "config.py", "settings.py", "contracts.py", "keys.py", "model.py"]
SHARED += ["redaction.py", "launch_flags.py", "workflow_support.py", "layout.py"]
# Loaded inside the vLLM server's own process (its environment brings vLLM), not by a rule.
SERVER_SIDE = {"vllm_connector.py"}
# import name -> the distributions that provide it (directly, or as their dependency)
PROVIDERS = {
    "pyarrow": {"pyarrow"},
    "yaml": {"pyyaml"},
    "jsonschema": {"jsonschema"},
    "aiohttp": {"aiohttp"},
    "transformers": {"transformers"},
    "tokenizers": {"tokenizers", "transformers"},
    "huggingface_hub": {"transformers", "datasets"},
    "datasets": {"datasets"},
    "matplotlib": {"matplotlib"},
    "torch": {"torch"},
    "numpy": {"datasets", "transformers", "matplotlib", "torch"},
    "safetensors": {"transformers"},
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def split_req(req: str) -> tuple[str, str]:
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*?)\s*$", req)
    return norm(m.group(1)), m.group(2).replace(" ", "")


def pyproject_pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += [r for r in extra if not r.startswith("tokenmill")]
    return dict(split_req(r) for r in reqs)


def env_pins(name: str) -> dict[str, str]:
    env = yaml.safe_load((ENVS / f"{name}.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "pip" in env["dependencies"] and any(
        str(d).startswith("python=3.1") for d in env["dependencies"]
    )
    return dict(split_req(r) for r in pip)


def test_every_rule_has_the_env_of_its_group():
    for stem, env in GROUPS.items():
        text = (RULES / f"{stem}.smk").read_text()
        rules = re.findall(r"^(?:rule|checkpoint) (\w+):", text, flags=re.M)
        blocks = re.split(r"^(?:rule|checkpoint) \w+:", text, flags=re.M)[1:]
        assert rules and len(blocks) == len(rules)
        for rule, block in zip(rules, blocks, strict=True):
            found = re.findall(r'^    conda:\n        "([^"]+)"', block, flags=re.M)
            assert found == [f"../../envs/{env}.yaml"], rule
            assert (RULES / found[0]).resolve().is_file()
    assert sorted(p.stem for p in ENVS.glob("*.yaml")) == sorted(set(GROUPS.values()))


def test_env_files_pin_what_pyproject_pins():
    pins = pyproject_pins()
    for env in GROUPS.values():
        for name, spec in env_pins(env).items():
            assert name in pins, (env, name)
            assert spec == pins[name], (env, name, spec, pins[name])
        # No copy of the package (not a pyproject pin): the rules reach it from the workflow.
        assert "tokenmill" not in env_pins(env)


def imports_of(paths: list[Path]) -> set[str]:
    found = set()
    for path in paths:
        for f in [path] if path.is_file() else path.rglob("*.py"):
            if f.name in SERVER_SIDE:
                continue
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"tokenmill"}


@pytest.mark.parametrize("group", sorted(STAGE_DIRS))
def test_env_holds_what_its_rules_import(group):
    paths = [PACKAGE / p for p in STAGE_DIRS[group] + SHARED]
    have = set(env_pins(group))
    for module in sorted(imports_of(paths)):
        assert module in PROVIDERS, f"{module}: add it to PROVIDERS and to envs/{group}.yaml"
        assert PROVIDERS[module] & have, f"envs/{group}.yaml lacks {module}"


def test_container_definition_runs_the_documented_engine():
    definition = (ENVS / "sglang.def").read_text()
    assert re.search(r"^Bootstrap: docker$", definition, flags=re.M)
    assert re.search(r"^From: lmsysorg/sglang:v\d", definition, flags=re.M)
    runscript = definition.split("%runscript", 1)[1].split("%", 1)[0]
    assert "python3 -m sglang.launch_server" in runscript
    cluster = (ROOT / "docs" / "cluster.md").read_text()
    assert "envs/sglang.def" in cluster
    assert "python3, -m, sglang.launch_server" in cluster


def deps_only_venv() -> Path:
    """A venv with the env files' pins and Snakemake, without tokenmill: made once per set of
    pins in ~/.cache/tokenmill, by uv with pip's index and wheel folders as configured on the
    machine (tests/uv_pip.py)."""
    reqs = sorted({f"{n}{s}" for env in GROUPS.values() for n, s in env_pins(env).items()})
    reqs.append(f"snakemake{pyproject_pins()['snakemake']}")
    key = hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:12]
    venv = TEST_CACHE / f"venv-envs-{key}"
    marker = venv / ".complete"
    if not marker.exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        uv_pip.install(venv, *reqs)
        marker.touch()
    return venv


@pytest.mark.e2e
@pytest.mark.slow
def test_rules_run_from_the_env_dependencies_alone(demo_workdir, reproduced_run):
    """conftest's reproduced_run: the demo reproduced from its provenance by a Snakemake from
    deps_only_venv() in a clean environment (`env -i`), every sample generated again."""
    venv = deps_only_venv()
    python = str(venv / "bin" / "python")
    gone = subprocess.run([python, "-c", "import tokenmill"], capture_output=True, env={})
    assert gone.returncode != 0  # not installed: the workflow's folder is the only copy

    run = reproduced_run["run"]
    assert run["rc"] == 0, run["out"]
    results = reproduced_run["checkout"] / "repro"
    for shard in sorted((demo_workdir / "results/dataset").glob("*/*.parquet")):
        rel = shard.relative_to(demo_workdir / "results")
        assert (results / rel).read_bytes() == shard.read_bytes(), rel
    assert (results / "dataset/vocab_mapping/vocab_mapping.pt").is_file()  # torch there
    # Generation ran too: each shard's engine started from this venv and answered every prompt.
    metas = sorted((results / "generated").glob("*/*.meta.json"))
    assert metas
    for meta in metas:
        m = json.loads(meta.read_text())
        assert m["engine_started"] and m["counts"]["from_journal"] == 0, (meta, m["counts"])
    # Not installed, yet the provenance says which tokenmill made the data (the code that ran).
    software = json.loads((results / "provenance.json").read_text())["software"]
    assert software["packages"]["tokenmill"] == tokenmill.__version__, software
