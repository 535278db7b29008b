#!/usr/bin/env python3
"""The planner's step predictions against bench_decode's measured steps (out of sample: no bench row is a fit row).

    python3 scripts/score_bench.py bench/results/s22/run8_lean/bench/bench_decode.json [more files]
        [--repredict] [--profile NAME]

Rows of the planned system carry the prediction the bench made for the plan it ran (`predicted_ms`, under the
profile of that commit). --repredict prices the same plan again under --profile (default: the current default
profile) with the current simulator, so a refit profile can be checked on old measurements; rows of the one
megakernel (system "megakernel", batch <= 8) are then priced as the "mono" plan too. The bench times the one
megakernel as 8 steps a launch, so its rows carry one launch per 8 steps where the plan's price carries one per
step (~3 us a step, `launch` in bench/results/s22). Prints each row and the MAPE per file and overall.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rows_of(path: str) -> list[dict]:
    """The bench's measured ok rows of this runtime (planned, and the one megakernel)."""
    d = json.loads(Path(path).read_text())
    return [r for r in d.get("rows", []) if r.get("system") in ("planned", "megakernel") and r.get("ms")
            and r.get("status", "ok") == "ok"]


def score(rows: list[dict], predict=None) -> list[dict]:
    """Each row's measured and predicted ms and relative error; `predict(row) -> ms` re-prices (else the row's
    own predicted_ms; rows without one are left out)."""
    out = []
    for r in rows:
        pred = predict(r) if predict else r.get("predicted_ms")
        if pred is None:
            continue
        out.append({"model": r["model"], "batch": r["batch"], "context": r["context"],
                    "plan": r.get("plan") or "mono", "ms": r["ms"], "predicted_ms": pred,
                    "err": (pred - r["ms"]) / r["ms"]})
    return out


def repricer(profile: str | None):
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner import candidates
    from mpk_runtime.planner.profile import HardwareProfile
    prof = HardwareProfile.load(profile) if profile else HardwareProfile.load()

    def predict(r: dict) -> float | None:
        family = r.get("plan") or ("mono" if r["system"] == "megakernel" and r["batch"] <= 8 else None)
        if family is None or r["model"] not in PRESETS:
            return None
        plans = candidates(PRESETS[r["model"]], batch=r["batch"], context=r["context"], prof=prof,
                           families=(family,))
        return plans[0].predicted_us / 1e3 if plans else None
    return predict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="bench_decode.json files")
    ap.add_argument("--repredict", action="store_true", help="price each row's plan again under --profile")
    ap.add_argument("--profile", default=None, help="profile name or path (default: the default profile)")
    a = ap.parse_args()
    predict = repricer(a.profile) if a.repredict else None
    allerr = []
    for f in a.files:
        s = score(rows_of(f), predict)
        for r in s:
            print(f"{r['model']:14s} B={r['batch']:<4d} ctx={r['context']:<5d} {r['plan']:8s} measured "
                  f"{r['ms']:8.3f}  predicted {r['predicted_ms']:8.3f}  {100 * r['err']:+6.1f}%")
        if s:
            mape = sum(abs(r["err"]) for r in s) / len(s)
            print(f"{f}: {len(s)} rows, step MAPE {100 * mape:.1f}%")
        else:
            print(f"{f}: no row with a prediction")
        allerr += [abs(r["err"]) for r in s]
    if len(a.files) > 1 and allerr:
        print(f"all: {len(allerr)} rows, step MAPE {100 * sum(allerr) / len(allerr):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
