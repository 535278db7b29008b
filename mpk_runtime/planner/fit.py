"""Refit the profile's calibration terms per batch regime from validation measurements, and score predictions.

    python -m mpk_runtime.planner.fit --rows $OUT/planner_validation_rows.jsonl [--profile h200_measured]
        [--out DIR] [--holdout] [--terms mk,conv] [--regimes 1,8,32,128] [--cv-context [--cv-bands]]

Input: scripts/validate_planner.py rows; each measured segment carries the features of its price
(cost.conventional_features / {"sim_us"} of a megakernel segment). Per regime (batch 1..7 -> "1", batch >= 8 ->
"8": the batch-1 kernels and the 8-row-group kernels are different code paths) it fits:
  megakernel    measured - launch = mk_scale * simulated + mk_offset_us (+ mk_mixed_attn_us: a segment holding a
                layer's attention among other ops)                     (weighted least squares); attention-only
                segments: mk_attn_factor (and with --terms mkattn mk_attn_scale: fit_attn_line) on that price
  conventional  measured = conv_fixed_scale * fixed + sum_ops max(stream / conv_bw_fraction, tc / conv_tc_eff)
                           + sum_attention max(conv_attn_kv_passes * attn_kv,
                                               conv_attn_key_us * keys)           (grid over the two efficiencies,
                                                                                  the KV passes and the per-key
                                                                                  floor; non-negative LS for the
                                                                                  rest)
                           + conv_attn_curve_scale * measured attention   (shapes the profile has a curve for:
                                                                           one more LS column)
with relative-error weights (each segment counts by its relative error, as MAPE does). The result is the
input profile plus `regimes` overrides (profile.for_batch applies them), so candidates() predicts with it.
--holdout: points (model, tp, batch) sorted by (tp, batch, model) alternate into halves A and B; fit on A, score
A and B, and the reverse; reports both. Scoring re-prices measured segments from their features
(`cost.price_from_features`, the same arithmetic candidates() uses), so no simulation is rerun.
This module fits; the command line (the --grid re-simulation, --holdout, --test, the files written) is fit_cli.py.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

from .cost import kv_beyond_first, price_from_features
from .profile import HardwareProfile
from .score import valid
from .score import features as seg_features
from .trace_fit import lstsq

REGIMES = ((1, "1"), (8, "8"))   # (min batch, key)
BATCH_REGIMES = ((1, "1"), (8, "8"), (32, "32"), (128, "128"))   # --regimes batch: one per measured batch
CONV_FIELDS = ("conv_fixed_scale", "conv_bw_fraction", "conv_tc_eff", "conv_attn_kv_passes", "conv_attn_key_us",
               "conv_collective_us", "conv_attn_curve_scale", "conv_attn_paged_scale")
SIM_FIELDS = ("mk_tc_stream_eff", "mk_tc_eff", "linear_pass_us", "restream_frac")   # --grid: re-simulated
FIXED_PREFIX = "fixed."   # --grid fixed.<task kind>=...: the per-kind task fixed cost (task_fixed_us_by_kind)
FLOP_PREFIX = "flop."     # --grid flop.<task kind>=...: the per-kind per-flop time not hidden (flop_us_by_kind)
KEY_PREFIX = "key."       # --grid key.<task kind>=...: an attention partial's per-key time (key_us_by_kind)
PASS_PREFIX = "pass."     # --grid pass.<rows>=...: a Tensor Core linear pass's serial time (tc_pass_us_by_rows)
EFF_PREFIX = "eff."       # --grid eff.<task kind>=...: the kind's streaming efficiency (stream_eff_by_kind)
PREFIXES = {FIXED_PREFIX: "task_fixed_us_by_kind", FLOP_PREFIX: "flop_us_by_kind", KEY_PREFIX: "key_us_by_kind",
            PASS_PREFIX: "tc_pass_us_by_rows", EFF_PREFIX: "stream_eff_by_kind"}


def with_terms(base: HardwareProfile, combo) -> HardwareProfile:
    """base with the simulator terms of a grid combo: SIM_FIELDS directly, fixed.<kind> into
    task_fixed_us_by_kind and flop.<kind> into flop_us_by_kind (copies)."""
    plain = {k: v for k, v in combo if not any(k.startswith(p) for p in PREFIXES)}
    for pre, field_name in PREFIXES.items():
        per_kind = {k[len(pre):]: v for k, v in combo if k.startswith(pre)}
        if per_kind:
            plain[field_name] = {**getattr(base, field_name), **per_kind}
    return replace(base, **plain)


def scoped_terms(prof: HardwareProfile, base: HardwareProfile, combo, keys) -> HardwareProfile:
    """prof (fitted under base + combo on the rows of regimes `keys`) with the combo's simulator terms moved into
    those regimes' overrides (profile.for_batch merges dict-valued fields per key) and the global fields back at
    base's values: terms chosen on some batch sizes price only those."""
    terms = with_terms(base, combo)
    fields = {k for k, _ in combo if k in SIM_FIELDS} | \
        {PREFIXES[p] for k, _ in combo for p in PREFIXES if k.startswith(p)}
    regs = {k: dict(v) for k, v in prof.regimes.items()}
    for key in keys:
        over = regs.setdefault(key, {})
        for f in fields:
            v = getattr(terms, f)
            over[f] = {kind: v[kind] for kind in v if v[kind] != getattr(base, f).get(kind)} if isinstance(v, dict) \
                else v
    return replace(prof, regimes=regs, **{f: getattr(base, f) for f in fields})


