#!/usr/bin/env bash
# Prepares, on the CPU machine, what a device call needs beside the tracked tree (all under the gitignored .cache/,
# which a fresh checkout does not have): the package bundle without Ray (.cache/gb, ~5 MB: single-GPU modes need no
# Ray; RAY=1 keeps it for mode two), the cubins of every device source and variant prebuilt and compressed
# (.cache/kc.tar.xz, ~1.3 MB; scripts/compile_device.py), and the commit the results will name (.cache/commit). Then
# it checks that the tree plus the carry stays under the device tool's 64 MiB. ~4 min from nothing, seconds after.
#     bash scripts/gpu_prepare.sh            then   run(command="N=run1 T=300 bash scripts/gpu_run.sh one; ...",
#                                                      carry=[".cache/gb", ".cache/commit", ".cache/kc.tar.xz"])
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch" 2>/dev/null || { echo "gpu_prepare: this machine's python3 has no torch: run bash scripts/setup.sh first (the README's set-up)"; exit 1; }
mkdir -p .cache
if [ ! -f .cache/gb/install.sh ] || { [ "${RAY:-0}" = 1 ] && [ ! -f .cache/gb/ray.tar.xz ]; }; then
  bash ../shared/gpu/make-bundle.sh .cache/gb
fi
if [ "${RAY:-0}" != 1 ] && [ -f .cache/gb/ray.tar.xz ]; then
  rm .cache/gb/ray.tar.xz
fi
# SERVE=1: the HTTP server's packages the GPU image lacks (fastapi and what it imports: starlette, pydantic and its core, opentelemetry-api; uvicorn; httpx
# is there), pinned to this machine's versions, as their own bundle .cache/gbs (~3 MB; gpu_pending.sh mode serve)
if [ "${SERVE:-0}" = 1 ] && [ ! -f .cache/gbs/install.sh ]; then
  mkdir -p .cache/gbs
  specs=$(python3 -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('fastapi', 'starlette', 'uvicorn', 'pydantic', 'pydantic-core', 'annotated-types', 'typing-inspection', 'opentelemetry-api')))")
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .cache/gbs $specs 2>&1 | grep -v '^WARNING: Location' || true
  cat > .cache/gbs/install.sh <<'INNER'
# source this on the GPU machine: the HTTP server's packages into /tmp/site (on PYTHONPATH)
_s=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [ ! -f /tmp/site/.serve-ok ]; then
  mkdir -p /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$_s"/*.whl 2>&1 | grep -v 'already exists' || true
  touch /tmp/site/.serve-ok
fi
case ":${PYTHONPATH:-}:" in *:/tmp/site:*) ;; *) export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} ;; esac
INNER
  ls .cache/gbs/*.whl | wc -l | grep -qx 8 || { echo "gpu_prepare: the serve bundle is missing wheels: $(ls .cache/gbs)"; exit 1; }
fi
# the bundle's installer untars Ray only where it is there
sed -i 's|^  tar -xJf "$_b/ray.tar.xz" -C /tmp/site && touch /tmp/site/.bundle-ok|  { [ ! -f "$_b/ray.tar.xz" ] \|\| tar -xJf "$_b/ray.tar.xz" -C /tmp/site; } \&\& touch /tmp/site/.bundle-ok|' \
    .cache/gb/install.sh
grep -q 'ray.tar.xz" ] ||' .cache/gb/install.sh || { echo "gpu_prepare: could not make .cache/gb/install.sh's Ray step conditional"; exit 1; }
# cubins: compile_device.py builds every source and variant into the cache (hits are instant); tar them when new
MPK_CACHE_DIR=$PWD/.cache/kc python3 scripts/compile_device.py > .cache/compile_device.log 2>&1 || {
  tail -20 .cache/compile_device.log; echo "gpu_prepare: compile_device.py failed (log: .cache/compile_device.log)"; exit 1; }
# the L2 prefetch A/B's builds (gpu_pending.sh ab variants pf0 / pf32; 64 is the default: MPK_PF_CUR_KB changes the generated
# header), llama's and qwen3's, so the GPU does not compile them
for kb in 0 32; do for d in "" -DMPK_ATT_QKNORM=1; do
  MPK_PF_CUR_KB=$kb MPK_NVCC_DEFINES="$d" MPK_CACHE_DIR=$PWD/.cache/kc python3 -c \
    "from mpk_runtime.codegen import nvcc; nvcc.build()" >> .cache/compile_device.log 2>&1 || {
    tail -20 .cache/compile_device.log; echo "gpu_prepare: the MPK_PF_CUR_KB=$kb $d build failed"; exit 1; }
done; done
tar -cJf .cache/kc.tar.xz -C .cache kc
# shared/gpu/sync_bw.cu (flag / barrier latency, read-only stream by SMs) for gpu_pending.sh's mode card
[ -x .cache/sync_bw ] || nvcc -O3 -arch=sm_90a -o .cache/sync_bw ../shared/gpu/sync_bw.cu
git rev-parse HEAD > .cache/commit
[ -z "$(git status --porcelain --untracked-files=no)" ] || echo "gpu_prepare: note: uncommitted changes (the results will name $(cut -c1-7 .cache/commit) but run the working tree)"
# (the sum over every file: `xargs du -cb | tail -1` took the last of several du calls' totals only)
tree=$(git ls-files -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
carry=$(du -cb .cache/gb .cache/kc.tar.xz .cache/commit .cache/sync_bw | tail -1 | cut -f1)
[ ! -d .cache/gbs ] || echo "gpu_prepare: the serve bundle .cache/gbs is $(du -sb .cache/gbs | cut -f1) B more where a call carries it (then leave .cache/sync_bw out)"
others=$(git ls-files -z --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total=$((tree + carry + ${others:-0}))
# The device tool's limit behaves as 64 MB (10^6 bytes), not MiB: session 61 was refused at 62.7 MiB (65.7 MB) and
# ran at 59.5 MiB (62.4 MB). sync_bw counts here though only mode card carries it.
echo "gpu_prepare: tree $((tree / 1000000)) MB + carry $((carry / 1000000)) MB + untracked $((${others:-0} / 1000000)) MB = $((total / 1000000)) MB (limit 64 MB)"
[ "$total" -lt 64000000 ] || { echo "gpu_prepare: over the device tool's 64 MB: move old results to git history (bench/results/ARCHIVED.md) or gzip them"; exit 1; }
echo 'carry: [".cache/gb", ".cache/commit", ".cache/kc.tar.xz", ".cache/sync_bw"]'
