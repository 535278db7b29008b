"""What the paged attention's launch looks like at the models' points, read from offline sm_90 builds (no GPU): for
each point and each MPK_PAGED_HEADS mode, the launch shape a call takes (runtime/paged_attention.config_for and
launch_shape), the partial kernel's registers and shared memory, the CTAs an SM holds, the programs and the waves
they make on 132 SMs, the key blocks a program walks, and the contiguous bytes a slot's read is made of.

    PYTHONPATH=. python3 scripts/paged_build_report.py [--models llama-3.2-1b,qwen3-8b] [--batches 8,32,128]
        [--keys 2049,4097] [--heads one,group,all] [--tp 1] [--tables auto,i32,i64] [--out report.json]

Needs Triton (pip install triton; it builds without a GPU). Why (docs/perf-notes.md session 40): the kernel reads K / V
at 58-76% of HBM's rate at head dim 64 and 74-92% at 128; the report puts each candidate's launch side by side before
GPU time is spent on it. It predicts nothing by itself: the A/B is scripts/gpu_pending.sh mode sw.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpk_runtime.models import load_config  # noqa: E402
from mpk_runtime.runtime import paged_attention as pa  # noqa: E402
from mpk_runtime.runtime.triton_offline import build_offline, partial_sig, step_partial_constexprs  # noqa: E402

NUM_SMS = 132


def point(model: str, B: int, keys: int, heads: str, builds: dict, tp: int = 1, table: str = "auto") -> dict:
    """One row of the report: the launch of model's attention at B rows of `keys` keys under MPK_PAGED_HEADS=heads
    (the deferred appends through the cache, split rows: the defaults), one rank of `tp` (its share of the heads),
    page tables of `table` ("auto": the launch shape's, as the step reads them). builds caches the offline builds."""
    cfg = load_config(model)
    nq, nkv, D = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim
    c = pa.config_for(D, B, nkv, keys)
    if table != "auto":
        c = dataclasses.replace(c, table=table)
    HG, GP, BN, S = pa.launch_shape(B, nq, nkv, keys, c, heads=heads)
    const = step_partial_constexprs(D, B, nq, nkv, keys, c, heads)
    key = (tuple(sorted(const.items())), c.num_warps, c.num_stages, c.table)
    if key not in builds:   # the page tables' type is the shape's (PagedAttnConfig.table), as the step runs it
        builds[key] = build_offline(pa._partial_kernel, partial_sig(c.table), const, c.num_warps, c.num_stages)
    b = builds[key]
    ctas = b.ctas_per_sm()
    programs = B * (nkv // HG) * S
    return dict(model=model, tp=tp, B=B, keys=keys, heads=heads, table=c.table or "i32", heads_a_program=HG, q_rows=GP,
                keys_a_step=BN,
                tile_rows=BN * HG, warps=c.num_warps, stages=c.num_stages, splits=S, regs=b.regs, smem=b.smem,
                spills=b.stack, ctas_per_sm=ctas, programs=programs,
                waves=round(programs / (NUM_SMS * ctas), 2), steps_a_program=math.ceil(math.ceil(keys / S) / BN),
                contiguous_bytes=HG * D * 2, kv_mb=round(2 * B * keys * nkv * D * 2 / 1e6, 1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--keys", default="2049,4097")
    ap.add_argument("--heads", default=",".join(pa.HEADS))
    ap.add_argument("--tp", type=int, default=1, help="one rank of a tensor-parallel group: its share of the heads")
    ap.add_argument("--tables", default="auto",
                    help="page-table types to build, comma-separated: auto (each shape's own, as the step), i32, i64")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    tables = a.tables.split(",")
    if any(t not in ("auto",) + pa.TABLES for t in tables):
        raise SystemExit(f"paged_build_report.py: --tables {a.tables}: each one of auto, {', '.join(pa.TABLES)}")
    bad = [h for h in a.heads.split(",") if h not in pa.HEADS]
    if bad:
        raise SystemExit(f"paged_build_report.py: unknown --heads {','.join(bad)} (one of {', '.join(pa.HEADS)})")
    if pa.triton is None:
        raise SystemExit("paged_build_report.py needs Triton (pip install triton): it builds for sm_90 without a GPU")
    builds: dict = {}
    rows = [point(model, B, keys, heads, builds, a.tp, t) for model in a.models.split(",")
            for B in map(int, a.batches.split(",")) for keys in map(int, a.keys.split(","))
            for heads in a.heads.split(",") for t in tables]
    cols = ("model", "tp", "B", "keys", "heads", "table", "heads_a_program", "tile_rows", "warps", "stages", "splits",
            "regs", "smem", "ctas_per_sm", "programs", "waves", "steps_a_program", "contiguous_bytes")
    print(" ".join(f"{c:>12}" if c != "model" else f"{c:<13}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>12}" if c != "model" else f"{r[c]:<13}" for c in cols))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(num_sms=NUM_SMS, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