def regime_of(batch: int, regimes=REGIMES) -> str:
    return [k for b, k in regimes if batch >= b][-1]


# ----------------------------------------------------------------------------------------------- fitting
def _segments(rows, regime=None, regimes=REGIMES):
    for r in rows:
        if not valid(r):
            continue
        if regime is not None and regime_of(r["batch"], regimes) != regime:
            continue
        for s in r["segments"]:
            if s.get("features") and s["measured_us"] > 0:
                yield r, dict(s, features=seg_features(s))


def _wls(cols: list[list[float]], y: list[float], w: list[float], nonneg: bool = True) -> list[float]:
    """min sum w (y - X b)^2 (b >= 0 if nonneg): unconstrained least squares, else the best of every subset of
    columns whose own solution is non-negative (exact for the few columns fitted here)."""
    import itertools

    import numpy as np
    X = np.array(cols, dtype=float).T
    Y, W = np.array(y, dtype=float), np.sqrt(np.array(w, dtype=float))
    Xw, Yw = X * W[:, None], Y * W
    b = np.linalg.lstsq(Xw, Yw, rcond=None)[0]
    if nonneg and (b < 0).any():
        n = X.shape[1]
        best = (float((Yw ** 2).sum()), np.zeros(n))   # every coefficient 0
        for k in range(1, n):
            for keep in itertools.combinations(range(n), k):
                sub = np.linalg.lstsq(Xw[:, keep], Yw, rcond=None)[0]
                if (sub < 0).any():
                    continue
                bk = np.zeros(n)
                bk[list(keep)] = sub
                err = float(((Yw - Xw @ bk) ** 2).sum())
                if err < best[0]:
                    best = (err, bk)
        b = best[1]
    return [float(v) for v in b]


def _mixed_columns(segs, sims, w, mixed, cols: dict, launch_us) -> dict:
    """The coefficients of feature columns fitted together on the mixed segments alone (scale, constant, the
    columns; relative-error weights), each floored at 0 (a column fitted negative is set to 0 and the rest
    refitted without it); a column that takes fewer than two distinct values there is left out (not returned)."""
    ix = [i for i, m in enumerate(mixed) if m]
    names = [n for n, c in cols.items() if len({round(c[i], 3) for i in ix}) >= 2]
    zero = {}
    while names:
        b = _wls([[sims[i] for i in ix], [1.0] * len(ix)] + [[cols[n][i] for i in ix] for n in names],
                 [segs[i]["measured_us"] - launch_us for i in ix], [w[i] for i in ix], nonneg=False)
        got = dict(zip(names, b[2:]))
        neg = [n for n, v in got.items() if v < 0]
        if not neg:
            return {**zero, **got}
        zero.update({n: 0.0 for n in neg})
        names = [n for n in names if n not in neg]
    return zero


