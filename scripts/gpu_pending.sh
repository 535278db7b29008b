#!/usr/bin/env bash
# What session 12 left for a GPU, in two commands of < 9.5 min each (stages time-limited; every stage runs even if
# an earlier one fails; $OUT/pending.tar.gz refreshed after each, so a command cut short still returns what ran).
# Usage on the GPU machine, after `source .gpubundle/install.sh` (PYTHONPATH=$PWD:/tmp/site, NVLS off):
#     OUT=$OUT bash scripts/gpu_pending.sh one      # stages 1-3 (one GPU)
#     OUT=$OUT bash scripts/gpu_pending.sh two      # stages 5-8 (two GPUs)
#  1. tests/gpu with -DMPK_ATT_PV_BF16=1 (attention's P.V as bf16 hi + lo mma's, V^T by ldmatrix.trans: not yet run
#     on a GPU) - the attention tests against pyvm decide whether the variant is correct
#  2. bench_decode A/B, default (v24b) then -DMPK_ATT_PV_BF16=1, B=1,8,32, contexts 512 and 4096 (docs/perf-notes.md
#     v24: predicted B=8 ctx 4096 llama -9%, qwen3-8b -7%; B=32 -10 to -12%)
#  3. gpu_check_ref with the variant, B=1 and 8
#  5. (2 GPUs) bench_allreduce.py: the LL candidate beside the signal protocol and NCCL (16 KiB target <= 3 us)
#  6. (2 GPUs) gpu_check_tp.py --tp-invariant 2 (the fold is the default since session 12)
#  7. (2 GPUs) bench_decode --tp 2 with the PyTorch TP peer, B=1,8 (qwen3-8b B=8 peer was skipped in session 11)
#  8. (2 GPUs) the LL all-reduce in the megakernel (MPK_AR_LL=1): bitwise TP=1 == TP=2, and the TP=2 bench (compare
#     with stage 7's megakernel column)
set -u
OUT=${OUT:-gpu_out}
FOLD=${FOLD:-1}
mkdir -p "$OUT"/{ref,def,pvbf16,ar,tp,tpbench}
snap() { tar -czf "$OUT/pending.tar.gz" -C "$OUT" ref def pvbf16 ar tp tpbench pytest_gpu.log 2>/dev/null; }
st() { echo "[$(date +%T)] $*"; }
MODE=${1:-one}
if [ "$MODE" = one ]; then
st "1 tests/gpu with -DMPK_ATT_PV_BF16=1"
MPK_NVCC_DEFINES=-DMPK_ATT_PV_BF16=1 timeout 110 python3 -m pytest -q -m gpu tests/gpu > "$OUT/pytest_gpu.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.log" | tail -6; snap
for v in def pvbf16; do
    st "2 bench $v"
    D=""; [ $v = pvbf16 ] && D=-DMPK_ATT_PV_BF16=1
    MPK_NVCC_DEFINES="$D" OUT="$OUT/$v" timeout 110 python3 scripts/bench_decode.py --models llama-3.2-1b,qwen3-8b \
        --batches 1,8,32 --contexts 512,4096 --mk-max-batch 32 --no-peers --budget-s 100 > "$OUT/$v/bench.log" 2>&1
    grep -E " megakernel " "$OUT/$v/bench.log" | grep -v "^\[" | tail -12; snap
done
st "3 the variant vs the reference"
MPK_NVCC_DEFINES=-DMPK_ATT_PV_BF16=1 OUT="$OUT/ref" timeout 60 python3 scripts/gpu_check_ref.py \
    --models llama-3.2-1b,qwen3-8b --batches 1,8 --steps 32 --no-hf --trace '' > "$OUT/ref/check_ref.log" 2>&1
grep -o '"forced_max_rel_err_vs_ref": [0-9.e-]*\|"ok": [a-z]*' "$OUT/ref/check_ref.log" | paste - -; snap
elif [ "$(nvidia-smi -L | wc -l)" -lt 2 ]; then
    echo "mode two needs two GPUs"; exit 2
else
    st "5 all-reduce (LL candidate)"
    OUT="$OUT/ar" timeout 90 python3 scripts/bench_allreduce.py > "$OUT/ar/log" 2>&1; tail -10 "$OUT/ar/log"; snap
    st "6 TP=1 == TP=2 (fold on by default)"
    OUT="$OUT/tp" timeout 90 python3 scripts/gpu_check_tp.py --models llama-3.2-1b,qwen3-8b \
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
