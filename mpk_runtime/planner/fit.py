"""Refit the profile's calibration terms per batch regime from validation measurements, and score predictions.

    python -m mpk_runtime.planner.fit --rows $OUT/planner_validation_rows.jsonl [--profile h200_measured]
        [--out DIR] [--holdout]

Input: scripts/validate_planner.py rows; each measured segment carries the features of its price
(cost.conventional_features / {"sim_us"} of a megakernel segment). Per regime (batch 1..7 -> "1", batch >= 8 ->
"8": the batch-1 kernels and the 8-row-group kernels are different code paths) it fits:
  megakernel    measured - launch = mk_scale * simulated + mk_offset_us        (weighted least squares)
  conventional  measured = conv_fixed_scale * fixed + sum_ops max(stream / conv_bw_fraction, tc / conv_tc_eff)
                           + conv_attn_kv_passes * attn_kv                       (grid over the two efficiencies,
                                                                                  non-negative LS for the rest)
with relative-error weights (each segment counts by its relative error, as MAPE does). The result is the
input profile plus `regimes` overrides (profile.for_batch applies them), so candidates() predicts with it.
--holdout: points (model, tp, batch) sorted by (tp, batch, model) alternate into halves A and B; fit on A, score
A and B, and the reverse; reports both. Scoring re-prices measured segments from their features
(`cost.price_from_features`, the same arithmetic candidates() uses), so no simulation is rerun.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from .cost import price_from_features
from .profile import HardwareProfile

REGIMES = ((1, "1"), (8, "8"))   # (min batch, key)
CONV_FIELDS = ("conv_fixed_scale", "conv_bw_fraction", "conv_tc_eff", "conv_attn_kv_passes")


def regime_of(batch: int) -> str:
    return [k for b, k in REGIMES if batch >= b][-1]


# ------------------------------------------------------------------------------------------------ metrics
def spearman(a: list[float], b: list[float]) -> float:
    def ranks(x):
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        i = 0
        while i < len(order):   # ties share their mean rank
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    n = len(a)
    if n < 2:
        return 1.0
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / n, sum(rb) / n
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else 1.0


TARGETS = {"segment_mape": 0.10, "spearman": 0.9, "regret": 0.05, "chosen_vs_best_of_mono_conv": 0.05}


def summarize(rows: list[dict], hf: dict | None = None) -> dict:
    """Segment / step MAPE, and per point (model, tp, batch): Spearman, regret, chosen vs best of {mono,
    conventional}, chosen vs the HF peer (hf: {(model, batch): ms}). The chosen plan is the candidate with the
    lowest prediction among all candidates (row["chosen"]); skipped/errored rows are listed, not scored."""
    hf = hf or {}
    ok = [r for r in rows if "measured_us" in r]
    seg_err = [abs(s["predicted_us"] - s["measured_us"]) / s["measured_us"] for r in ok for s in r["segments"]
               if s["measured_us"] > 0]
    groups: dict = {}
    for r in ok:
        groups.setdefault((r["model"], r.get("tp", 1), r["batch"]), []).append(r)
    pts = []
    for (m, tp, b), rs in sorted(groups.items()):
        best = min(rs, key=lambda x: x["measured_us"])
        chosen = next((x for x in rs if x["chosen"]), None)
        conv = next((x["measured_us"] for x in rs if x["plan"] == "conventional"), None)
        mono = next((x["measured_us"] for x in rs if x["plan"] == "mono"), None)
        ref = min([v for v in (conv, mono) if v] or [0]) or None
        h = hf.get((m, b))
        pts.append({"model": m, "tp": tp, "batch": b, "plans": len(rs),
                    "spearman": round(spearman([x["predicted_us"] for x in rs], [x["measured_us"] for x in rs]), 3),
                    "chosen": chosen["plan"] if chosen else None, "best_measured": best["plan"],
                    "chosen_us": chosen["measured_us"] if chosen else None, "best_us": best["measured_us"],
                    "regret": round(chosen["measured_us"] / best["measured_us"] - 1, 4) if chosen else None,
                    "chosen_vs_best_of_mono_conv": round(chosen["measured_us"] / ref - 1, 4) if chosen and ref else None,
                    "hf_us": 1e3 * h if h else None,
                    "chosen_vs_hf": round(chosen["measured_us"] / (1e3 * h) - 1, 4) if chosen and h else None,
                    "faster_than_hf": (chosen["measured_us"] < 1e3 * h) if chosen and h else None})
    s = {"segment_mape": sum(seg_err) / len(seg_err) if seg_err else None,
         "step_mape": sum(abs(r["predicted_us"] - r["measured_us"]) / r["measured_us"] for r in ok) / len(ok)
         if ok else None,
         "points": pts,
         "skipped": [{k: r.get(k) for k in ("model", "tp", "batch", "plan", "skipped")} for r in rows if "skipped" in r],
         "errors": [{k: r.get(k) for k in ("model", "tp", "batch", "plan", "error")} for r in rows if "error" in r]}
    chk = {"segment_mape": s["segment_mape"] is not None and s["segment_mape"] <= TARGETS["segment_mape"],
           "spearman": bool(pts) and all(p["spearman"] >= TARGETS["spearman"] for p in pts if p["plans"] > 2),
           "regret": bool(pts) and all(p["regret"] is not None and p["regret"] <= TARGETS["regret"] for p in pts),
           "chosen_vs_best_of_mono_conv": bool(pts) and all(
               p["chosen_vs_best_of_mono_conv"] is not None and p["chosen_vs_best_of_mono_conv"] <= 0.05 for p in pts),
           "faster_than_hf_everywhere": bool(pts) and all(p["faster_than_hf"] for p in pts)}
    s["targets"] = chk
    s["targets_met"] = all(chk.values())
    return s


# ----------------------------------------------------------------------------------------------- fitting
def _segments(rows, regime=None):
    for r in rows:
        if "measured_us" not in r:
            continue
        if regime is not None and regime_of(r["batch"]) != regime:
            continue
        for s in r["segments"]:
            if s.get("features") and s["measured_us"] > 0:
                yield r, s


def _wls(cols: list[list[float]], y: list[float], w: list[float], nonneg: bool = True) -> list[float]:
    """min sum w (y - X b)^2 (b >= 0 if nonneg) for 1-2 columns, closed form + active set."""
    import numpy as np
    X = np.array(cols, dtype=float).T
    Y, W = np.array(y, dtype=float), np.sqrt(np.array(w, dtype=float))
    Xw, Yw = X * W[:, None], Y * W
    b = np.linalg.lstsq(Xw, Yw, rcond=None)[0]
    if nonneg and (b < 0).any():
        best = None
        for keep in range(X.shape[1]):   # one column at a time (the others 0)
            bk = np.zeros(X.shape[1])
            den = float(Xw[:, keep] @ Xw[:, keep])
            bk[keep] = max(0.0, float(Xw[:, keep] @ Yw) / den) if den else 0.0
            err = float(((Yw - Xw @ bk) ** 2).sum())
            if best is None or err < best[0]:
                best = (err, bk)
        b = best[1]
    return [float(v) for v in b]


def fit_megakernel(segs: list[dict], launch_us: float) -> dict:
    sims = [s["features"]["sim_us"] for s in segs]
    y = [s["measured_us"] - launch_us for s in segs]
    w = [1.0 / s["measured_us"] ** 2 for s in segs]
    if len({round(v, 3) for v in sims}) < 2:    # one size: scale only
        sc = _wls([sims], y, w)[0]
        return {"mk_scale": sc, "mk_offset_us": 0.0}
    sc, off = _wls([sims, [1.0] * len(sims)], y, w, nonneg=False)
    if sc <= 0:
        sc, off = _wls([sims], y, w)[0], 0.0
    return {"mk_scale": sc, "mk_offset_us": off}


def fit_conventional(segs: list[dict]) -> dict:
    best = None
    w = [1.0 / s["measured_us"] ** 2 for s in segs]
    has_kv = any(s["features"]["attn_kv_us"] > 0 for s in segs)
    # descending, strict improvement: where a term never binds (Tensor Cores at batch 1), keep the prior (1.0)
    for frac in [1.0 - 0.05 * i for i in range(15)]:
        for eff in [1.0 - 0.1 * i for i in range(10)]:
            st = [sum(c * max(a / frac, t / eff) for a, t, c in s["features"]["st"]) for s in segs]
            y = [s["measured_us"] - v for s, v in zip(segs, st)]
            cols = [[s["features"]["fixed_us"] for s in segs]]
            if has_kv:
                cols.append([s["features"]["attn_kv_us"] for s in segs])
            b = _wls(cols, y, w)
            pred = [v + sum(bi * ci for bi, ci in zip(b, col)) for v, col in zip(st, zip(*cols))]
            err = sum(((p - s["measured_us"]) / s["measured_us"]) ** 2 for p, s in zip(pred, segs))
            if best is None or err < best[0] * (1 - 1e-9) - 1e-15:
                best = (err, frac, eff, b)
    _, frac, eff, b = best
    return {"conv_fixed_scale": b[0], "conv_bw_fraction": round(frac, 4), "conv_tc_eff": round(eff, 4),
            "conv_attn_kv_passes": b[1] if has_kv else 1.0}


def fit_profile(rows: list[dict], base: HardwareProfile, min_segments: int = 2) -> tuple[HardwareProfile, dict]:
    """The base profile with per-regime calibration fitted on `rows`; and a report (counts per regime)."""
    regimes = {k: dict(v) for k, v in base.regimes.items()}
    report = {}
    for _, key in REGIMES:
        segs = list(_segments(rows, key))
        mk = [s for _, s in segs if s["features"]["kind"] == "megakernel"]
        cv = [s for _, s in segs if s["features"]["kind"] == "conventional"]
        over = regimes.setdefault(key, {})
        if len(mk) >= min_segments:
            over.update(fit_megakernel(mk, base.megakernel_launch_us))
        if len(cv) >= min_segments:
            over.update(fit_conventional(cv))
        report[key] = {"megakernel_segments": len(mk), "conventional_segments": len(cv),
                       **{k: over[k] for k in over if k in ("mk_scale", "mk_offset_us") + CONV_FIELDS}}
        if not over:
            regimes.pop(key)
    prof = replace(base, regimes=regimes, source=(base.source + "; regimes refit by planner/fit.py").strip("; "))
    return prof, report


def reprice(rows: list[dict], prof: HardwareProfile) -> list[dict]:
    """Rows with predicted_us (segments and step) recomputed from the features under `prof`; `chosen` becomes
    the lowest re-priced plan among the measured ones of each point."""
    out = []
    for r in rows:
        if "measured_us" not in r or not all(s.get("features") for s in r["segments"]):
            continue
        p = prof.for_batch(r["batch"])
        segs = [dict(s, predicted_us=price_from_features(s["features"], p)) for s in r["segments"]]
        step = sum(s["predicted_us"] for s in segs) + p.graph_kernel_gap_us * max(0, len(segs) - 1)
        out.append(dict(r, segments=segs, predicted_us=step))
    best: dict = {}
    for r in out:
        k = (r["model"], r.get("tp", 1), r["batch"])
        if k not in best or r["predicted_us"] < best[k]["predicted_us"]:
            best[k] = r
    for r in out:
        r["chosen"] = best[(r["model"], r.get("tp", 1), r["batch"])] is r
    return out


def split_points(rows: list[dict]) -> tuple[set, set]:
    pts = sorted({(r.get("tp", 1), r["batch"], r["model"]) for r in rows if "measured_us" in r})
    return set(pts[0::2]), set(pts[1::2])


def _sel(rows, pts):
    return [r for r in rows if (r.get("tp", 1), r["batch"], r["model"]) in pts]


def _brief(s: dict) -> dict:
    return {"segment_mape": s["segment_mape"], "step_mape": s["step_mape"],
            "min_spearman": min((p["spearman"] for p in s["points"] if p["plans"] > 2), default=None),
            "max_regret": max((p["regret"] for p in s["points"] if p["regret"] is not None), default=None),
            "points": [{k: p[k] for k in ("model", "tp", "batch", "plans", "spearman", "chosen", "best_measured",
                                          "regret")} for p in s["points"]]}


def holdout(rows: list[dict], base: HardwareProfile) -> dict:
    a, b = split_points(rows)
    res = {"half_a": sorted(map(list, a)), "half_b": sorted(map(list, b)),
           "base_profile": _brief(summarize(reprice(rows, base)))}
    for name, tr, te in (("fit_a_test_b", a, b), ("fit_b_test_a", b, a)):
        prof, rep = fit_profile(_sel(rows, tr), base)
        res[name] = {"fit": rep, "train": _brief(summarize(reprice(_sel(rows, tr), prof))),
                     "test": _brief(summarize(reprice(_sel(rows, te), prof)))}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", required=True, help="validation rows JSONL (or planner_validation.json), comma-separated")
    ap.add_argument("--profile", default="h200_measured")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--name", default="h200_fitted")
    ap.add_argument("--holdout", action="store_true")
    a = ap.parse_args()
    rows = []
    for p in a.rows.split(","):
        if p.endswith(".json"):
            rows += json.load(open(p))["rows"]
        else:
            rows += [json.loads(x) for x in open(p) if x.strip()]
    base = HardwareProfile.load(a.profile)
    prof, rep = fit_profile(rows, base)
    prof = replace(prof, name=a.name)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        f.write(prof.to_json())
    report = {"fit_all": rep, "all_base": _brief(summarize(reprice(rows, base))),
              "all_fitted_in_sample": _brief(summarize(reprice(rows, prof)))}
    if a.holdout:
        report["holdout"] = holdout(rows, base)
    with open(os.path.join(a.out, "fit_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "holdout"}, indent=1)[:4000])
    if a.holdout:
        for k in ("fit_a_test_b", "fit_b_test_a"):
            h = report["holdout"][k]
            print(k, "train", {x: h["train"][x] for x in ("segment_mape", "min_spearman", "max_regret")},
                  "test", {x: h["test"][x] for x in ("segment_mape", "min_spearman", "max_regret")})
    print(f"wrote {os.path.join(a.out, a.name + '.json')} and fit_report.json")


if __name__ == "__main__":
    main()
