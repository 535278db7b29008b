#!/usr/bin/env bash
# One GPU command (< 10 min) that verifies the v8 Tensor Core linear (docs/patches/v8-tc-draft.patch,
# docs/perf-notes.md v8) before it is applied to main. The patched tree is built in a copy (/tmp/mpk_v8), then:
#   1. v8 megakernel == CPU twin (pytest -m gpu tests/gpu: tiny configs, B=1/8)
#   2. v8 compute-sanitizer memcheck of the tiny configs
#   3. v8 megakernel vs the pure-torch reference, llama-3.2-1b and qwen3-8b, B=8/32, 32 steps (token mismatches,
#      worst relative logit error; the same check for v5 is in bench/results/gpu_check_ref_*: equal errors are
#      necessary, not sufficient, for the bitwise-equality claim - a direct logit dump would be the proof)
#   4. bench_decode megakernel B=1/8/32/128, context 512, v5 (this tree) and v8 side by side
# Usage on the GPU machine, after `source .gpubundle/install.sh`:   OUT=$OUT bash scripts/gpu_verify_v8.sh
# Every stage runs even if an earlier one fails; logs under $OUT/v5 and $OUT/v8.
set -u
OUT=${OUT:-gpu_out}
ROOT=$(pwd)
V8=/tmp/mpk_v8
rm -rf "$V8" && mkdir -p "$V8" "$OUT/v5" "$OUT/v8"
tar --exclude=.git --exclude=.gpubundle -cf - . | tar -xf - -C "$V8"
if ! (cd "$V8" && git apply docs/patches/v8-tc-draft.patch) > "$OUT/v8/apply.log" 2>&1; then
    echo "the v8 patch does not apply: $OUT/v8/apply.log"; exit 2
fi
export PYTHONPATH_BASE=${PYTHONPATH:-}
v8() { (cd "$V8" && PYTHONPATH="$V8:$PYTHONPATH_BASE" OUT="$OUT/v8" "$@"); }
v8 timeout 150 python3 scripts/compile_device.py > "$OUT/v8/compile.log" 2>&1
echo "v8 compile: $(tail -1 "$OUT/v8/compile.log" | cut -c1-160)"
v8 timeout 120 python3 -m pytest -q -m gpu tests/gpu > "$OUT/v8/pytest_gpu.log" 2>&1
echo "v8 tests/gpu: $(tail -1 "$OUT/v8/pytest_gpu.log")"
v8 timeout 120 bash scripts/gpu_memcheck.sh > /dev/null 2>&1
echo "v8 memcheck: $(grep -E 'ERROR SUMMARY' "$OUT/v8/memcheck.log" | tail -1)"
v8 timeout 150 python3 scripts/gpu_check_ref.py --models llama-3.2-1b,qwen3-8b --batches 8,32 --steps 32 --no-hf \
    --trace '' > "$OUT/v8/check_ref.log" 2>&1
echo "v8 vs reference:"
python3 - "$OUT/v8/gpu_check_ref.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except OSError as e:
    sys.exit(f"  no result file ({e})")
for r in d["rows"]:
    print(f"  {r['model']} B={r['batch']} identical={r['free_tokens_identical']} "
          f"forced_rel_err={r['forced_max_rel_err_vs_ref']:.2e} agree={r['forced_argmax_agree_ref']} ok={r['ok']}")
for e in d["errors"]:
    print("  ERROR", e.get("model"), e.get("batch"), e["error"][:200])
PY
for tag in v5 v8; do
    dir=$ROOT; [ "$tag" = v8 ] && dir=$V8
    (cd "$dir" && PYTHONPATH="$dir:$PYTHONPATH_BASE" OUT="$OUT/$tag" GIT_COMMIT="${GIT_COMMIT:-unknown}-$tag" \
        timeout 110 python3 scripts/bench_decode.py --models llama-3.2-1b,qwen3-8b --batches 1,8,32,128 \
        --contexts 512 --peer-batches "" --hf-batches "" --budget-s 95) > "$OUT/$tag/bench.log" 2>&1
    echo "$tag bench:"; grep -E " megakernel " "$OUT/$tag/bench.log" | tail -8
done
