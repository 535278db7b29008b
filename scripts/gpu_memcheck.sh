#!/usr/bin/env bash
# compute-sanitizer memcheck of the megakernel on the tiny configs (tiny-llama, tiny-qwen3; batch 1 and 8; a few
# decode steps each, plus the traced tiny launch, checked against the CPU twin by gpu_check.py). GPU machine only:
#     OUT=/some/dir bash scripts/gpu_memcheck.sh
# Writes $OUT/memcheck.log; exits non-zero if the sanitizer reports an error or the check fails. The kernel's
# spin-wait timeout is raised (MPK_KERNEL_TIMEOUT_S) because every instrumented access is slow under memcheck.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
MPK_KERNEL_TIMEOUT_S=${MPK_KERNEL_TIMEOUT_S:-60} "$CS" --tool memcheck --error-exitcode 9 --print-limit 100 \
    python3 scripts/gpu_check.py --models tiny-llama,tiny-qwen3 --steps 4 > "$OUT/memcheck.log" 2>&1
rc=$?
grep -E "^correct|ERROR|ERROR SUMMARY|Invalid __global__|Invalid __shared__|Program hit" "$OUT/memcheck.log" | head -20
echo "memcheck rc=$rc (0 = clean and the tiny configs matched the CPU twin)"
exit $rc
