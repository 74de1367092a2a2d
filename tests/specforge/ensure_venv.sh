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
# shellcheck source=../cached_venv.sh
source "$(dirname "$0")/../cached_venv.sh"
venv_begin
install torch==2.13.0 numpy==2.4.6 \
    transformers==5.8.1 datasets==5.2.0 tqdm==4.70.1 pydantic==2.14.4 safetensors==0.8.0
install --no-deps "specforge==$VERSION"
step "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
step "$VENV/bin/python" -W ignore -c "
import specforge.data.prompt_builder, specforge.data.preprocessing
import specforge.core.compact_teacher, specforge.modeling.draft.base"
venv_done
