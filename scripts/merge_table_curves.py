"""A planner profile whose paged-attention curves follow MPK_PAGED_TABLE=auto: each point's time from the run that
read the page tables in the type the launch shape names there (paged_attention.table_dtype_for at the key cap a step
at that context runs), out of two scripts/profile_conv_attn.py runs, one with int64 tables and one with int32.

    PYTHONPATH=. python3 scripts/merge_table_curves.py --i64 <conv_attn.json> --i32 <conv_attn.json> \\
        --base h200_v47 --name h200_v48 [--source "..."] > mpk_runtime/planner/profiles/h200_v48.json

Nothing is fitted: the base profile with its "@paged" curves replaced point by point. Session 43 wrote h200_v48 so
(bench/results/s43/cattn: int64, cattn32: int32; docs/planner.md session 43). The launch shape of each point
(conv_attn_shape_by_shape) is the one its run recorded, else config_for's at this checkout with the run's table type
(runs before session 44 record none: run the merge at the commit the curves ran at).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _plan_measure import key_cap  # noqa: E402
from mpk_runtime.planner.profile import HardwareProfile  # noqa: E402
from mpk_runtime.runtime import paged_attention as pa  # noqa: E402

MAX_POS = 131072   # both models' max_position_embeddings: the caps here are the engine's power of two above the keys


class _Cfg:
    max_position_embeddings = MAX_POS


def merged_curves(i64: dict, i32: dict) -> tuple[dict, dict, dict]:
    """{shape: [[B, keys, us], ...]} from the run whose table type table_dtype_for names at each point (shapes
    "<nkv>x<D>x<g>@paged"), {shape: {"i32": n, "i64": n}} how many points each run gave, and {shape: {(B, keys):
    "i32" | "i64"}} which run each point came from."""
    out, picks, srcs = {}, {}, {}
    for shape in sorted(set(i64) | set(i32)):
        shp = pa.parse_curve_key(shape)
        if shp is None:   # not the paged kernel's curve
            continue
        nkv, D, _ = shp
        a = {(b, k): us for b, k, us in i64.get(shape, [])}
        b = {(bb, k): us for bb, k, us in i32.get(shape, [])}
        pts, n, srcs[shape] = [], {"i32": 0, "i64": 0}, {}
        for B, keys in sorted(set(a) | set(b)):
            t = "i32" if pa.table_dtype_for(D, B, nkv, key_cap(keys - 1, _Cfg)) == pa.torch.int32 else "i64"
            src = b if t == "i32" else a
            if (B, keys) not in src:   # measured only under the other type: that, and say so in the counts
                t, src = ("i64", a) if t == "i32" else ("i32", b)
            pts.append([B, keys, src[(B, keys)]])
            n[t] += 1
            srcs[shape][(B, keys)] = t
        out[shape], picks[shape] = pts, n
    return out, picks, srcs


def point_shapes(curves: dict, srcs: dict, r64: dict, r32: dict) -> dict:
    """{shape: [[B, keys, launch shape label], ...]} for the merged curves: the label the run each point came from
    (srcs, merged_curves') recorded in its conv_attn_shape_by_shape, else config_for's label at this checkout with
    that run's table type."""
    now = pa.curve_shapes(curves, lambda k: key_cap(k - 1, _Cfg))
    rec = {t: r.get("conv_attn_shape_by_shape", {}) for t, r in (("i64", r64), ("i32", r32))}
    out = {}
    for shape, pts in curves.items():
        labels = {t: {(b, k): lbl for b, k, lbl in rec[t].get(shape, [])} for t in rec}
        rows = []
        for (B, keys, _), (_, _, cur) in zip(pts, now[shape]):
            t = srcs[shape][(B, keys)]
            rows.append([B, keys, labels[t].get((B, keys)) or cur.rsplit(",", 1)[0] + "," + t])
        out[shape] = rows
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--i64", required=True, help="profile_conv_attn.py's conv_attn.json with MPK_PAGED_TABLE=i64")
    ap.add_argument("--i32", required=True, help="the same with MPK_PAGED_TABLE=i32")
    ap.add_argument("--base", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--source", default="")
    a = ap.parse_args(argv)
    if os.environ.get("MPK_PAGED_TABLE", "auto") != "auto" or os.environ.get("MPK_PAGED_SHAPE"):
        raise SystemExit("merge_table_curves.py follows the launch shapes' own table types: unset MPK_PAGED_TABLE "
                         "and MPK_PAGED_SHAPE")
    r64, r32 = (json.load(open(p)) for p in (a.i64, a.i32))
    curves, picks, srcs = merged_curves(r64["conv_attn_us_by_shape"], r32["conv_attn_us_by_shape"])
    steps, _, _ = merged_curves(r64.get("conv_attn_step_us_by_shape", {}), r32.get("conv_attn_step_us_by_shape", {}))
    prof = json.loads(HardwareProfile.load(a.base).to_json())
    prof["name"] = a.name
    prof["conv_attn_us_by_shape"] = {**prof.get("conv_attn_us_by_shape", {}), **curves}
    prof["conv_attn_step_us_by_shape"] = {**prof.get("conv_attn_step_us_by_shape", {}), **steps}
    prof["conv_attn_shape_by_shape"] = {**prof.get("conv_attn_shape_by_shape", {}),
                                        **point_shapes(curves, srcs, r64, r32)}
    m64, m32 = r64.get("meta", {}), r32.get("meta", {})
    prof["source"] = (f"{a.name}: {a.base} with the paged attention's curves taken point by point from two "
                      f"scripts/profile_conv_attn.py runs, int64 tables ({m64.get('date')}, {str(m64.get('commit'))[:7]}) "
                      f"and int32 ({m32.get('date')}, {str(m32.get('commit'))[:7]}), each point from the type its "
                      f"launch shape reads (MPK_PAGED_TABLE=auto; points per run {json.dumps(picks)}); nothing fitted. "
                      f"{a.source} Before: {prof.get('source', '')}")
    json.dump(prof, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
