"""The command line of planner/fit.py (`python -m mpk_runtime.planner.fit ...`, whose docstring has the usage): rows
in, the simulator terms of --grid chosen by re-simulation, the calibration fitted (fit.fit_profile), --holdout
scored both ways, --test scored out of sample, the profile and fit_report.json written."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

from .cost import price_from_features
from .band import bands_of, with_bands
from .fit import PREFIXES, REGIMES, SIM_FIELDS, fit_profile, regime_of, scoped_terms, \
    with_terms
from .fit import __doc__ as FIT_DOC
from .profile import HardwareProfile
from .score import _brief, _sel, load_rows, mape_by, reprice, resimulate, split_points, summarize, valid, valid_rows
from .score import features as seg_features


def _mk_err(rows: list[dict], prof: HardwareProfile) -> float:
    """Sum of squared relative errors of the megakernel segments of `rows` under `prof`."""
    e = 0.0
    for r in rows:
        if not valid(r):
            continue
        p = prof.for_batch(r["batch"])
        for s in r["segments"]:
            if s.get("features", {}).get("kind") == "megakernel" and s["measured_us"] > 0:
                e += ((price_from_features(seg_features(s), p) - s["measured_us"]) / s["measured_us"]) ** 2
    return e


def fit_with_sim_grid(sims: dict, base: HardwareProfile, pts=None, **kw) -> tuple[HardwareProfile, dict, tuple]:
    """sims: {combo (tuple of (field, value)): rows re-simulated under base + combo}. For every combo, fit the
    calibration (fit_profile) on the rows of points `pts` (all if None); keep the combo with the least
    megakernel error on those rows. Returns (profile, report, combo)."""
    best = None
    for combo, rows in sims.items():
        tr = rows if pts is None else _sel(rows, pts)
        prof, rep = fit_profile(tr, with_terms(base, combo), **kw)
        err = _mk_err(tr, prof)
        if best is None or err < best[0]:
            best = (err, prof, rep, combo)
    _, prof, rep, combo = best
    rep = dict(rep, sim_terms=dict(combo))
    return prof, rep, combo


def holdout(rows: list[dict], base: HardwareProfile, sims: dict | None = None, **kw) -> dict:
    """Fit on one half of the points, score the other, both ways. With `sims` (fit_with_sim_grid) the
    simulator terms are chosen on the training half too; the test half is scored on its rows simulated with
    the chosen terms."""
    a, b = split_points(rows)
    res = {"half_a": sorted(map(list, a)), "half_b": sorted(map(list, b)),
           "base_profile": _brief(summarize(reprice(rows, base))), "base_mape": mape_by(rows, base)}
    for name, tr, te in (("fit_a_test_b", a, b), ("fit_b_test_a", b, a)):
        if sims:
            prof, rep, combo = fit_with_sim_grid(sims, base, tr, **kw)
            rs = sims[combo]
        else:
            prof, rep = fit_profile(_sel(rows, tr), base, **kw)
            rs = rows
        res[name] = {"fit": rep, "train": _brief(summarize(reprice(_sel(rs, tr), prof))),
                     "test": _brief(summarize(reprice(_sel(rs, te), prof))),
                     "train_mape": mape_by(_sel(rs, tr), prof), "test_mape": mape_by(_sel(rs, te), prof)}
    return res


def by_context(rows: list[dict], base: HardwareProfile, **kw) -> dict:
    """Leave one context out: for each context among the rows, fit on the rows of every other context and score
    that context's points (fit_profile's terms and regimes, no simulator grid). Says how a set of terms carries to a
    context it never saw, where --test scores one split; "pooled" sums the held-out folds."""
    ctxs = sorted({r.get("context", 512) for r in rows})
    folds, held = {}, []
    for c in ctxs:
        train = [r for r in rows if r.get("context", 512) != c]
        test = [r for r in rows if r.get("context", 512) == c]
        if not train or not test:
            continue
        prof, _ = fit_profile(train, base, **kw)
        priced = reprice(test, prof)
        folds[c] = _brief(summarize(priced))
        held += priced
    pooled = _brief(summarize(held)) if held else {}
    return {"folds": folds, "pooled": pooled, "bands": held_bands(held, kw.get("regimes", REGIMES))}


def held_bands(priced: list[dict], regimes, share: float = 0.9, min_rows: int = 10) -> dict[str, list[float]]:
    """Per regime with >= min_rows held-out plans: the central interval of measured / predicted - 1 holding `share`
    of them (band.bands_of), each plan priced by a fit that never saw its context: a step band measured out of
    sample (`--cv-bands` writes it into the profile; band.py measures one on rows given apart)."""
    errs: dict[str, list[float]] = {}
    for r in priced:
        errs.setdefault(regime_of(r["batch"], regimes), []).append(r["measured_us"] / r["predicted_us"] - 1.0)
    return {k: list(v) for k, v in bands_of(errs, share, min_rows).items()}


def _grid(spec: str) -> list[tuple]:
    """"f1=a,b;f2=c" -> [((f1, a), (f2, c)), ((f1, b), (f2, c))] (fields of SIM_FIELDS)."""
    import itertools
    axes = []
    for part in filter(None, spec.split(";")):
        k, vs = part.split("=")
        assert k in SIM_FIELDS or any(k.startswith(p) for p in PREFIXES), \
            f"--grid field {k!r}: one of {SIM_FIELDS} or " + ", ".join(f"{p}<task kind>" for p in PREFIXES)
        axes.append([(k, float(v)) for v in vs.split(",")])
    return [tuple(c) for c in itertools.product(*axes)] if axes else [()]


def main() -> None:
    try:
        _main()
    except (OSError, ValueError) as e:   # a rows file or profile not there, or not readable: a message (as band.py)
        raise SystemExit(f"error: {e}") from None


def _main() -> None:
    ap = argparse.ArgumentParser(description=FIT_DOC.split("\n")[0])
    ap.add_argument("--rows", required=True, help="validation rows JSONL (or planner_validation.json), comma-separated")
    ap.add_argument("--profile", default="h200_measured")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--name", default="h200_fitted")
    ap.add_argument("--holdout", action="store_true")
    ap.add_argument("--terms", default="mk,conv", help="calibration terms to fit: mk, mklayer, mkkv, mkas, mkattn, conv, "
                    "boundary (comma-separated; planner.fit.fit_profile)")
    ap.add_argument("--regimes", default="1,8", help="min batch of each regime, e.g. 1,8 or 1,8,32,128")
    ap.add_argument("--no-resimulate", action="store_true",
                    help="price from the recorded features (sim_us of the simulator that made the plans); default: "
                         "re-simulate every measured plan with the current simulator under the profile")
    ap.add_argument("--grid", default="", help="simulator terms to choose by re-simulation, e.g. "
                    "'mk_tc_stream_eff=0.4,0.5,0.6;mk_tc_eff=0.5,1;fixed.qkv_rope=5,15' (fixed.<kind> / flop.<kind>: "
                    "per-kind task fixed cost / per-flop time; key.<kind>: per-key time; eff.<kind>: streaming "
                    "efficiency; pass.<rows>: a Tensor Core linear pass's serial time by its rows; chosen on the "
                    "training half in --holdout)")
    ap.add_argument("--procs", type=int, default=0, help="processes for re-simulation (default: all cores)")
    ap.add_argument("--test", default="", help="rows never fitted on (e.g. another context): scored out of sample "
                    "with the fitted profile (re-simulated under the chosen grid terms)")
    ap.add_argument("--batches", default="", help="fit on the rows of these batch sizes only (e.g. 1,8): the "
                    "regimes they fall in are refit, the others kept, and the chosen --grid terms are written into "
                    "those regimes only (scoped_terms), so the other regimes' prices do not move")
    ap.add_argument("--boundary-regimes", default="", help="--terms boundary: write the fitted segment_boundary_us "
                    "into these regimes only (e.g. 1,8; default: the profile's top level, every regime)")
    ap.add_argument("--keep-attn", action="store_true", help="megakernel refit: mk_scale only, the base's "
                    "mk_offset_us kept and attention-only segments left at the base's scale and factor (their price "
                    "does not move; for a term that moves whole-layer segments only, fitted on older rows)")
    ap.add_argument("--conv-weight", default="segment", choices=("segment", "plan"),
                    help="conventional refit: every segment's relative error alike (segment), or each plan's "
                    "conventional segments sharing one weight (plan: a whole-step conventional plan counts as much "
                    "as an attention-split plan's ~36 segments)")
    ap.add_argument("--paged-scale", type=float, default=None,
                    help="the paged attention curves' scale fixed (e.g. 1.0: curves measured on this card taken as "
                         "they are) instead of fitted per regime")
    ap.add_argument("--cv-context", action="store_true",
                    help="also leave one context out: fit on the other contexts' rows, score the held-out one "
                         "(by_context), per context and pooled")
    ap.add_argument("--cv-bands", action="store_true",
                    help="with --cv-context: write the held-out folds' 90%% step bands per regime (held_bands) into "
                         "the fitted profile's regimes (step_band), in place of the base's")
    a = ap.parse_args()
    if a.cv_bands and not a.cv_context:
        raise SystemExit("--cv-bands measures the bands on the held-out folds of --cv-context: add --cv-context")
    rows = load_rows(a.rows)
    if a.batches:
        rows = [r for r in rows if r["batch"] in {int(b) for b in a.batches.split(",")}]
    n_all = len(rows)
    rows = valid_rows(rows)
    print(f"{len(rows)} valid measured rows of {n_all} (skipped: unmeasured, or eager after a failed graph capture)")
    base = HardwareProfile.load(a.profile)
    kw = {"regimes": tuple((int(b), b) for b in a.regimes.split(",")), "terms": tuple(a.terms.split(",")),
          "keep_attn": a.keep_attn, "boundary_regimes": tuple(x for x in a.boundary_regimes.split(",") if x),
          "conv_weight": a.conv_weight, "paged_scale": a.paged_scale}
    sims = {}
    if not a.no_resimulate:
        for combo in _grid(a.grid):
            import time
            t = time.time()
            sims[combo] = resimulate(rows, with_terms(base, combo), procs=a.procs or None)
            print(f"re-simulated {len(sims[combo])} rows under {dict(combo) or 'the profile'} in {time.time() - t:.0f} s")
    if sims:
        prof, rep, combo = fit_with_sim_grid(sims, base, **kw)
        fitted_rows, base_rows = sims[combo], sims.get(()) or sims[combo]
    else:
        prof, rep = fit_profile(rows, base, **kw)
        fitted_rows = base_rows = rows
        combo = ()
    if a.batches and combo:
        prof = scoped_terms(prof, base, combo, {regime_of(int(b), kw["regimes"]) for b in a.batches.split(",")})
    prof = replace(prof, name=a.name)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
        f.write(prof.to_json())
    report = {"fit_all": rep, "all_recorded": mape_by(rows), "all_base": _brief(summarize(reprice(base_rows, base))),
              "all_base_mape": mape_by(base_rows, base),
              "all_fitted_in_sample": _brief(summarize(reprice(fitted_rows, prof))),
              "all_fitted_in_sample_mape": mape_by(fitted_rows, prof)}
    if a.holdout:
        report["holdout"] = holdout(base_rows, base, sims=sims if len(sims) > 1 else None, **kw)
    if a.cv_context:
        report["cv_context"] = by_context(base_rows, base, **kw)
        for c, f in report["cv_context"]["folds"].items():
            print(f"held out ctx {c}: step MAPE {f['step_mape']:.4f}, segment {f['segment_mape']:.4f}, max regret "
                  f"{f['max_regret']}, min Spearman {f['min_spearman']}")
        pl = report["cv_context"]["pooled"]
        print(f"held out, pooled: step MAPE {pl['step_mape']:.4f}, segment {pl['segment_mape']:.4f}, max regret "
              f"{pl['max_regret']}, pairs ordered {pl['resolved_pairs_ordered']}, min Spearman {pl['min_spearman']}")
        print("held out, 90% step bands by regime:", report["cv_context"]["bands"])
        if a.cv_bands:
            prof = with_bands(prof, {int(k): tuple(v) for k, v in report["cv_context"]["bands"].items()})
            with open(os.path.join(a.out, f"{a.name}.json"), "w") as f:
                f.write(prof.to_json())
            print(f"wrote the held-out bands into {a.name}.json")
    if a.test:
        test = valid_rows(load_rows(a.test))
        if not a.no_resimulate:
            test = resimulate(test, with_terms(base, combo), procs=a.procs or None)
        s_test = summarize(reprice(test, prof))
        report["test"] = {"rows": len(test), "fitted": {**_brief(s_test), "targets": s_test["targets"]},
                          "fitted_mape": mape_by(test, prof), "base": _brief(summarize(reprice(test, base))),
                          "base_mape": mape_by(test, base)}
        print("out of sample (--test):", json.dumps({k: v for k, v in report["test"]["fitted"].items()
                                                     if k != "points"}), "\n  by path:", report["test"]["fitted_mape"])
    with open(os.path.join(a.out, "fit_report.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "holdout"}, indent=1)[:4000])
    if a.holdout:
        for k in ("fit_a_test_b", "fit_b_test_a"):
            h = report["holdout"][k]
            print(k, "sim terms", h["fit"].get("sim_terms"), "\n  train", h["train_mape"], "\n  test ", h["test_mape"])
    print(f"wrote {os.path.join(a.out, a.name + '.json')} and fit_report.json")


if __name__ == "__main__":
    main()