def fit_megakernel(segs: list[dict], launch_us: float, offset_us: float | None = None, per_layer: bool = False,
                   per_kv: bool = False, per_attn_sim: bool = False) -> dict:
    """mk_scale and mk_offset_us of whole megakernel segments (relative-error weights), and mk_mixed_attn_us (the
    price of holding a layer's attention among other ops, cost.price_from_features) where segments of both kinds
    are among them; offset_us given: that offset kept and the scale alone fitted (the mixed term with it).
    The mixed segments' own terms, fitted together first on the mixed segments alone (scale, constant, the terms'
    features; each needs at least two distinct values) and then taken off their measurements: per_layer
    mk_attn_layer_us (per attention layer beyond the first), per_kv mk_mixed_kv_us_per_mb (per MB of K / V those
    layers read, cost.kv_beyond_first), per_attn_sim mk_mixed_attn_sim_scale (on the simulated time of the
    segment's attention ops, feature attn_sim_us)."""
    sims = [s["features"]["sim_us"] for s in segs]
    w = [1.0 / s["measured_us"] ** 2 for s in segs]
    mixed = [1.0 if s["features"].get("attn_mixed") else 0.0 for s in segs]
    both = 0 < sum(mixed) < len(mixed)
    feats = {"mk_attn_layer_us": (per_layer, lambda f: max(0, f.get("attn_layers", 1) - 1)),
             "mk_mixed_kv_us_per_mb": (per_kv, kv_beyond_first),
             "mk_mixed_attn_sim_scale": (per_attn_sim, lambda f: f.get("attn_sim_us", 0.0))}
    cols = {n: [float(feat(s["features"])) if m else 0.0 for s, m in zip(segs, mixed)]
            for n, (on, feat) in feats.items() if on}
    found = _mixed_columns(segs, sims, w, mixed, cols, launch_us) if cols else {}
    y = [s["measured_us"] - launch_us - sum(v * cols[n][i] for n, v in found.items()) for i, s in enumerate(segs)]
    out = _fit_mk_terms(sims, y, w, mixed, both, launch_us, offset_us)
    return {**out, **found}


def _fit_mk_terms(sims, y, w, mixed, both, launch_us, offset_us) -> dict:
    if offset_us is not None:
        b = _wls([sims] + ([mixed] if both else []), [v - offset_us for v in y], w)
        return {"mk_scale": b[0], "mk_offset_us": offset_us, **({"mk_mixed_attn_us": b[1]} if both else {})}
    if len({round(v, 3) for v in sims}) < 2:    # one size: scale only
        sc = _wls([sims], y, w)[0]
        return {"mk_scale": sc, "mk_offset_us": 0.0}
    b = _wls([sims, [1.0] * len(sims)] + ([mixed] if both else []), y, w, nonneg=False)
    sc, off, mx = b[0], b[1], (b[2] if both else None)
    if sc <= 0:
        sc, off, mx = _wls([sims], y, w)[0], 0.0, None
    if off < -launch_us:   # a segment costs at least its scaled simulation: no negative per-segment overhead
        off = -launch_us   # (else plans of many segments, per-layer, are credited for every cut)
        b = _wls([sims] + ([mixed] if both else []), [v - off for v in y], w)
        sc, mx = b[0], (b[1] if both else None)
    if mx is not None and off + mx < -launch_us:   # the same floor for segments holding attention
        mx = -launch_us - off
    return {"mk_scale": sc, "mk_offset_us": off, **({"mk_mixed_attn_us": mx} if mx is not None else {})}


def fit_attn_factor(segs: list[dict], prof: HardwareProfile) -> float:
    """mk_attn_factor: the factor on the price of attention-only megakernel segments (priced with `prof`'s
    mk_offset_us and its mk_attn_scale, or mk_scale where it has none) that minimises their squared relative
    errors. (Before session 61 they were priced with mk_scale here whatever mk_attn_scale was, so a regime with
    both (h100_v1's 32 / 128: 0.93 and 1.22) got a factor for another price and attn-mk's segments ~20% high.)"""
    unit = replace(prof, mk_attn_factor=1.0)   # priced as they are (mk_attn_scale where the regime has one)
    r = [price_from_features(dict(s["features"], attn_only=True), unit) / s["measured_us"] for s in segs]
    return sum(r) / sum(v * v for v in r)


