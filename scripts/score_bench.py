#!/usr/bin/env python3
"""The planner's step predictions against bench_decode's measured steps (out of sample: no bench row is a fit row).

    python3 scripts/score_bench.py bench/results/s22/run8_lean/bench/bench_decode.json [more files]
        [--repredict] [--profile NAME]

Rows of the planned system carry the prediction the bench made for the plan it ran (`predicted_ms`, under the
profile of that commit). --repredict prices the same plan again under --profile (default: $MPK_PLANNER_PROFILE, else
the current default profile of the card the file was measured on, from its meta.machine) with the current
simulator and the row's own attention splits, so a refit profile can be checked on old measurements; rows of the one
megakernel (system "megakernel", batch <= 8) are then priced as the plan of their build ("mono", "mono-w2" at
waves 2; an L2-prefetch build is left out). The bench times the one megakernel as 8 steps a launch, so its rows
carry one launch per 8 steps where the plan's price carries one per step (~3 us a step, `launch` in
bench/results/s22). Prints each row, the MAPE per file and overall, and how many measured rows had no prediction.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def profile_for(path: str, profile: str | None = None) -> str:
    """The profile --repredict prices a file's rows under: --profile, else $MPK_PLANNER_PROFILE, else the default
    profile of the card in the file's meta.machine (an H100's rows under the H100's profile, not this machine's),
    else this machine's default."""
    import os
    from mpk_runtime.planner.profile import default_profile_name, profile_for_card
    if profile or os.environ.get("MPK_PLANNER_PROFILE"):
        return profile or os.environ["MPK_PLANNER_PROFILE"]
    machine = json.loads(Path(path).read_text()).get("meta", {}).get("machine")
    return profile_for_card(machine) if machine else default_profile_name()


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
        family = r.get("plan") or (mono_family(r) if r["system"] == "megakernel" and r["batch"] <= 8 else None)
        if family is None or r["model"] not in PRESETS:
            return None
        plans = candidates(PRESETS[r["model"]], batch=r["batch"], context=r["context"], prof=prof,
                           families=(family,), splits=r.get("attn_splits"))   # the splits the row ran
        return plans[0].predicted_us / 1e3 if plans else None
    return predict


def mono_family(r: dict) -> str | None:
    """The plan family of a one-megakernel row as it ran: waves 1 "mono", 2 "mono-w2"; a build the planner does not
    price (an L2 prefetch, other waves) None (left out, not priced as another kernel)."""
    if r.get("l2_prefetch_mb"):
        return None
    return {1.0: "mono", 2.0: "mono-w2"}.get(float(r.get("waves", 1.0)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="bench_decode.json files")
    ap.add_argument("--repredict", action="store_true", help="price each row's plan again under --profile")
    ap.add_argument("--profile", default=None, help="profile name or path (default: the default profile)")
    a = ap.parse_args()
    predictors = {}
    allerr = []
    for f in a.files:
        predict = None
        if a.repredict:
            name = profile_for(f, a.profile)
            predict = predictors.get(name) or predictors.setdefault(name, repricer(name))
            print(f"{f}: priced under profile {name}")
        rows = rows_of(f)
        s = score(rows, predict)
        for r in s:
            print(f"{r['model']:14s} B={r['batch']:<4d} ctx={r['context']:<5d} {r['plan']:8s} measured "
                  f"{r['ms']:8.3f}  predicted {r['predicted_ms']:8.3f}  {100 * r['err']:+6.1f}%")
        if s:
            mape = sum(abs(r["err"]) for r in s) / len(s)
            left = f" ({len(rows) - len(s)} measured rows without a prediction left out)" if len(rows) > len(s) else ""
            print(f"{f}: {len(s)} rows, step MAPE {100 * mape:.1f}%{left}")
        else:
            print(f"{f}: no row with a prediction")
        allerr += [abs(r["err"]) for r in s]
    if len(a.files) > 1 and allerr:
        print(f"all: {len(allerr)} rows, step MAPE {100 * sum(allerr) / len(allerr):.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
