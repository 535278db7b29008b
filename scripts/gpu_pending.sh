#!/usr/bin/env bash
# What session 16 left for a GPU, in commands of < 9.5 min each (stages time-limited; every stage runs even if an
# earlier one fails; $OUT/pending.tar.gz refreshed after each, so a command cut short still returns what ran).
# Usage on the GPU machine, after `source .gpubundle/install.sh` (PYTHONPATH=$PWD:/tmp/site, NVLS off):
#     OUT=$OUT bash scripts/gpu_pending.sh one      # stages 1-3 (one GPU): tests/gpu, the sampler, the conventional profile
#     OUT=$OUT bash scripts/gpu_pending.sh warp     # stage 3d (one GPU): MPK_ATT_WARP_PIPE / MPK_ATT_GROUPS tests + stamps
#     OUT=$OUT bash scripts/gpu_pending.sh warpab   # stage 3d' (one GPU): default vs the warp pipe, B=1..128
#     OUT=$OUT bash scripts/gpu_pending.sh groupab  # stage 3d'' (one GPU): MPK_ATT_GROUPS=2 without / with the warp pipe
#     OUT=$OUT bash scripts/gpu_pending.sh stageab  # stage 3d* (one GPU): the warp pipe with 3 K/V stages, ctx 4096
#     OUT=$OUT bash scripts/gpu_pending.sh consistency   # stage 3e (one GPU): validate_planner vs bench_decode, same point
#     OUT=$OUT bash scripts/gpu_pending.sh fuse2    # stage 3f (one GPU): MPK_CONV_FUSE_SILU / MPK_CONV_FUSE_KV tests + A/B
#     OUT=$OUT bash scripts/gpu_pending.sh san      # stage 3g (one GPU): memcheck + racecheck, warp pipe + groups
#     MODELS=qwen3-8b OUT=$OUT bash scripts/gpu_pending.sh bench   # stage 4 (one GPU), one model per command
#     OUT=$OUT bash scripts/gpu_pending.sh stamps   # stage 4b (one GPU): stage stamps at B=1,8 (STAMP_BATCHES=32,128 ...)
#     MODELS=qwen3-8b OUT=$OUT bash scripts/gpu_pending.sh hf   # stage 4c (one GPU): the HF peer alone, B=8..128
#     OUT=$OUT bash scripts/gpu_pending.sh two      # stages 5-8 (two GPUs)
# Order for a 30-minute session (one GPU): one (~5 min: it also checks session 16's restructured attention on the
# default path and the rows-only compile), warp (~6), consistency (~7), fuse2 (~5), then warpab / groupab (~5-8 each)
# for what passed; the bench table (MODELS=... bench) when the defaults change; san when time is left.
#  1. tests/gpu (34 passed at 48105cf with MPK_CONV_FUSE_ROPE/PROJ=1; the session-16 defaults at 6524c80: 23 passed,
#     none failed, before the command's 110 s limit on a cold compile cache; session 16 added 4 attention tests: 200 s)
#  2. the sampler alone: gpu_check_sampling (bitwise vs the CPU semantics) and --profile (session 16: 24 / 54 / 204 us
#     at B=1 / 32 / 128 for a 128256 vocab, all rows sampled)
#  3. profile_conventional.py --family attn-mk, llama-3.2-1b B=32,128
#  3d (modes warp, warpab, groupab) -DMPK_ATT_WARP_PIPE=1 (attention: each warp streams its own rows, no CTA
#     barrier per pass) and MPK_ATT_GROUPS=2 (two KV groups of a sequence per task where the keys are one split: the
#     page table and q once, the groups' passes one pipeline): the GPU tests with each, stamps, then the A/Bs
#     (bench_decode --no-peers: one megakernel at B=1,8, the planned attn-mk at B=32,128; ctx 512 / 4096).
#     Predictions (docs/perf-notes.md session 16): warp pipe: a pass 1.75 -> ~1.0-1.2 us; llama B=128 ctx 512
#     attention task ~11.5 -> ~9 us (attn-mk step -6..8%), qwen3-8b B=128 -8..10%; B=1 within 1%. Groups: ~3 us of
#     per-task start saved per extra group: llama B=128 -7%, B=32 -3%; with the warp pipe about additive.
#     -DMPK_ATT_STAGES=3 (warp pipe only): two passes in flight per warp; a pass's 32 KB in flight per SM caps an SM at
#     ~16 GB/s at ~2 us latency (~2.1 TB/s over 132 SMs): if the warp pipe alone stalls near that, 3 stages lift the
#     cap (prediction: llama B=128 ctx 4096 attention -15..25% on top of the warp pipe, if it is memory-bound)
#  3e (mode consistency) the bench's planned column measured 7-16% below validate_planner's measurement of the same
#     plan in session 16 (llama B=32 attn-mk 2.056 vs ~2.2 ms expected from validate); both call measure_plan. A
#     suspect: the fused norm compiled with every dim dynamic took 338 us per B=32 step after the tiny GPU-test configs
#     compiled first (82 us in session 15); since session 16 only the rows are dynamic (compile_rows_dynamic). Another:
#     validate timed its replays right after seconds of host-side compile (idle clocks); it now replays ~0.3 s first.
#     First the norm's time after the tests compiled first, then validate and bench on the same points, twice
#  3f (mode fuse2) MPK_CONV_FUSE_SILU=1 (SiLU-and-mul one kernel) and MPK_CONV_FUSE_KV=1 (the cache appends in the
#     q/k tail kernel): the engine-plan GPU tests with both, then validate attn-mk B=32,128 with (0,0), (1,0), (0,1), (1,1)
#  4. bench_decode, B=1,8,32,128 x ctx 512,4096 with both peers at every batch, one model per command (session 16:
#     48105cf with the three switches on = the defaults of 6524c80, bench/results/s16)
#  5. (2 GPUs) bench_allreduce.py: the LL candidate beside the signal protocol and NCCL (16 KiB target <= 3 us)
#  6. (2 GPUs) gpu_check_tp.py --tp-invariant 2 (the fold is the default since session 12)
#  7. (2 GPUs) bench_decode --tp 2 with the PyTorch TP peer, B=1,8 (qwen3-8b B=8 peer was skipped in session 11)
#  8. (2 GPUs) the LL all-reduce in the megakernel (MPK_AR_LL=1): bitwise TP=1 == TP=2, and the TP=2 bench (compare
#     with stage 7's megakernel column); then validate_planner --tp 2 (issue 5) if time is left
set -u
OUT=${OUT:-gpu_out}
FOLD=${FOLD:-1}
mkdir -p "$OUT"/{ref,val,prof,bench,ar,tp,tpbench,san}
snap() { tar -czf "$OUT/pending.tar.gz" -C "$OUT" ref val prof bench ar tp tpbench san pytest_gpu.log pytest_gpu_warp.log pytest_gpu_groups.log pytest_gpu_stages.log pytest_gpu_silu_kv.log 2>/dev/null; }
st() { echo "[$(date +%T)] $*"; }
MODE=${1:-one}
if [ "$MODE" = one ]; then
st "1 tests/gpu"
timeout 200 python3 -m pytest -q -m gpu tests/gpu > "$OUT/pytest_gpu.log" 2>&1
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
elif [ "$MODE" = warp ]; then
st "3d MPK_ATT_WARP_PIPE, MPK_ATT_GROUPS=2, MPK_ATT_STAGES=3: the attention GPU tests with each, then stamps"
MPK_NVCC_DEFINES=-DMPK_ATT_WARP_PIPE=1 timeout 150 python3 -m pytest -q -m gpu tests/gpu/test_megakernel.py \
    tests/gpu/test_attention_long.py tests/gpu/test_attn_fold.py tests/gpu/test_engine_plans.py > "$OUT/pytest_gpu_warp.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu_warp.log" | tail -6; snap