def fit_attn_line(segs: list[dict], prof: HardwareProfile) -> dict:
    """mk_attn_factor and mk_attn_scale together (term "mkattn"): attention-only megakernel segments priced as
    factor x (launch + mk_offset_us + scale x sim_us), i.e. a line a + b x sim_us in their simulated time, fitted on
    relative errors with the launch and offset the whole segments' fit left (prof). One factor alone scales the
    line's intercept and slope together: session 62's H100 rows at B=128 want ~31 us + 1.09 x sim from 1024 to 8192
    keys where the factor fitted at 512 keys priced 43 + 0.87 x sim, so attn-mk came out 13-18% low at 4096 / 8192
    keys and was chosen over a conventional plan 5% faster. Falls back to the factor alone (fit_attn_factor) where
    the line is not determined (one distinct sim_us: lstsq finds its columns dependent) or its intercept or slope
    would not be positive."""
    base = prof.megakernel_launch_us + prof.mk_offset_us
    if base <= 0:
        return {"mk_attn_factor": fit_attn_factor(segs, prof)}
    sol = lstsq([[1.0 / s["measured_us"], s["features"]["sim_us"] / s["measured_us"]] for s in segs],
                [1.0] * len(segs))   # a / m + b x sim / m = 1: the line on relative errors
    if sol is None or sol[0] <= 0 or sol[1] <= 0:
        return {"mk_attn_factor": fit_attn_factor(segs, prof)}
    a, b = sol
    factor = a / base
    return {"mk_attn_factor": factor, "mk_attn_scale": b / factor}


# Passes over the gathered KV of the conventional attention (gather read + write, SDPA read: ~3): a grid of
# physical values, not a free least-squares term. Free, it traded against the fixed term on one model's points
# (191 passes and a 0.02 fixed scale at llama-3.2-1b batch 1, session 10), and the fit did not transfer across
# models (held-out batch-1 conventional MAPE 67%).
KV_PASSES = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0)


# Per-key floor of the conventional attention (us per key per layer): a grid of measured magnitudes (session 13:
# ~0.03-0.05 at batch 1-8), 0 = the bandwidth term alone.
KEY_US = (0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08)


