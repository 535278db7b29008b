#!/usr/bin/env bash
# What session 15 left for a GPU, in commands of < 9.5 min each (stages time-limited; every stage runs even if an
# earlier one fails; $OUT/pending.tar.gz refreshed after each, so a command cut short still returns what ran).
# Usage on the GPU machine, after `source .gpubundle/install.sh` (PYTHONPATH=$PWD:/tmp/site, NVLS off):
#     OUT=$OUT bash scripts/gpu_pending.sh one      # stages 1-3 (one GPU)
#     OUT=$OUT bash scripts/gpu_pending.sh fuse     # stage 3b (one GPU): the fused q/k tail and projections, A/B + tests
#     OUT=$OUT bash scripts/gpu_pending.sh direct   # stage 3c (one GPU): MPK_ATT_DIRECT, tests + A/B
#     MODELS=qwen3-8b OUT=$OUT bash scripts/gpu_pending.sh bench   # stage 4 (one GPU), one model per command
#     OUT=$OUT bash scripts/gpu_pending.sh stamps   # stage 4b (one GPU): attention's stage stamps at B=32, 128
#     OUT=$OUT bash scripts/gpu_pending.sh two      # stages 5-8 (two GPUs)
#  1. tests/gpu (32 passed at f062fbb with the fused norms; rerun after any change)
#  2. the sampler alone: gpu_check_sampling (bitwise vs the CPU semantics) and --profile (measured session 15 at
#     3bdf9b3: 24 / 54 / 204 us at B=1 / 32 / 128 for a 128256 vocab, all rows sampled)
#  3. profile_conventional.py --family attn-mk, llama-3.2-1b B=32,128 (fused norms: 422 kernels per B=32 step), and
#  3b (mode fuse) MPK_CONV_FUSE_ROPE=1 (the q/k tail of qkv_rope as one compiled kernel) and MPK_CONV_FUSE_PROJ=1
#     (q/k/v and gate/up weights back to back: one matmul per group) against the default in one run: validate attn-mk
#     / conventional at B=32,128 both models, then tests/gpu with both. Predictions (docs/perf-notes.md session 15):
#     rope llama attn-mk B=32 -5..8%, qwen3-8b -8..10%; proj llama B=32 ~-7% (~10 us per layer)
#  3c (mode direct) MPK_ATT_DIRECT=1: attention groups of one split (B >= ~17) write their output straight from the
#     chunk (no part / lse, ticket, merge reloads). Prediction: ~2-3 us per task; llama B=128 attention 123 -> ~105 us
#     per layer (-7% of the attn-mk step), B=32 -3%; mono plans at B >= 32 alike
#  4. bench_decode, B=1,8,32,128 x ctx 512,4096 with both peers at every batch, one model per command: the issue-3 table
#     with the fused norms and the reworked sampler (session 15 measured the chosen plans only, via validate_planner:
#     llama B=32 / 128 2.36-2.51 / 3.96 ms, qwen3-8b 8.86 / 13.36; prediction: the same here, gpt-fast 1.3-1.6x ahead)
#  5. (2 GPUs) bench_allreduce.py: the LL candidate beside the signal protocol and NCCL (16 KiB target <= 3 us)
#  6. (2 GPUs) gpu_check_tp.py --tp-invariant 2 (the fold is the default since session 12)
#  7. (2 GPUs) bench_decode --tp 2 with the PyTorch TP peer, B=1,8 (qwen3-8b B=8 peer was skipped in session 11)
#  8. (2 GPUs) the LL all-reduce in the megakernel (MPK_AR_LL=1): bitwise TP=1 == TP=2, and the TP=2 bench (compare
#     with stage 7's megakernel column); then validate_planner --tp 2 (issue 5) if time is left
set -u
OUT=${OUT:-gpu_out}
FOLD=${FOLD:-1}
mkdir -p "$OUT"/{ref,val,prof,bench,ar,tp,tpbench}
snap() { tar -czf "$OUT/pending.tar.gz" -C "$OUT" ref val prof bench ar tp tpbench pytest_gpu.log pytest_gpu_fuse.log pytest_gpu_direct.log 2>/dev/null; }
st() { echo "[$(date +%T)] $*"; }
MODE=${1:-one}
if [ "$MODE" = one ]; then
st "1 tests/gpu"
timeout 110 python3 -m pytest -q -m gpu tests/gpu > "$OUT/pytest_gpu.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.log" | tail -6; snap
st "2 the sampler: bitwise check and profile"
OUT="$OUT/val" timeout 100 python3 scripts/gpu_check_sampling.py --trials 30 > "$OUT/val/sampling.log" 2>&1
grep -E "^sampler V=|^tiny|PASS|FAIL" "$OUT/val/sampling.log"
OUT="$OUT/val" timeout 80 python3 scripts/gpu_check_sampling.py --profile > "$OUT/val/sampler_profile.log" 2>&1
grep "^profile" "$OUT/val/sampler_profile.log"; snap
st "3 profile attn-mk's conventional segments (fused norms)"
timeout 60 python3 scripts/profile_conventional.py --models llama-3.2-1b --batches 32,128 --family attn-mk \
    --out "$OUT/prof" > "$OUT/prof/profile_eager.log" 2>&1