MPK_ATT_GROUPS=2 timeout 120 python3 -m pytest -q -m gpu tests/gpu/test_megakernel.py tests/gpu/test_attention_long.py \
    tests/gpu/test_engine_plans.py > "$OUT/pytest_gpu_groups.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu_groups.log" | tail -6; snap
MPK_NVCC_DEFINES="-DMPK_ATT_WARP_PIPE=1 -DMPK_ATT_STAGES=3" timeout 90 python3 -m pytest -q -m gpu \
    tests/gpu/test_megakernel.py tests/gpu/test_attention_long.py > "$OUT/pytest_gpu_stages.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu_stages.log" | tail -6; snap
MPK_ATT_GROUPS=2 MPK_NVCC_DEFINES="-DMPK_ATT_WARP_PIPE=1 -DMPK_STAGE_WORDS=12" OUT="$OUT/bench/warp_stamps" timeout 100 \
    python3 scripts/bench_decode.py --models llama-3.2-1b --batches 32,128 --contexts 512 --mk-max-batch 128 --no-peers \
    --no-planned --trace --budget-s 90 > "$OUT/bench/warp_stamps.log" 2>&1; tail -4 "$OUT/bench/warp_stamps.log"; snap
elif [ "$MODE" = san ]; then
st "3g compute-sanitizer memcheck + racecheck with the warp pipe and grouped attention (tiny configs, incl. one split)"
MPK_ATT_GROUPS=2 MPK_NVCC_DEFINES=-DMPK_ATT_WARP_PIPE=1 OUT="$OUT/san" timeout 400 bash scripts/gpu_memcheck.sh; snap
elif [ "$MODE" = warpab ] || [ "$MODE" = groupab ] || [ "$MODE" = stageab ] || [ "$MODE" = ab ]; then
# warpab: default vs -DMPK_ATT_WARP_PIPE=1 (one megakernel at B=1,8, the planned attn-mk at B=32,128; ctx 512, 4096)
# groupab: default, MPK_ATT_GROUPS=2, and both with the warp pipe (B=32,128, where the keys are one split)
# stageab: default, the warp pipe, and it with 3 K/V stages (MPK_ATT_STAGES=3: two passes in flight), B=8..128 at
#          ctx 4096 where a pass's bytes in flight bound the rate
# ab: VARS="..." BS=... CTXS=... of the variants below
case $MODE in
  warpab) VARS="base warp"; BS=1,8,32,128; CTXS=512,4096; LIM=270;;
  groupab) VARS="base groups warpgroups"; BS=32,128; CTXS=512,4096; LIM=185;;
  stageab) VARS="base warp warp3"; BS=8,32,128; CTXS=4096; LIM=185;;
  ab) VARS=${VARS:-base warp}; BS=${BS:-32,128}; CTXS=${CTXS:-512}; LIM=${LIM:-185};;