def fit_conventional(segs: list[dict], share: list[float] | None = None, paged_scale: float | None = None) -> dict:
    """The conventional calibration terms minimising the segments' squared relative errors, each segment's error
    weighted by `share` (default 1: every segment alike; fit_profile's conv_weight="plan" gives each plan's
    conventional segments a total of 1, so a whole-step conventional plan counts as much as the ~36 small
    segments of an attention-split plan). paged_scale given: the paged attention's curve enters at that scale
    instead of a fitted one (1.0: the curve measured on this card taken as it is; a scale fitted at short contexts,
    where the curve is a small part of the step, is extrapolated with it to long ones)."""
    import numpy as np
    from .cost import conv_attn_us
    meas = np.array([s["measured_us"] for s in segs], dtype=float)
    sh = np.ones(len(segs)) if share is None else np.array(share, dtype=float)
    w = sh / meas ** 2
    has_kv = any(s["features"]["attn_kv_us"] > 0 for s in segs)
    has_keys = any(n > 0 for s in segs for _, n, _ in s["features"].get("attn", []))
    has_coll = any(s["features"].get("n_coll", 0) > 0 for s in segs)
    has_curve = any(s["features"].get("attn_curve_us", 0) > 0 for s in segs)   # measured attention (profile curve)
    has_paged = any(s["features"].get("attn_curve_paged_us", 0) > 0 for s in segs)   # ... the paged kernel's curve
    fixed_paged = np.array([(paged_scale or 0.0) * float(s["features"].get("attn_curve_paged_us", 0.0)) for s in segs])
    if paged_scale is not None:
        has_paged = False
    cols = [[s["features"]["fixed_us"] for s in segs]]
    if has_coll:
        cols.append([float(s["features"].get("n_coll", 0)) for s in segs])
    if has_curve:
        cols.append([float(s["features"].get("attn_curve_us", 0.0)) for s in segs])
    if has_paged:
        cols.append([float(s["features"].get("attn_curve_paged_us", 0.0)) for s in segs])
    X = np.array(cols, dtype=float).T
    # the greedy bf16 argmax's saving (cost.logits_copy_saved_us): priced from bytes, not fitted
    copy = np.array([float(s["features"].get("logits_copy_us", 0.0)) for s in segs])
    given = copy + fixed_paged   # the priced parts no column fits (the fixed-scale paged curve with them)
    # the attention term of every segment for each (KV passes, per-key floor) on the grids
    attn = {}
    for kvp in (KV_PASSES if has_kv else (1.0,)):
        for ku in (KEY_US if has_keys else (0.0,)):
            attn[(kvp, ku)] = np.array([conv_attn_us(s["features"], kvp, ku) for s in segs])
    best = None
    # descending, strict improvement: where a term never binds (Tensor Cores at batch 1), keep the prior (1.0)
    for frac in [1.0 - 0.05 * i for i in range(15)]:
        for eff in [1.0 - 0.1 * i for i in range(10)]:
            st = np.array([sum(c * max(a / frac, t / eff) for a, t, c in s["features"]["st"]) for s in segs])
            for (kvp, ku), at in attn.items():
                y = meas - st - at - given
                b = _wls([list(col) for col in X.T], list(y), list(w))
                pred = st + at + given + X @ np.array(b)
                err = float((sh * ((pred - meas) / meas) ** 2).sum())
                if best is None or err < best[0] * (1 - 1e-9) - 1e-15:
                    best = (err, frac, eff, kvp, ku, b)
    _, frac, eff, kvp, ku, b = best
    out = {"conv_fixed_scale": b[0], "conv_bw_fraction": round(frac, 4), "conv_tc_eff": round(eff, 4),
           "conv_collective_us": b[1] if has_coll else 0.0}
    # only the attention terms these segments identify (the others keep the profile's values: shapes without a
    # measured curve, or with one, are priced by terms fitted where they bind)
    if has_kv:
        out["conv_attn_kv_passes"] = kvp
    if has_keys:
        out["conv_attn_key_us"] = ku
    if has_curve:
        out["conv_attn_curve_scale"] = b[1 + has_coll]
    if has_paged:
        out["conv_attn_paged_scale"] = b[1 + has_coll + has_curve]
    elif paged_scale is not None:
        out["conv_attn_paged_scale"] = paged_scale
    return out


BOUNDARY_MIN = 8   # fit_boundary: plans of at least this many segment boundaries (one boundary's share of a
                   # step's noise, +-15 us on mega2 / mega3, would swamp its ~3 us)


def fit_boundary(rows: list[dict], min_boundaries: int = BOUNDARY_MIN) -> tuple[float | None, int]:
    """segment_boundary_us from measured rows: the median over plans of at least `min_boundaries` boundaries of
    (measured step - the sum of its segments measured alone) / boundaries; and how many plans it used. A segment
    measured alone pays its launch and drain in full; in the step's CUDA graph the next segment's launch overlaps
    them. None when no row qualifies."""
    per = []
    for r in rows:
        segs = r.get("segments") or []
        n = len(segs) - 1
        if not valid(r) or n < min_boundaries or any((s.get("measured_us") or 0) <= 0 for s in segs):
            continue
        per.append((r["measured_us"] - sum(s["measured_us"] for s in segs)) / n)
    return (statistics.median(per) if per else None), len(per)


