#!/usr/bin/env bash
# compute-sanitizer memcheck (then racecheck) of the megakernel on the tiny configs (tiny-llama, tiny-qwen3; batch 1 and 8; a few
# decode steps each, plus the traced tiny launch, checked against the CPU twin by gpu_check.py). GPU machine only:
#     OUT=/some/dir bash scripts/gpu_memcheck.sh
# Writes $OUT/memcheck.log; exits non-zero if the sanitizer reports an error or the check fails. The kernel's
# spin-wait timeout is raised (MPK_KERNEL_TIMEOUT_S) because every instrumented access is slow under memcheck.
# API return codes are not reported (--report-api-errors no): cuda-bindings probes driver entry points with
# cuGetProcAddress at import and 34 of those probes return CUDA_ERROR_INVALID_VALUE on the H200 machine's
# driver, which memcheck otherwise counts as errors (first run, 2026-11-30: 34 such reports, 0 memory errors).
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
MPK_KERNEL_TIMEOUT_S=${MPK_KERNEL_TIMEOUT_S:-60} "$CS" --tool memcheck --report-api-errors no --error-exitcode 9 --print-limit 100 \
    python3 scripts/gpu_check.py --models tiny-llama,tiny-qwen3 --steps 4 > "$OUT/memcheck.log" 2>&1
rc=$?
grep -E "^correct|ERROR|ERROR SUMMARY|Invalid __global__|Invalid __shared__|Program hit" "$OUT/memcheck.log" | head -20
echo "memcheck rc=$rc (0 = clean and the tiny configs matched the CPU twin)"
# racecheck: shared-memory hazards (the double-buffered task records, the ops' staging buffers); batch 1, quick.
# Session 10: 0 hazards at 1db4255 (run 1 before it: 14 warnings in the attention softmax, fixed by a __syncwarp).
MPK_KERNEL_TIMEOUT_S=${MPK_KERNEL_TIMEOUT_S:-60} "$CS" --tool racecheck --report-api-errors no --error-exitcode 9 \
    --print-limit 50 python3 scripts/gpu_check.py --models tiny-llama,tiny-qwen3 --quick > "$OUT/racecheck.log" 2>&1
rrc=$?
grep -E "RACECHECK SUMMARY|Race reported" "$OUT/racecheck.log" | head -10
if [ $rrc -eq 0 ] && ! grep -q "RACECHECK SUMMARY: 0 hazards" "$OUT/racecheck.log"; then rrc=8; fi
echo "racecheck rc=$rrc (0 = no shared-memory hazards reported)"
[ $rc -ne 0 ] && exit $rc
exit $rrc
