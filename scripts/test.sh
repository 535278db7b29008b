#!/usr/bin/env bash
# The test command: compiles every device source for sm_90a (when nvcc is present), runs the tests, then (a full run
# on a machine where scripts/setup.sh put Triton in .cache/triton-site) the Triton kernels' tests: the interpreter's
# (paged attention, its switches, the skinny GEMM against torch references, the full-vocabulary draw) and the offline sm_90 builds.
# With arguments: one `pytest -q ARGS` and nothing else. A full run (no arguments) runs the same tests in two streams at
# once, each its own pytest process (every test runs one torch thread, tests/conftest.py, so two streams fill CI's two
# cores): stream 1 is tests/ but for the directories of stream 2, then the offline Triton builds; stream 2 is the Ray
# cluster's and the scripts' tests (without Triton here, the planner's and the engine's too), then the Triton
# interpreter's. Only stream 2 starts Ray. Stream 1 prints as it goes, stream 2's output follows it; the run fails
# if any of them failed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f scripts/compile_device.py ]; then
  python3 scripts/compile_device.py
fi
if [ $# -gt 0 ]; then
  exec python3 -m pytest -q "$@"
fi
triton=0
[ -f .cache/triton-site/triton/__init__.py ] && triton=1
if [ $triton = 1 ]; then   # balanced on CI's 2 cores: ~9.7 min a stream (s60: 18.8 min for the whole run one after the other)
  second=(tests/cluster tests/scripts)
else
  second=(tests/cluster tests/scripts tests/planner tests/engine)
fi
ignore=()
for d in "${second[@]}"; do ignore+=("--ignore=$d"); done
tmp=$(mktemp -d)
pid2=
cleanup() {
  if [ -n "$pid2" ] && kill -0 "$pid2" 2>/dev/null; then
    pkill -TERM -P "$pid2" 2>/dev/null || true
    kill "$pid2" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
triton_path="$PWD:$PWD/.cache/triton-site${PYTHONPATH:+:$PYTHONPATH}"

(
  rc=0
  python3 -m pytest -q --basetemp="$tmp/t2" "${second[@]}" || rc=1
  if [ $triton = 1 ]; then
    echo "== the Triton kernels' tests, the interpreter's (Triton 3.6.0 from .cache/triton-site)"
    PYTHONPATH="$triton_path" TRITON_INTERPRET=1 python3 -m pytest -q -m "not gpu" --basetemp="$tmp/t2i" \
      tests/runtime/test_paged_attention.py tests/runtime/test_paged_switches.py tests/runtime/test_skinny_gemm.py \
      tests/runtime/test_full_sampling.py || rc=1
  fi
  exit $rc
) > "$tmp/stream2.log" 2>&1 &
pid2=$!

rc=0
echo "== stream 1: tests/ but ${second[*]} (stream 2 runs those beside it; its output follows)"
python3 -m pytest -q --basetemp="$tmp/t1" tests "${ignore[@]}" || rc=1
if [ $triton = 1 ]; then
  echo "== the Triton kernels' tests, the offline sm_90 builds (Triton 3.6.0 from .cache/triton-site)"
  PYTHONPATH="$triton_path" python3 -m pytest -q -m "not gpu" --basetemp="$tmp/t1b" \
    tests/runtime/test_triton_build.py tests/scripts/test_paged_build_report.py || rc=1
fi
rc2=0
wait "$pid2" || rc2=$?
pid2=
echo "== stream 2: ${second[*]}$([ $triton = 1 ] && echo ", then the Triton interpreter's tests")"
cat "$tmp/stream2.log"
if [ $rc != 0 ] || [ $rc2 != 0 ]; then
  echo "== scripts/test.sh: FAILED (stream 1: $([ $rc = 0 ] && echo ok || echo failed), stream 2: $([ $rc2 = 0 ] && echo ok || echo failed))"
  exit 1
fi
