#!/usr/bin/env python3
"""Compile every device source for sm_90a (CI entry point). Exits non-zero on any nvcc error or warning.

    python scripts/compile_device.py [--force] [--cache-dir DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpk_runtime.codegen import nvcc  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild even on a cache hit")
    ap.add_argument("--cache-dir", help="override MPK_CACHE_DIR")
    args = ap.parse_args()
    if args.cache_dir:
        os.environ["MPK_CACHE_DIR"] = args.cache_dir
    if nvcc.find_nvcc() is None:
        print("error: nvcc not found on PATH (CUDA 13.0 toolkit needed to build sm_90a)", file=sys.stderr)
        return 2
    sources = sorted(p.name for p in nvcc.DEVICE_DIR.glob("*.cu"))
    failed = 0
    for src in sources:
        try:
            r = nvcc.build(src, force=args.force)
        except nvcc.CompileError as e:
            print(f"FAIL {src}\n{e}", file=sys.stderr)
            failed += 1
            continue
        for fn, res in r.resources.items():
            print(f"ok   {src} -> {r.cubin} ({'cached' if r.cached else f'{r.seconds:.1f}s'}) {fn}: {res}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