head -30 "$OUT/prof/profile_eager.log"; snap
elif [ "$MODE" = fuse ]; then
st "3b MPK_CONV_FUSE_ROPE / MPK_CONV_FUSE_PROJ (0 0, 1 0, 0 1, 1 1), then tests/gpu with both"
for RP in "0 0" "1 0" "0 1" "1 1"; do
  set -- $RP; d="$OUT/val/rope$1_proj$2"; mkdir -p "$d"
  MPK_CONV_FUSE_ROPE=$1 MPK_CONV_FUSE_PROJ=$2 timeout 110 python3 scripts/validate_planner.py --tp 1 --context 512 \
      --batches 32,128 --families attn-mk,conventional --budget-s 95 --out "$d" > "$d/validate.log" 2>&1
  grep -h measured_us "$d/validate.log" | sed "s/^/rope=$1 proj=$2 /" | cut -c1-200
done
MPK_CONV_FUSE_ROPE=1 MPK_CONV_FUSE_PROJ=1 timeout 110 python3 -m pytest -q -m gpu tests/gpu > "$OUT/pytest_gpu_fuse.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu_fuse.log" | tail -6; snap
elif [ "$MODE" = direct ]; then
st "3c MPK_ATT_DIRECT (one-split attention groups write their output directly): tests, then A/B"
MPK_ATT_DIRECT=1 timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_megakernel.py tests/gpu/test_engine_plans.py \
    > "$OUT/pytest_gpu_direct.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu_direct.log" | tail -6
for D in 0 1; do
  d="$OUT/val/direct$D"; mkdir -p "$d"
  MPK_ATT_DIRECT=$D timeout 150 python3 scripts/validate_planner.py --tp 1 --context 512 --batches 32,128 \
      --families attn-mk,mono --budget-s 135 --out "$d" > "$d/validate.log" 2>&1
  grep -h measured_us "$d/validate.log" | sed "s/^/direct=$D /" | cut -c1-200
done; snap
elif [ "$MODE" = bench ]; then
st "4 bench_decode with both peers"
OUT="$OUT/bench" timeout 560 python3 scripts/bench_decode.py --models "${MODELS:-llama-3.2-1b}" --batches 1,8,32,128 \
    --contexts 512,4096 --mk-max-batch 128 --peer-batches 1,8,32,128 --hf-batches 1,8,32,128 --budget-s 540 > "$OUT/bench/bench.log" 2>&1
grep -A30 "====" "$OUT/bench/bench.log" | head -40; snap
elif [ "$MODE" = stamps ]; then
st "4b attention at large batch: stage stamps of the one-megakernel step at B=32, 128 (where a pass's time goes)"
MPK_NVCC_DEFINES=-DMPK_STAGE_WORDS=12 OUT="$OUT/bench" timeout 300 python3 scripts/bench_decode.py \
    --models llama-3.2-1b,qwen3-8b --batches 32,128 --contexts 512 --mk-max-batch 128 --no-peers --no-planned \
    --trace --budget-s 280 > "$OUT/bench/stamps.log" 2>&1
tail -12 "$OUT/bench/stamps.log"; snap
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