esac
st "3d' $MODE: $VARS at B=$BS ctx $CTXS"
for V in $VARS; do
  case $V in base) D=""; G=1;; warp) D="-DMPK_ATT_WARP_PIPE=1"; G=1;; warp3) D="-DMPK_ATT_WARP_PIPE=1 -DMPK_ATT_STAGES=3"; G=1;;
             groups) D=""; G=2;; warpgroups) D="-DMPK_ATT_WARP_PIPE=1"; G=2;;
             warp3groups) D="-DMPK_ATT_WARP_PIPE=1 -DMPK_ATT_STAGES=3"; G=2;; *) echo "unknown variant $V"; continue;; esac
  d="$OUT/bench/ab_$V"; mkdir -p "$d"
  MPK_ATT_GROUPS=$G MPK_NVCC_DEFINES="$D" OUT="$d" timeout $LIM python3 scripts/bench_decode.py --models llama-3.2-1b,qwen3-8b \
      --batches $BS --contexts $CTXS --mk-max-batch 8 --no-peers --budget-s $((LIM - 15)) > "$d/bench.log" 2>&1
  grep -A20 "====" "$d/bench.log" | sed "s/^/[$V] /"; snap
done
python3 scripts/ab_table.py $(for V in $VARS; do echo "$V=$OUT/bench/ab_$V/bench_decode.json"; done)
elif [ "$MODE" = consistency ]; then
st "3e the norm kernel after tiny configs compiled first (rows-only dynamic compile), then validate vs bench, twice"
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_engine_plans.py > "$OUT/pytest_gpu.log" 2>&1
grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu.log" | tail -3
timeout 60 python3 scripts/profile_conventional.py --models llama-3.2-1b --batches 32 --family attn-mk \
    --out "$OUT/prof" > "$OUT/prof/profile_after_tests.log" 2>&1
