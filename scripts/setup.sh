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
# Triton for the CPU machine's tests of the Triton kernels (the paged attention, the skinny GEMM: Triton's interpreter,
# and offline sm_90 builds): pinned to the GPU machine's 3.6.0, installed beside the environment (.cache/triton-site,
# no dependencies), so the rest of the suite runs without Triton as the CPU machine's torch does. scripts/test.sh
# runs those tests with it. MPK_NO_TRITON_TESTS=1 skips this.
if ! command -v nvidia-smi >/dev/null 2>&1 && [ "${MPK_NO_TRITON_TESTS:-0}" != 1 ] && \
   [ ! -f .cache/triton-site/triton/__init__.py ]; then
  $PY -m pip install -q --no-deps --target .cache/triton-site triton==3.6.0 \
    || echo "setup: triton 3.6.0 not installed (no index?): scripts/test.sh will skip the Triton kernel tests"
fi
