#!/usr/bin/env bash
# A/B check of this tree ("new") against a baseline tree ("base", e.g. the commit before a device-code change),
# in GPU commands of < 10 min each. Usage on the GPU machine, after `source .gpubundle/install.sh`:
#     BASE=/path/to/base/tree OUT=$OUT bash scripts/gpu_ab.sh check     # correctness of new + 1-GPU A/B bench
#     BASE=/path/to/base/tree OUT=$OUT bash scripts/gpu_ab.sh tp        # TP=2 A/B bench (2 GPUs) + new's trace
#     BASE=/path/to/base/tree OUT=$OUT bash scripts/gpu_ab.sh perf      # one command: tests/gpu, vs reference,
#                                                  1-GPU and TP=2 A/B bench without peers, new's TP=2 trace
#     BASE=/path/to/base/tree OUT=$OUT bash scripts/gpu_ab.sh session   # one < 9.5 min command on 2 GPUs (the
#         session-7 recipe): tests/gpu, 1-GPU A/B at contexts 512 and 4096 (new traced), memcheck, vs reference,
#         TP=1 == TP=2, new's TP=2 bench, Ray load test; $OUT/ab.tar.gz is refreshed after every stage, so a
#         command cut short still returns what ran. BASE may equal the tree for an A/B of an environment switch:
#         BASE_ENV / NEW_ENV (e.g. NEW_ENV="MPK_NVCC_DEFINES=-DMPK_ATT_PV_SPLIT=0": one word, no spaces) are set
#         for the respective bench runs (modes check, perf's 1-GPU bench and session).
# MODELS (default llama-3.2-1b,qwen3-8b) and BATCHES (default 1,8) narrow it. Every stage runs even if an earlier
# one fails; logs and result files under $OUT/{new,base}; each stage has its own time limit.
set -u
OUT=${OUT:-gpu_out}
MODELS=${MODELS:-llama-3.2-1b,qwen3-8b}
BATCHES=${BATCHES:-1,8}
ROOT=$(pwd)
BASE=${BASE:?set BASE to the baseline tree}
mkdir -p "$OUT/new" "$OUT/base"
PP=${PYTHONPATH:-}
new() { (cd "$ROOT" && PYTHONPATH="$ROOT:$PP" OUT="$OUT/new" GIT_COMMIT="${GIT_COMMIT:-unknown}" "$@"); }
base() { (cd "$BASE" && PYTHONPATH="$BASE:$PP" OUT="$OUT/base" GIT_COMMIT="${BASE_COMMIT:-base}" "$@"); }
stage() { echo "[$(date +%T)] $*"; }
tests_and_ref() {   # new tree: tests/gpu, then teacher-forced vs the pure-torch reference
    stage "new: pytest -m gpu tests/gpu"
    new timeout 120 python3 -m pytest -q -m gpu tests/gpu > "$OUT/new/pytest_gpu.log" 2>&1
    tail -1 "$OUT/new/pytest_gpu.log"
    stage "new: vs the pure-torch reference"
    new timeout 150 python3 scripts/gpu_check_ref.py --models "$MODELS" --batches "$BATCHES" --steps 32 --no-hf \
        --trace '' > "$OUT/new/check_ref.log" 2>&1
    grep -E "ok=|ERROR|Error" "$OUT/new/check_ref.log" | tail -8
}
bench_1gpu() {     # base then new, megakernel only (BASE_ENV / NEW_ENV set for the respective runs)
    for t in base new; do
        stage "$t: bench_decode 1 GPU"
        envs="${BASE_ENV:-}"; [ "$t" = new ] && envs="${NEW_ENV:-}"
        $t env $envs timeout 75 python3 scripts/bench_decode.py --models "$MODELS" --batches "$BATCHES" --contexts 512 \
            --peer-batches "" --hf-batches "" --budget-s 60 > "$OUT/$t/bench.log" 2>&1
        grep -E " megakernel " "$OUT/$t/bench.log" | tail -8
    done
}
phases() {         # trace_phases of new's traced TP=2 launches
    for f in "$OUT"/new/tp2_trace_*_r0.json.gz; do
        [ -e "$f" ] || continue
        m=$(basename "$f" | sed -E 's/tp2_trace_(.*)_b1_r0.json.gz/\1/')
        stage "new: trace phases $m"
        new timeout 60 python3 scripts/trace_phases.py --model "$m" --tp 2 --batch 1 --context 512 "$f" \
            > "$OUT/new/phases_$m.txt" 2>&1
        head -14 "$OUT/new/phases_$m.txt"
    done
}
case "${1:-check}" in
check)
    tests_and_ref
    stage "new: TP=1 == TP=2 (tp_invariant 2)"
    new timeout 150 python3 scripts/gpu_check_tp.py --models "$MODELS" --batches "$BATCHES" --steps 64 --no-timing \
        --skip-stall --tp-invariant 2 > "$OUT/new/check_tp.log" 2>&1
    tail -6 "$OUT/new/check_tp.log"
    bench_1gpu
    stage "new: memcheck (tiny configs)"
    new timeout 180 bash scripts/gpu_memcheck.sh > "$OUT/new/memcheck_summary.log" 2>&1
    tail -2 "$OUT/new/memcheck_summary.log"
    ;;
