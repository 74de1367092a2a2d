"""Shared pytest fixtures. Keep them small and generic: tests build their own specific inputs."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from helpers import copy_workflow, failed, snakemake

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


@pytest.fixture(scope="session")
def demo_workdir(tmp_path_factory) -> Path:
    """The demo (config.yaml, the reference engine on CPU) run end to end by Snakemake in a tmp
    copy of the workflow, once per test run (about 2 min), for every module that reads a
    finished run. Under pytest-xdist the workers share one run: the first to need it makes it
    under a lock, the others wait for it. Read-only: a test that edits files or reruns Snakemake
    works on a copy (helpers.copy_run)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder every worker's basetemp is in
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


# The slowest modules first, longest first (measured: `python tests/run_sessions.py` prints
# the durations): `make test` runs the main session on two xdist workers, whole modules each, in
# this order (--no-loadscope-reorder), so the long ones start early and run side by side instead
# of one of them ending the run alone. test_workflow first: it makes the shared demo run.
SLOW_MODULES_FIRST = (
    "test_workflow.py",
    "test_engines_real.py",
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
