#!/usr/bin/env bash
# The test command: compiles every device source for sm_90a (when nvcc is present), then runs the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f scripts/compile_device.py ]; then
  python3 scripts/compile_device.py
fi
python3 -m pytest -q "$@"
