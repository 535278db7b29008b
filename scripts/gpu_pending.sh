#!/usr/bin/env bash
# What session 11 left for a GPU, in two commands of < 9.5 min each (stages time-limited; every stage runs even if
# an earlier one fails; $OUT/pending.tar.gz refreshed after each, so a command cut short still returns what ran).
# Usage on the GPU machine, after `source .gpubundle/install.sh` (PYTHONPATH=$PWD:/tmp/site, NVLS off):
#     OUT=$OUT bash scripts/gpu_pending.sh one      # stages 1-4 (one GPU)
#     OUT=$OUT bash scripts/gpu_pending.sh two      # stages 5-7 (two GPUs)
#  1. tests/gpu (includes test_attn_fold.py, fixed after session 11's run, and test_weight_stage.py)
#  2. the folded attention merge (MPK_ATTN_FOLD=1) vs the pure-torch reference, llama-3.2-1b / qwen3-8b, B=1 and 8
#  3. bench_decode A/B, MPK_ATTN_FOLD=0 then 1, B=1,8, contexts 512 and 4096 (decides the default)
#  3c. weight staging issued after the waits (an experiment: compare with stage 3's "off" at batch 1)
#  4. bench_decode with the HF / gpt-fast peers at ctx 512 (fold as decided by $FOLD, default 1)
#  5. (2 GPUs) bench_allreduce.py: the LL candidate beside the signal protocol and NCCL (16 KiB target <= 3 us)
#  6. (2 GPUs) gpu_check_tp.py --tp-invariant 2 with the fold
#  7. (2 GPUs) bench_decode --tp 2 with the PyTorch TP peer, B=1,8 (qwen3-8b B=8 peer was skipped in session 11)
#  8. (2 GPUs) the LL all-reduce in the megakernel (MPK_AR_LL=1): bitwise TP=1 == TP=2, and the TP=2 bench (compare
#     with stage 7's megakernel column)
set -u
OUT=${OUT:-gpu_out}
FOLD=${FOLD:-1}
mkdir -p "$OUT"/{ref,off,fold,stage_after,peers,ar,tp,tpbench}
snap() { tar -czf "$OUT/pending.tar.gz" -C "$OUT" ref off fold stage_after peers ar tp tpbench pytest_gpu.log 2>/dev/null; }
st() { echo "[$(date +%T)] $*"; }
MODE=${1:-one}
if [ "$MODE" = one ]; then
st "1 tests/gpu"
timeout 110 python3 -m pytest -q -m gpu tests/gpu > "$OUT/pytest_gpu.log" 2>&1; tail -1 "$OUT/pytest_gpu.log"; snap
st "2 fold vs reference"
MPK_ATTN_FOLD=1 OUT="$OUT/ref" timeout 60 python3 scripts/gpu_check_ref.py --models llama-3.2-1b,qwen3-8b \
    --batches 1,8 --steps 32 --no-hf --trace '' > "$OUT/ref/check_ref.log" 2>&1
grep -o '"forced_max_rel_err_vs_ref": [0-9.e-]*\|"ok": [a-z]*' "$OUT/ref/check_ref.log" | paste - -; snap
for v in off fold; do
    st "3 bench $v"
    f=0; [ $v = fold ] && f=1
    MPK_ATTN_FOLD=$f OUT="$OUT/$v" timeout 80 python3 scripts/bench_decode.py --models llama-3.2-1b,qwen3-8b \
        --batches 1,8 --contexts 512,4096 --mk-max-batch 8 --no-peers --budget-s 70 > "$OUT/$v/bench.log" 2>&1
    grep -E " megakernel " "$OUT/$v/bench.log" | grep -v "^\[" | tail -8; snap
done
st "3c staged weights issued after the waits (MPK_STAGE_AFTER_WAIT=1, every CUDA-core tile, auto budget)"
mkdir -p "$OUT/stage_after"
MPK_ATTN_FOLD=0 MPK_STAGE_KB=auto MPK_STAGE_OPS=. MPK_NVCC_DEFINES=-DMPK_STAGE_AFTER_WAIT=1 OUT="$OUT/stage_after" \
    timeout 60 python3 scripts/bench_decode.py --models llama-3.2-1b,qwen3-8b --batches 1 --contexts 512,4096 \
    --mk-max-batch 8 --no-peers --budget-s 50 > "$OUT/stage_after/bench.log" 2>&1
grep -E " megakernel " "$OUT/stage_after/bench.log" | grep -v "^\[" | tail -4; snap
st "4 peers"
MPK_ATTN_FOLD=$FOLD OUT="$OUT/peers" timeout 150 python3 scripts/bench_decode.py --models llama-3.2-1b,qwen3-8b \
    --batches 1,8 --contexts 512 --mk-max-batch 8 --peer-batches 1,8 --hf-batches 1 --budget-s 140 \
    > "$OUT/peers/bench.log" 2>&1
grep -A12 "====" "$OUT/peers/bench.log" | head -14; snap
elif [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
    echo "mode two needs two GPUs"; exit 2
else
    st "5 all-reduce (LL candidate)"
    OUT="$OUT/ar" timeout 90 python3 scripts/bench_allreduce.py > "$OUT/ar/log" 2>&1; tail -10 "$OUT/ar/log"; snap
    st "6 TP=1 == TP=2 with the fold"
    MPK_ATTN_FOLD=1 OUT="$OUT/tp" timeout 90 python3 scripts/gpu_check_tp.py --models llama-3.2-1b,qwen3-8b \
        --batches 1,8 --steps 32 --no-timing --skip-stall --tp-invariant 2 > "$OUT/tp/stdout.log" 2>&1
    grep -o '"ok": [a-z]*' "$OUT/tp/gpu_check_tp.json" | sort | uniq -c; snap
    st "7 TP=2 bench with the PyTorch TP peer"
    MPK_ATTN_FOLD=$FOLD OUT="$OUT/tpbench" timeout 150 python3 scripts/bench_decode.py --tp 2 \
        --models llama-3.2-1b,qwen3-8b --batches 1,8 --budget-s 130 > "$OUT/tpbench/bench_tp2.log" 2>&1
    grep -A8 "====" "$OUT/tpbench/bench_tp2.log"; snap
    st "8 the LL all-reduce in the megakernel (MPK_AR_LL=1): TP=1 == TP=2, then TP=2 bench without peers"
    mkdir -p "$OUT/tp_ll" "$OUT/tpbench_ll"
    MPK_AR_LL=1 OUT="$OUT/tp_ll" timeout 80 python3 scripts/gpu_check_tp.py --models llama-3.2-1b,qwen3-8b \
        --batches 1,8 --steps 32 --no-timing --skip-stall --tp-invariant 2 > "$OUT/tp_ll/stdout.log" 2>&1
    grep -o '"ok": [a-z]*' "$OUT/tp_ll/gpu_check_tp.json" | sort | uniq -c
    MPK_AR_LL=1 OUT="$OUT/tpbench_ll" timeout 70 python3 scripts/bench_decode.py --tp 2 --models llama-3.2-1b,qwen3-8b \
        --batches 1,8 --peer-batches "" --budget-s 55 > "$OUT/tpbench_ll/bench_tp2.log" 2>&1
    grep -A6 "====" "$OUT/tpbench_ll/bench_tp2.log"; tar -czf "$OUT/pending_ll.tar.gz" -C "$OUT" tp_ll tpbench_ll
fi
st done
