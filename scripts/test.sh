#!/usr/bin/env bash
# The test command: compiles every device source for sm_90a (when nvcc is present), runs the tests, then (a full run
# on a machine where scripts/setup.sh put Triton in .cache/triton-site) the Triton kernels' tests: the interpreter's
# (paged attention, its switches, the skinny GEMM against torch references, the full-vocabulary draw) and the offline sm_90 builds.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f scripts/compile_device.py ]; then
  python3 scripts/compile_device.py
fi
python3 -m pytest -q "$@"
if [ $# -eq 0 ] && [ -f .cache/triton-site/triton/__init__.py ]; then
  echo "== the Triton kernels' tests (Triton 3.6.0 from .cache/triton-site)"
  export PYTHONPATH="$PWD:$PWD/.cache/triton-site${PYTHONPATH:+:$PYTHONPATH}"
  TRITON_INTERPRET=1 python3 -m pytest -q -m "not gpu" tests/runtime/test_paged_attention.py \
    tests/runtime/test_paged_switches.py tests/runtime/test_skinny_gemm.py \
    tests/runtime/test_full_sampling.py
  python3 -m pytest -q -m "not gpu" tests/runtime/test_triton_build.py tests/scripts/test_paged_build_report.py
fi
