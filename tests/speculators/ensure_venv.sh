#!/usr/bin/env bash
# Create (once) a separate venv with vLLM speculators 0.9.0 for tests/test_trainer_loaders.py;
# prints the venv's python. Cached outside the repo so CI on the same machine reuses it; the
# marker file makes a half-finished install start over. Never touches the project venv.
# speculators goes in with --no-deps (its full requirements pull CUDA torchvision/torchaudio and
# the training stack); then only what its dataset, vocab-mapping and train.cli modules import,
# at versions inside its own pins (transformers<=5.19.0, datasets<=5.1.0, tqdm<=4.70.1).
# torch==2.13.0 is always pinned: it resolves to the local CPU build (a plain `torch` pulls CUDA).
set -euo pipefail
VERSION=0.9.0
VENV="${TOKENMILL_SPECULATORS_VENV:-$HOME/.cache/tokenmill/venv-speculators-$VERSION}"
MARKER="$VENV/.tokenmill-speculators-complete"
PY="${TOKENMILL_SPECULATORS_BASE_PYTHON:-python3.11}"
# shellcheck source=../cached_venv.sh
source "$(dirname "$0")/../cached_venv.sh"
venv_begin
install torch==2.13.0 numpy==2.4.6 \
    transformers==5.19.0 datasets==5.1.0 tqdm==4.70.1 \
    pydantic==2.14.4 pydantic-settings==2.16.3 loguru==0.7.3 \
    httpx==0.28.1 openai==3.57.0 hs-connectors==0.9.0
install --no-deps "speculators==$VERSION"
step "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
step "$VENV/bin/python" -c "
import speculators.train.vocab_mapping, speculators.train.cli
import speculators.data_generation.preprocessing, speculators.model"
venv_done
