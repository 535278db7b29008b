"""Score measured validation rows under one or more planner profiles, fitting nothing (out-of-sample numbers).

    PYTHONPATH=. python3 scripts/score_rows.py --rows <planner_validation_rows.jsonl,...> h200_v44 h200_v45 [path.json]
        [--gaps]

Each profile re-simulates every measured plan with the current simulator (planner.score.resimulate), re-prices the
segments and steps, and prints step / segment MAPE, ordered plan pairs, per point Spearman, the chosen (lowest
priced) plan against the best measured, and the segment MAPE by kind and batch. Session 39's h200_v44 -> h200_v45
comparison on its 70 rows is this script's output (docs/planner.md session 39).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpk_runtime.planner.profile import HardwareProfile  # noqa: E402
from mpk_runtime.planner.score import _brief, load_rows, mape_by, reprice, resimulate, stored_path, summarize, valid_rows  # noqa: E402


def composition_gaps(rows: list[dict]) -> list[dict]:
    """Per point with all three plans measured: the conventional step against its parts measured in other plans
    (attn-mk's conventional segments + attn-conv's conventional, i.e. attention, segments). Parts measured alone pay
    their launch and drain, which a step overlaps, so a positive gap is cost that exists only in the whole step
    (docs/planner.md session 39)."""
    from mpk_runtime.models import load_config
    pts: dict = {}
    for r in rows:
        pts.setdefault((r["model"], r.get("tp", 1), r["batch"], r.get("context", 512)), {})[r["plan"]] = r
    out = []
    for (m, tp, b, ctx), d in sorted(pts.items()):
        if not all(p in d for p in ("conventional", "attn-mk", "attn-conv")):
            continue
        conv = lambda r: sum(s["measured_us"] for s in r["segments"] if s["kind"] != "megakernel")  # noqa: E731
        step, parts = d["conventional"]["measured_us"], conv(d["attn-mk"]) + conv(d["attn-conv"])
        layers = load_config(m).num_layers
        out.append(dict(model=m, tp=tp, batch=b, context=ctx, step_us=step, parts_us=parts, gap_us=step - parts,
                        gap_per_layer_us=(step - parts) / layers, gap_frac=(step - parts) / step))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", required=True, help="validation rows JSONL, comma-separated")
    ap.add_argument("profiles", nargs="+", help="profile names (mpk_runtime/planner/profiles) or JSON paths")
    ap.add_argument("--procs", type=int, default=0, help="processes for re-simulation (default: all cores)")
    ap.add_argument("--gaps", action="store_true", help="also the composition gaps: each conventional step against "
                    "its parts measured in the attn-mk and attn-conv plans")
    a = ap.parse_args(argv)
    missing = [p.split("@")[0] for p in a.rows.split(",") if not os.path.exists(stored_path(p.split("@")[0]))]
    if missing:
        raise SystemExit(f"score_rows: no such rows file: {', '.join(missing)} (planner_validation_rows.jsonl[.gz] "
                         "written by scripts/validate_planner.py)")
    rows = valid_rows(load_rows(a.rows))
    if not rows:
        raise SystemExit(f"score_rows: no measured rows in {a.rows}")
    for name in a.profiles:
        prof = HardwareProfile.load(name)
        rr = resimulate(rows, prof, procs=a.procs or None)
        s = _brief(summarize(reprice(rr, prof)))
        f4 = lambda v, n=4: "n/a" if v is None else f"{v:.{n}f}"   # None: no point with two plans to order
        print(f"== {name}: {len(rr)} of {len(rows)} rows re-planned; step MAPE {f4(s['step_mape'])}, segment MAPE "
              f"{f4(s['segment_mape'])}, resolved pairs ordered {f4(s['resolved_pairs_ordered'], 3)}, "
              f"min Spearman {s['min_spearman']}, max regret {s['max_regret']}")
        for p in s["points"]:
            print(f"   {p['model']:13s} tp={p['tp']} B={p['batch']:4d} ctx={p['context']:5d} spearman={f4(p['spearman'], 3)}"
                  f" chosen={p['chosen']} best={p['best_measured']} regret={p['regret']:.4f}")
        print("   segment MAPE by kind and batch:", mape_by(rr, prof))
    if a.gaps:
        print("composition gaps (conventional step - attn-mk's conventional segments - attn-conv's attention segments):")
        for g in composition_gaps(rows):
            print(f"   {g['model']:13s} tp={g['tp']} B={g['batch']:4d} ctx={g['context']:5d} step {g['step_us']:8.0f} "
                  f"parts {g['parts_us']:8.0f} gap {g['gap_us']:+7.0f} us ({g['gap_per_layer_us']:+.1f} a layer, "
                  f"{100 * g['gap_frac']:+.1f}%)")


if __name__ == "__main__":
    main()
