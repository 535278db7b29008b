#!/usr/bin/env python3
"""Compile every device source for sm_90a (CI entry point). Exits non-zero on any nvcc error or warning.

    python scripts/compile_device.py [--force] [--cache-dir DIR] [--no-variants] [--jobs N]

Besides the default build (what a graph with no special needs launches: Llama), the megakernel is built once per
compile-time switch still in the tree (VARIANTS: the builds a GPU run A/Bs through MPK_NVCC_DEFINES, and the ones a
graph's needs make: -DMPK_ATT_QKNORM=1 is Qwen3's default build, the same cache entry as Megakernel's
nvcc.build(needs=...)), so a switch that no longer compiles fails CI, not a GPU session.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpk_runtime.codegen import nvcc  # noqa: E402

VARIANTS = ("-DMPK_ATT_WARP_PIPE=0", "-DMPK_ATT_STAGES=3", "-DMPK_AR_LL=1", "-DMPK_STAGE_WORDS=12",
            "-DMPK_ATT_PV_SPLIT=0", "-DMPK_ATT_DIAG_L2=1",
            "-DMPK_PDL=1", "-DMPK_ATT_QKNORM=1", "-DMPK_QKV_BIAS=1",   # (Qwen2's build: q / k / v biases)
            "-DMPK_STAGE_WORDS=12 -DMPK_ATT_QKNORM=1",   # qwen3's stage-stamp build (gpu_pending.sh stamps)
            "-DMPK_STAGE_WORDS=16", "-DMPK_STAGE_WORDS=16 -DMPK_ATT_QKNORM=1")   # + the merge's stamps 10-12 (STAMP_K=16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even on a cache hit")
    ap.add_argument("--cache-dir", help="override MPK_CACHE_DIR")
    ap.add_argument("--no-variants", action="store_true", help="only the default build of each source")
    ap.add_argument("--jobs", type=int, default=0, help="builds at once (default: the CPU count)")
    args = ap.parse_args()
    if args.cache_dir:
        os.environ["MPK_CACHE_DIR"] = args.cache_dir
    if nvcc.find_nvcc() is None:
        print(f"error: {nvcc.nvcc_missing_message()}", file=sys.stderr)
        return 2
    sources = sorted(p.name for p in nvcc.DEVICE_DIR.glob("*.cu"))
    builds = [(src, "") for src in sources] + \
        ([] if args.no_variants else [("megakernel.cu", v) for v in VARIANTS])
    jobs = max(1, min(args.jobs or (os.cpu_count() or 1), len(builds)))
    failed = 0
    # one process a build (each sets its own MPK_NVCC_DEFINES; the cache is safe under concurrent processes)
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
        user = os.environ.get("MPK_NVCC_DEFINES", "")
        for tag, lines, ok in pool.map(_build, builds, [user] * len(builds), [args.force] * len(builds)):
            print("\n".join(lines), file=sys.stdout if ok else sys.stderr, flush=True)
            failed += not ok
    return 1 if failed else 0


def _build(build: tuple[str, str], user: str, force: bool) -> tuple[str, list[str], bool]:
    """(tag, lines to print, ok) of one build: the device source with the variant's defines after the user's (a
    worker process runs several builds: each sets the whole variable)."""
    src, variant = build
    os.environ["MPK_NVCC_DEFINES"] = f"{user} {variant}".strip()
    tag = f"{src} [{variant}]" if variant else src
    try:
        r = nvcc.build(src, force=force)
    except nvcc.CompileError as e:
        return tag, [f"FAIL {tag}\n{e}"], False
    head = f"ok   {tag} -> {r.cubin} ({'cached' if r.cached else f'{r.seconds:.1f}s'})"
    # (a log without ptxas lines, e.g. a hit whose build.log is gone, printed an empty line for the build)
    return tag, [f"{head} {fn}: {res}" for fn, res in r.resources.items()] or [head], True


if __name__ == "__main__":
    sys.exit(main())
