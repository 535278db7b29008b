#!/usr/bin/env bash
# Installs mpk-runtime and what its tests need into the current Python environment. Idempotent.
# torch is pinned to the CPU build on machines without a GPU (the GPU machines bring their own CUDA torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! $PY -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install -q torch
  else
    $PY -m pip install -q torch==2.13.0   # the CPU build, found on disk on the project's machines
  fi
fi
$PY -m pip install -q -e ".[test]"
