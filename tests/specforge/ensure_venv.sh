#!/usr/bin/env bash
# Create (once) a separate venv with SGLang SpecForge 0.2.0 for tests/test_trainer_loaders.py;
# prints the venv's python. Cached outside the repo so CI on the same machine reuses it; the
# marker file makes a half-finished install start over. Never touches the project venv.
# SpecForge pins torch==2.11.0, transformers==5.8.1 and sglang==0.5.14 (a GPU serving stack): it
# goes in with --no-deps, on torch==2.13.0 (the local CPU build; a plain `torch` pulls CUDA) and
# only what its prompt-loading, vocab-mapping and draft-model modules import.
set -euo pipefail
VERSION=0.2.0
VENV="${TOKENMILL_SPECFORGE_VENV:-$HOME/.cache/tokenmill/venv-specforge-$VERSION}"
MARKER="$VENV/.tokenmill-specforge-complete"
PY="${TOKENMILL_SPECFORGE_BASE_PYTHON:-python3.11}"
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
step "$VENV/bin/pip" install torch==2.13.0 numpy==2.4.6 \
    transformers==5.8.1 datasets==5.2.0 tqdm==4.70.1 pydantic==2.14.4 safetensors==0.8.0
step "$VENV/bin/pip" install --no-deps "specforge==$VERSION"
step "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
step "$VENV/bin/python" -W ignore -c "
import specforge.data.prompt_builder, specforge.data.preprocessing
import specforge.core.compact_teacher, specforge.modeling.draft.base"
touch "$MARKER"
echo "$VENV/bin/python"