tp)
    stage "new: bench_decode TP=2 with peers, traced B=1"
    new timeout 170 python3 scripts/bench_decode.py --tp 2 --models "$MODELS" --batches "$BATCHES" \
        --budget-s 140 > "$OUT/new/bench_tp2.log" 2>&1
    grep -E "megakernel|gptfast" "$OUT/new/bench_tp2.log" | tail -12
    stage "base: bench_decode TP=2, no peers, no trace"
    base timeout 80 python3 scripts/bench_decode.py --tp 2 --models "$MODELS" --batches "$BATCHES" \
        --peer-batches "" --no-comm-trace --budget-s 60 > "$OUT/base/bench_tp2.log" 2>&1
    grep -E "megakernel_tp2" "$OUT/base/bench_tp2.log" | tail -8
    phases
    ;;
perf)
    tests_and_ref
    bench_1gpu
    for t in base new; do
        stage "$t: bench_decode TP=2, no peers"
        trace=--no-comm-trace; [ "$t" = new ] && trace=--comm-trace
        $t timeout 90 python3 scripts/bench_decode.py --tp 2 --models "$MODELS" --batches "$BATCHES" \
            --peer-batches "" $trace --budget-s 70 > "$OUT/$t/bench_tp2.log" 2>&1
        grep -E "megakernel_tp2" "$OUT/$t/bench_tp2.log" | tail -4
    done
    phases
    ;;
session)
    snap() { tar -czf "$OUT/ab.tar.gz" -C "$OUT" new base 2>/dev/null; }
    stage "new: pytest -m gpu tests/gpu"
    new timeout 100 python3 -m pytest -q -m gpu tests/gpu > "$OUT/new/pytest_gpu.log" 2>&1
    tail -1 "$OUT/new/pytest_gpu.log"; snap
    for t in base new; do
        stage "$t: bench_decode 1 GPU, contexts 512 and 4096"
        tr=""; envs="${BASE_ENV:-}"; [ "$t" = new ] && tr=--trace && envs="${NEW_ENV:-}"
        $t env $envs timeout 85 python3 scripts/bench_decode.py --models "$MODELS" --batches "$BATCHES" \
            --contexts 512,4096 --mk-max-batch 8 --no-peers $tr --budget-s 72 > "$OUT/$t/bench.log" 2>&1
        grep -E " megakernel " "$OUT/$t/bench.log" | grep -v "^\[" | tail -8; snap
    done
    stage "new: memcheck (tiny configs)"
    new env MPK_KERNEL_TIMEOUT_S=60 timeout 150 bash scripts/gpu_memcheck.sh > "$OUT/new/memcheck_summary.log" 2>&1
    tail -1 "$OUT/new/memcheck_summary.log"; snap
    stage "new: vs the pure-torch reference"
    new timeout 70 python3 scripts/gpu_check_ref.py --models "$MODELS" --batches "$BATCHES" --steps 32 --no-hf \
        --trace '' > "$OUT/new/check_ref.log" 2>&1
    grep -o '"ok": [a-z]*' "$OUT/new/check_ref.log" | sort | uniq -c; snap
    stage "new: TP=1 == TP=2 (tp_invariant 2)"
    new timeout 70 python3 scripts/gpu_check_tp.py --models "$MODELS" --batches "$BATCHES" --steps 32 --no-timing \
        --skip-stall --tp-invariant 2 > "$OUT/new/check_tp.log" 2>&1
    grep -o '"ok": [a-z]*' "$OUT/new/check_tp.log" | sort | uniq -c; snap
    stage "new: bench_decode TP=2, no peers"
    new timeout 65 python3 scripts/bench_decode.py --tp 2 --models "$MODELS" --batches "$BATCHES" --peer-batches "" \
        --budget-s 50 > "$OUT/new/bench_tp2.log" 2>&1
    grep -E "ms/token" "$OUT/new/bench_tp2.log" | tail -8; snap
    stage "new: Ray TP=2 load test"
    new timeout 110 python3 scripts/load_test.py --model llama-3.2-1b --backend megakernel --tp 2 --executor ray \
        --requests 100 --out "$OUT/new/load" > "$OUT/new/load.log" 2>&1
    grep -E '"(succeeded|tokens_per_s|latency_p50_s|latency_p99_s|ttft_p50_s|ttft_p99_s)"' \
        "$OUT/new/load/load_test.json"; snap
    ;;
*) echo "usage: gpu_ab.sh check|tp|perf|session"; exit 2 ;;
esac
