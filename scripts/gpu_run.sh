#!/usr/bin/env bash
# The device-side wrapper for scripts/gpu_pending.sh: one device call can chain several modes, each under its own
# time limit and folder, and everything so far is tarred into $OUT/all.tgz after each (the device tool returns only
# a few files of $OUT). Needs, beside the tracked tree (carry them): the bundle (.cache/gb: ../shared/gpu/make-bundle.sh
# without ray.tar.xz), the prebuilt cubins (.cache/kc.tar.xz: `MPK_CACHE_DIR=$PWD/.cache/kc python3
# scripts/compile_device.py; tar -cJf .cache/kc.tar.xz -C .cache kc`) and the commit (`git rev-parse HEAD > .cache/commit`).
#     N=run1_one T=300 bash scripts/gpu_run.sh one; N=run2_order T=270 MODELS=qwen3-8b bash scripts/gpu_run.sh order
set -u
# the bundles carried: .cache/gb (nvshmem4py, jsonschema; Ray with RAY=1) and .cache/gbs (the HTTP server's packages,
# SERVE=1 bash scripts/gpu_prepare.sh); a call may carry either or both
for b in .cache/gb .cache/gbs; do [ ! -f $b/install.sh ] || source $b/install.sh; done
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD:/tmp/site GIT_COMMIT=$(cat .cache/commit 2>/dev/null || echo unknown)
[ -d .cache/kc ] || { [ ! -f .cache/kc.tar.xz ] || tar -xJf .cache/kc.tar.xz -C .cache; }
export MPK_CACHE_DIR=$PWD/.cache/kc
O=$OUT/${N:-run}; mkdir -p "$O"
[ -f "$OUT/smi.txt" ] || { nvidia-smi > "$OUT/smi.txt" 2>&1; nvcc --version > "$OUT/nvcc.txt" 2>&1; }
echo "== $(date +%T) ${N:-run}: $*"
OUT=$O timeout "${T:-585}" bash scripts/gpu_pending.sh "$@"
rc=$?
echo "== $(date +%T) ${N:-run} rc=$rc"
tar -czf /tmp/all.tgz -C "$OUT" --exclude=all.tgz . && mv /tmp/all.tgz "$OUT/all.tgz"