grep -E "==|rsqrt" "$OUT/prof/profile_after_tests.log" | head -4   # s16 run 1: 33x 338 us (all dims dynamic); s15: 82 us
for k in 1 2; do
  d="$OUT/val/cons$k"; mkdir -p "$d" "$OUT/bench/cons$k"
  timeout 100 python3 scripts/validate_planner.py --tp 1 --context 512 --batches 32,128 --families attn-mk \
      --budget-s 90 --out "$d" > "$d/validate.log" 2>&1
  grep -h measured_us "$d/validate.log" | cut -c1-160 | sed "s/^/[validate $k] /"
  OUT="$OUT/bench/cons$k" timeout 100 python3 scripts/bench_decode.py --models llama-3.2-1b,qwen3-8b --batches 32,128 \
      --contexts 512 --no-peers --budget-s 90 > "$OUT/bench/cons$k/bench.log" 2>&1
  grep planned "$OUT/bench/cons$k/bench.log" | sed "s/^/[bench $k] /"; snap
done
elif [ "$MODE" = fuse2 ]; then
st "3f MPK_CONV_FUSE_SILU=1 and MPK_CONV_FUSE_KV=1 (predictions: llama B=32 ~-2% and ~-4%): tests, then A/B"
mkdir -p "$OUT/val/silu0_kv0"
timeout 100 python3 scripts/validate_planner.py --tp 1 --context 512 --batches 32,128 --families attn-mk \
    --budget-s 90 --out "$OUT/val/silu0_kv0" > "$OUT/val/silu0_kv0/validate.log" 2>&1
grep -h measured_us "$OUT/val/silu0_kv0/validate.log" | cut -c1-160 | sed "s/^/[silu=0 kv=0] /"
MPK_CONV_FUSE_SILU=1 MPK_CONV_FUSE_KV=1 timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_engine_plans.py \
    > "$OUT/pytest_gpu_silu_kv.log" 2>&1; grep -E "^FAILED|passed|failed" "$OUT/pytest_gpu_silu_kv.log" | tail -3
for SK in "1 0" "0 1" "1 1"; do
  set -- $SK; d="$OUT/val/silu$1_kv$2"; mkdir -p "$d"
  MPK_CONV_FUSE_SILU=$1 MPK_CONV_FUSE_KV=$2 timeout 100 python3 scripts/validate_planner.py --tp 1 --context 512 \
      --batches 32,128 --families attn-mk --budget-s 90 --out "$d" > "$d/validate.log" 2>&1
  grep -h measured_us "$d/validate.log" | cut -c1-160 | sed "s/^/[silu=$1 kv=$2] /"; snap
done
python3 scripts/ab_table.py $(for v in silu0_kv0 silu1_kv0 silu0_kv1 silu1_kv1; do
  echo "$v=$OUT/val/$v/planner_validation_rows.jsonl"; done)
elif [ "$MODE" = bench ]; then
st "4 bench_decode with both peers"
OUT="$OUT/bench" timeout 560 python3 scripts/bench_decode.py --models "${MODELS:-llama-3.2-1b}" --batches 1,8,32,128 \
    --contexts 512,4096 --mk-max-batch 128 --peer-batches 1,8,32,128 --hf-batches 1,8,32,128 --budget-s 540 > "$OUT/bench/bench.log" 2>&1
grep -A30 "====" "$OUT/bench/bench.log" | head -40; snap
elif [ "$MODE" = hf ]; then
st "4c the HF peer alone at B=8,32,128 x ctx 512,4096 (qwen3-8b's were skipped by the bench's budget in session 16)"
OUT="$OUT/bench" timeout 560 python3 scripts/bench_decode.py --models "${MODELS:-qwen3-8b}" --batches 8,32,128 \
    --contexts 512,4096 --mk-max-batch 0 --no-planned --peer-batches "" --hf-batches 8,32,128 --budget-s 540 \
    > "$OUT/bench/hf.log" 2>&1
grep -A12 "====" "$OUT/bench/hf.log"; snap
elif [ "$MODE" = stamps ]; then
st "4b stage stamps of the one-megakernel step at B=1, 8 (qwen3-8b B=8 is 0.82x gpt-fast; session 10's stamps are old)"
st "   and B=32, 128 (attention's passes; session 16 has them for the default build)"
MPK_NVCC_DEFINES=-DMPK_STAGE_WORDS=12 OUT="$OUT/bench" timeout 300 python3 scripts/bench_decode.py \
    --models llama-3.2-1b,qwen3-8b --batches ${STAMP_BATCHES:-1,8} --contexts 512 --mk-max-batch 128 --no-peers --no-planned \
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
