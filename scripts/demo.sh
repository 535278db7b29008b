#!/usr/bin/env bash
# Set up mpk-runtime and generate a few tokens from a small seeded model on whatever hardware is here.
#   bash scripts/demo.sh [MODEL] [BACKEND]      (defaults: tiny-llama, megakernel on a GPU / pyvm on a CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${1:-tiny-llama}
if [ -n "${2:-}" ]; then BACKEND=$2
elif python3 -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null \
     && python3 -c "import mpk_runtime.runtime.megakernel_runner" 2>/dev/null; then BACKEND=megakernel
else BACKEND=pyvm; fi
echo "== plan of one decode step ($MODEL, tp=2)"
python3 -m mpk_runtime plan --model "$MODEL" --tp 2 --sms 8 --show-ops 4
echo "== generate ($MODEL, backend=$BACKEND)"
python3 -m mpk_runtime generate --model "$MODEL" --backend "$BACKEND" --prompt-ids 1,2,3,4 --prompt-ids 9,8,7 --max-tokens 12
