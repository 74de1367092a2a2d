"""Shared pytest fixtures. Keep them small and generic: tests build their own specific inputs."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import BIN, copy_workflow, failed, snakemake

# No Hugging Face downloads, ever: set before anything imports huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
# The model check's digest cache (tokenmill/model.py): the tests' own, not the user's.
os.environ.setdefault("TOKENMILL_CACHE_DIR", tempfile.mkdtemp(prefix="tokenmill-digests-"))

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny fast tokenizer (no model) with the Kimi-K2.5-shaped chat template."""
    from tokenmill.testing.tiny_model import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny_kimi_tokenizer")
    build_tiny_tokenizer(out, template="kimi")
    return out


@pytest.fixture(scope="session")
def tiny_qwen3_tokenizer_dir(tmp_path_factory) -> Path:
    """The same tiny tokenizer with the Qwen3-shaped chat template (honours enable_thinking)."""
    from tokenmill.testing.tiny_model import build_tiny_tokenizer

    out = tmp_path_factory.mktemp("tiny_qwen3_tokenizer")
    build_tiny_tokenizer(out, template="qwen3")
    return out


@pytest.fixture(scope="session")
def sample_model_dir() -> Path:
    """The committed demo model (tokenizer + 2-layer LM) in sample/model."""
    path = REPO_ROOT / "sample" / "model"
    assert (path / "tokenizer.json").is_file(), f"{path} is missing the committed demo model"
    return path


def shared_basetemp(tmp_path_factory) -> Path:
    """The folder every pytest-xdist worker's basetemp is in (the basetemp without xdist)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory) -> Path:
    """The demo (config.yaml, the reference engine on CPU) run end to end by Snakemake in a tmp
    copy of the workflow, once per test run (about 2 min), for every module that reads a
    finished run. Under pytest-xdist the workers share one run: the first to need it makes it
    under a lock, the others wait for it. Read-only: a test that edits files or reruns Snakemake
    works on a copy (helpers.copy_run)."""
    root = shared_basetemp(tmp_path_factory)
    workdir, done = root / "demo-run", root / "demo-run.done"
    with open(root / "demo-run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(workdir, ignore_errors=True)  # a failed attempt's leftovers
            copy_workflow(workdir)
            proc = snakemake(workdir)
            assert proc.returncode == 0, failed(proc)
            done.touch()
    return workdir


@pytest.fixture(scope="session")
def reproduced_run(demo_workdir, tmp_path_factory) -> dict:
    """The demo's published dataset folder (a copy of its results/dataset) reproduced in a
    fresh checkout with no results and no journal: `tokenmill verify` on the folder,
    `tokenmill reproduce-config` from its provenance.json, then the whole run, every sample
    generated again, by a Snakemake from a venv holding only the env files' pins (tokenmill not
    installed: the workflow's folder is its only copy) in a clean environment (`env -i`).
    One run for two modules' tests (test_workflow.py: reproduction; test_standalone_envs.py:
    the envs suffice), made like demo_workdir, once per test run. Read-only.

    Returns the checkout, the published folder, and each command's exit status and output."""
    from test_standalone_envs import deps_only_venv  # the module that owns the env pins

    root = shared_basetemp(tmp_path_factory) / "reproduced"
    record, done = root / "record.json", root / "done"
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a failed attempt's leftovers
            published, home = root / "published", root / "home"
            shutil.copytree(demo_workdir / "results" / "dataset", published)
            home.mkdir()
            checkout = copy_workflow(root / "checkout")
            tm = str(BIN / "tokenmill")
            steps = {
                "verify": ([tm, "verify", str(published)], None),
                "reproduce_config": (
                    [
                        tm,
                        "reproduce-config",
                        str(published / "provenance.json"),
                        "--out",
                        "repro.yaml",
                        "--results-dir",
                        "repro",
                    ],
                    None,
                ),
                "run": (
                    [
                        str(deps_only_venv() / "bin" / "snakemake"),
                        "--profile",
                        "profiles/local",
                        "--cores",
                        "2",
                        "--configfile",
                        "repro.yaml",
                    ],
                    {"HOME": str(home), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
                ),
            }
            said = {}
            for name, (argv, env) in steps.items():
                proc = subprocess.run(argv, cwd=checkout, env=env, capture_output=True,
                                      text=True, timeout=1500)  # fmt: skip
                said[name] = {"rc": proc.returncode, "out": failed(proc)}
                if proc.returncode != 0:
                    break
            record.write_text(json.dumps(said))
            done.touch()
    return {"checkout": root / "checkout", "published": root / "published"} | json.loads(
        record.read_text()
    )


# The slowest modules first, longest first (measured: `python tests/run_sessions.py` prints
# the durations): `make test` runs the main session on three xdist workers, whole modules each, in
# this order (--no-loadscope-reorder), so the long ones start early and run side by side instead
# of one of them ending the run alone. test_workflow first: it makes the shared demo run.
SLOW_MODULES_FIRST = (
    "test_workflow.py",
    "test_engines_real.py",
    "test_declared_run.py",
    "test_standalone_envs.py",
    "test_multiturn.py",
    "test_trainer_loaders.py",
    "test_workflow_failures.py",
    "test_hidden_states_vllm.py",
    "test_plan.py",
    "test_hidden_states_workflow.py",
    "test_guards.py",
    "test_launch_flags.py",
    "test_readme_commands.py",
    "test_report_browser.py",
    "test_hidden_states_trainers.py",
    "test_tiny_model.py",
)


def pytest_collection_modifyitems(items):
    """Slow modules first (SLOW_MODULES_FIRST; the order inside a module is kept). A test that
    reads the demo run may wait for it: the run (or another xdist worker making it) counts
    against the test's own timeout, so those tests get twice the default."""
    rank = {name: i for i, name in enumerate(SLOW_MODULES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    for item in items:
        if "demo_workdir" in item.fixturenames and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(1200))