def fit_profile(rows: list[dict], base: HardwareProfile, min_segments: int = 2, regimes=REGIMES,
                terms=("mk", "conv"), keep_attn: bool = False,
                boundary_regimes: tuple[str, ...] = (), boundary_min: int = BOUNDARY_MIN,
                conv_weight: str = "segment", paged_scale: float | None = None) -> tuple[HardwareProfile, dict]:
    """The base profile with per-regime calibration fitted on `rows`; and a report (counts per regime).
    terms: "mk" (mk_scale, mk_offset_us), "mklayer" ("mk" plus mk_attn_layer_us, a price per attention layer beyond
    the first in a mixed segment), "mkkv" ("mk" plus mk_mixed_kv_us_per_mb, per MB of K / V in a mixed segment),
    "mkas" ("mk" plus mk_mixed_attn_sim_scale, on the simulated time of a mixed segment's attention ops),
    "mkattn" ("mk" plus attention-only segments' own scale beside their factor: fit_attn_line), "conv"
    (CONV_FIELDS), "boundary" (segment_boundary_us, one value for all regimes: fit_boundary; with
    `boundary_regimes`, written into those regimes only); the others keep the base profile's values.
    keep_attn: the megakernel refit moves only mk_scale: the base's mk_offset_us stays, and attention-only segments
    keep the base's scale (mk_attn_scale) and factor, so their price does not move. For a simulator term that
    changes whole-layer segments only (tc_pass_us_by_rows: linear tiles), fitted on rows of older code whose
    attention segments no longer price the same (session 35, docs/planner.md).
    conv_weight: "segment" (every conventional segment's relative error alike, as before session 39) or "plan"
    (each plan's conventional segments share a weight of 1: fit_conventional). paged_scale: fit_conventional's."""
    if conv_weight not in ("segment", "plan"):
        raise ValueError(f"conv_weight {conv_weight!r}: expected segment or plan")
    keep = {k: dict(v) for k, v in base.regimes.items()}
    regs = {}
    report = {}
    for _, key in regimes:
        segs = list(_segments(rows, key, regimes))
        mk = [s for _, s in segs if s["features"]["kind"] == "megakernel"]
        cv_rows = [(r, s) for r, s in segs if s["features"]["kind"] == "conventional"]
        cv = [s for _, s in cv_rows]
        over = dict(keep.get(key, {}))
        if ({"mk", "mklayer", "mkkv", "mkas", "mkattn"} & set(terms)) and len(mk) >= min_segments:
            whole = [s for s in mk if not s["features"].get("attn_only")]
            was = base.for_batch(int(key))
            over.update(fit_megakernel(whole if len(whole) >= min_segments else mk, base.megakernel_launch_us,
                                       was.mk_offset_us if keep_attn else None, per_layer="mklayer" in terms,
                                       per_kv="mkkv" in terms, per_attn_sim="mkas" in terms))
            attn = [s for s in mk if s["features"].get("attn_only")]
            if keep_attn:   # attention-only segments: the base's scale, offset and factor (cost.price_from_features)
                over["mk_attn_scale"] = was.mk_scale if was.mk_attn_scale is None else was.mk_attn_scale
            elif attn and len(whole) >= min_segments:
                fitted = replace(base, regimes={key: over}).for_batch(int(key))
                if "mkattn" in terms:
                    over.update(fit_attn_line(attn, fitted))
                else:
                    over["mk_attn_factor"] = fit_attn_factor(attn, fitted)
        if "conv" in terms and len(cv) >= min_segments:
            share = None
            if conv_weight == "plan":
                n_conv = {id(r): sum(1 for rr, _ in cv_rows if rr is r) for r, _ in cv_rows}
                share = [1.0 / n_conv[id(r)] for r, _ in cv_rows]
            over.update(fit_conventional(cv, share, paged_scale))
        shown = ("mk_scale", "mk_offset_us", "mk_mixed_attn_us", "mk_attn_layer_us", "mk_mixed_kv_us_per_mb",
                 "mk_mixed_attn_sim_scale",
                 "mk_attn_factor", "mk_attn_scale") + CONV_FIELDS
        report[key] = {"megakernel_segments": len(mk), "conventional_segments": len(cv),
                       **{k: over[k] for k in over if k in shown}}
        if over:
            regs[key] = over
    for key, v in keep.items():   # base regimes this fit does not define (other regime sets): kept
        regs.setdefault(key, v)
    if "boundary" in terms:
        b, n = fit_boundary(rows, boundary_min)
        report["boundary"] = {"segment_boundary_us": b, "plans": n}
        if b is not None and boundary_regimes:
            for key in boundary_regimes:
                regs.setdefault(key, dict(keep.get(key, {})))["segment_boundary_us"] = round(b, 3)
        elif b is not None:
            base = replace(base, segment_boundary_us=round(b, 3))
    prof = replace(base, regimes=regs, source=(base.source + "; regimes refit by planner/fit.py").strip("; ")
                   if "refit by planner/fit.py" not in base.source else base.source)
    return prof, report


if __name__ == "__main__":   # the command line (python -m mpk_runtime.planner.fit): planner/fit_cli.py
    from .fit_cli import main
    main()
