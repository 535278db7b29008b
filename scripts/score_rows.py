"""Score measured validation rows under one or more planner profiles, fitting nothing (out-of-sample numbers).

    PYTHONPATH=. python3 scripts/score_rows.py --rows <planner_validation_rows.jsonl,...> h200_v44 h200_v45 [path.json]

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
from mpk_runtime.planner.score import _brief, load_rows, mape_by, reprice, resimulate, summarize, valid_rows  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", required=True, help="validation rows JSONL, comma-separated")
    ap.add_argument("profiles", nargs="+", help="profile names (mpk_runtime/planner/profiles) or JSON paths")
    ap.add_argument("--procs", type=int, default=0, help="processes for re-simulation (default: all cores)")
    a = ap.parse_args(argv)
    missing = [p.split("@")[0] for p in a.rows.split(",") if not os.path.exists(p.split("@")[0])]
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
        print(f"== {name}: {len(rr)} of {len(rows)} rows re-planned; step MAPE {s['step_mape']:.4f}, segment MAPE "
              f"{s['segment_mape']:.4f}, resolved pairs ordered {s['resolved_pairs_ordered']:.3f}, "
              f"min Spearman {s['min_spearman']}, max regret {s['max_regret']}")
        for p in s["points"]:
            print(f"   {p['model']:13s} tp={p['tp']} B={p['batch']:4d} ctx={p['context']:5d} spearman={p['spearman']:.3f}"
                  f" chosen={p['chosen']} best={p['best_measured']} regret={p['regret']:.4f}")
        print("   segment MAPE by kind and batch:", mape_by(rr, prof))


if __name__ == "__main__":
    main()
