"""Session 60's calibration terms: mk_mixed_kv_us_per_mb (a multi-layer megakernel segment's price per MB of K / V
its attention layers beyond the first read) and the paged attention curves taken at a fixed scale. Synthetic
segments with known terms; the fit must recover them, and profiles without the term must price as before."""
import dataclasses
import random

import pytest

from mpk_runtime.planner.cost import kv_beyond_first, price_from_features
from mpk_runtime.planner.fit import fit_conventional, fit_megakernel
from mpk_runtime.planner.profile import DEFAULT_PROFILE, HardwareProfile


def test_kv_beyond_first():
    assert kv_beyond_first({"attn_kv_mb": 100.0, "attn_layers": 1}) == 0.0
    assert kv_beyond_first({"attn_kv_mb": 100.0, "attn_layers": 4}) == pytest.approx(75.0)
    assert kv_beyond_first({"attn_layers": 4}) == 0.0   # rows written before the feature


def _mk_segs(scale, off, mixed_us, kv_us, launch, rng):
    segs = []
    for layers in (1, 2, 4, 16):
        for kv_mb in (5.0, 40.0, 300.0):
            for mixed in (True, False):
                sim = 50.0 * layers + rng.uniform(0, 20)
                f = {"kind": "megakernel", "sim_us": sim, "attn_only": False, "attn_mixed": mixed,
                     "attn_layers": layers if mixed else 0, "attn_kv_mb": kv_mb * layers if mixed else 0.0}
                meas = launch + scale * sim + off + ((mixed_us + kv_us * kv_beyond_first(f)) if mixed else 0.0)
                segs.append({"features": f, "measured_us": meas})
    return segs


def test_fit_megakernel_recovers_the_kv_term():
    segs = _mk_segs(0.92, -3.0, 9.5, 0.13, 18.0, random.Random(0))
    got = fit_megakernel(segs, 18.0, per_kv=True)
    assert got["mk_mixed_kv_us_per_mb"] == pytest.approx(0.13, rel=1e-6)
    assert got["mk_scale"] == pytest.approx(0.92, rel=1e-6)
    assert got["mk_offset_us"] == pytest.approx(-3.0, abs=1e-6)
    assert got["mk_mixed_attn_us"] == pytest.approx(9.5, abs=1e-6)
    # without per_kv the term is neither fitted nor written; the others absorb it (and miss)
    plain = fit_megakernel(segs, 18.0)
    assert "mk_mixed_kv_us_per_mb" not in plain and abs(plain["mk_scale"] - 0.92) > 1e-3


def test_profiles_without_the_term_price_as_before():
    prof = HardwareProfile.load(DEFAULT_PROFILE).for_batch(8)
    assert prof.mk_mixed_kv_us_per_mb == 0.0
    f = {"kind": "megakernel", "sim_us": 900.0, "attn_only": False, "attn_mixed": True, "attn_layers": 16}
    assert price_from_features(dict(f, attn_kv_mb=500.0), prof) == price_from_features(f, prof)
    with_term = dataclasses.replace(prof, mk_mixed_kv_us_per_mb=0.2)
    assert price_from_features(dict(f, attn_kv_mb=500.0), with_term) == pytest.approx(
        price_from_features(f, prof) + 0.2 * 500.0 * 15 / 16)


def _conv_segs(fixed_scale, paged_scale, rng):
    segs = []
    for i in range(12):
        f = {"kind": "conventional", "fixed_us": rng.uniform(10, 100), "st": [[rng.uniform(5, 50), 1.0, 1]],
             "attn_kv_us": 0.0, "attn": [], "attn_curve_us": 0.0, "attn_curve_paged_us": rng.uniform(0, 400)}
        meas = fixed_scale * f["fixed_us"] + f["st"][0][0] / 0.9 + paged_scale * f["attn_curve_paged_us"]
        segs.append({"features": f, "measured_us": meas})
    return segs


def test_fit_conventional_paged_scale_fitted_or_fixed():
    segs = _conv_segs(0.55, 1.2, random.Random(1))
    free = fit_conventional(segs)
    assert free["conv_attn_paged_scale"] == pytest.approx(1.2, rel=1e-6)
    assert free["conv_fixed_scale"] == pytest.approx(0.55, rel=1e-6) and free["conv_bw_fraction"] == 0.9
    fixed = fit_conventional(segs, paged_scale=1.0)
    assert fixed["conv_attn_paged_scale"] == 1.0            # held, not fitted
    assert fixed["conv_fixed_scale"] != pytest.approx(0.55, rel=1e-3)   # the rest absorbs what the curve misses
    exact = fit_conventional(_conv_segs(0.55, 1.0, random.Random(1)), paged_scale=1.0)
    assert exact["conv_fixed_scale"] == pytest.approx(0.55, rel=1e-6) and exact["conv_attn_paged_scale"] == 1.0


# ----------------------------------------------------------------------------- session 61: mk_mixed_attn_sim_scale
def _as_segs(scale, off, mixed_us, as_scale, layer_us, launch, rng):
    segs = []
    for layers in (1, 2, 4, 16):
        for attn_sim in (8.0, 30.0, 120.0):      # one attention op's simulated time (grows with the keys)
            for mixed in (True, False):
                sim = 50.0 * layers + attn_sim * layers + rng.uniform(0, 20)
                f = {"kind": "megakernel", "sim_us": sim, "attn_only": False, "attn_mixed": mixed,
                     "attn_layers": layers if mixed else 0, **({"attn_sim_us": attn_sim * layers} if mixed else {})}
                meas = launch + scale * sim + off + ((mixed_us + layer_us * (layers - 1) + as_scale * attn_sim * layers)
                                                     if mixed else 0.0)
                segs.append({"features": f, "measured_us": meas})
    return segs


def test_fit_megakernel_recovers_the_attention_sim_scale():
    segs = _as_segs(0.92, -3.0, 8.0, 0.2, 0.0, 18.0, random.Random(2))
    got = fit_megakernel(segs, 18.0, per_attn_sim=True)
    assert got["mk_mixed_attn_sim_scale"] == pytest.approx(0.2, rel=1e-6)
    assert got["mk_scale"] == pytest.approx(0.92, rel=1e-6) and got["mk_mixed_attn_us"] == pytest.approx(8.0, abs=1e-6)
    plain = fit_megakernel(segs, 18.0)
    assert "mk_mixed_attn_sim_scale" not in plain and abs(plain["mk_scale"] - 0.92) > 1e-3
    # with a per-layer term as well (terms mkas,mklayer): both recovered (the two features are not collinear here)
    both = fit_megakernel(_as_segs(0.92, -3.0, 8.0, 0.2, 5.0, 18.0, random.Random(3)), 18.0, per_layer=True,
                          per_attn_sim=True)
    assert both["mk_mixed_attn_sim_scale"] == pytest.approx(0.2, abs=0.02)
    assert both["mk_attn_layer_us"] == pytest.approx(5.0, abs=1.0)


def test_the_attention_sim_term_prices_mixed_segments_only():
    prof = dataclasses.replace(HardwareProfile.load(DEFAULT_PROFILE).for_batch(1), mk_mixed_attn_sim_scale=0.3)
    f = {"kind": "megakernel", "sim_us": 900.0, "attn_only": False, "attn_mixed": True, "attn_layers": 16}
    assert price_from_features(dict(f, attn_sim_us=200.0), prof) == pytest.approx(
        price_from_features(f, prof) + 0.3 * 200.0)
    unmixed = dict(f, attn_mixed=False, attn_layers=0)
    assert price_from_features(dict(unmixed, attn_sim_us=200.0), prof) == price_from_features(unmixed, prof)
    assert HardwareProfile.load(DEFAULT_PROFILE).mk_mixed_attn_sim_scale == 0.0   # the H200's prices do not move


def test_attn_factor_is_fitted_against_the_price_attention_segments_get():
    """A regime with its own mk_attn_scale (h100_v1's 32 / 128): the factor must be fitted on that price, not on
    mk_scale's (session 61: attn-mk's segments priced ~20% high at B=32)."""
    from mpk_runtime.planner.fit import fit_attn_factor
    prof = dataclasses.replace(HardwareProfile.load(DEFAULT_PROFILE).for_batch(32), mk_scale=0.93, mk_attn_scale=1.22,
                               mk_offset_us=0.0, mk_attn_factor=5.0)
    segs = []
    for sim in (20.0, 80.0, 300.0):
        f = {"kind": "megakernel", "sim_us": sim, "attn_only": True, "attn_mixed": False, "attn_layers": 1}
        segs.append({"features": f, "measured_us": 1.1 * (prof.megakernel_launch_us + 1.22 * sim)})
    k = fit_attn_factor(segs, prof)
    assert k == pytest.approx(1.1, rel=1e-9)
    fitted = dataclasses.replace(prof, mk_attn_factor=k)
    assert all(price_from_features(s["features"], fitted) == pytest.approx(s["measured_us"]) for s in segs)


def test_attn_line_recovers_an_intercept_and_a_slope_the_factor_alone_cannot():
    """Term "mkattn" (session 62): attention-only segments measured on a line a + b x sim whose intercept and slope
    are not in the ratio launch + offset : scale (the H100 at B=128: ~31 + 1.09 x sim against 43 + 0.87 x sim)
    get their own factor and scale, and price every segment on the line; the factor alone leaves a slope error.
    Where the line would need a negative intercept, the factor alone is fitted (a physical price)."""
    from mpk_runtime.planner.fit import fit_attn_factor, fit_attn_line
    prof = dataclasses.replace(HardwareProfile.load(DEFAULT_PROFILE).for_batch(128), mk_scale=0.88, mk_attn_scale=1.22,
                               mk_offset_us=40.0, mk_attn_factor=0.71)
    segs = []
    for sim in (45.0, 88.0, 172.0, 341.0, 677.0):
        f = {"kind": "megakernel", "sim_us": sim, "attn_only": True, "attn_mixed": False, "attn_layers": 1}
        segs.append({"features": f, "measured_us": 31.0 + 1.09 * sim})
    got = fit_attn_line(segs, prof)
    fitted = dataclasses.replace(prof, **got)
    assert got["mk_attn_factor"] * (prof.megakernel_launch_us + prof.mk_offset_us) == pytest.approx(31.0)
    assert got["mk_attn_factor"] * got["mk_attn_scale"] == pytest.approx(1.09)
    assert all(price_from_features(s["features"], fitted) == pytest.approx(s["measured_us"]) for s in segs)
    alone = dataclasses.replace(prof, mk_attn_factor=fit_attn_factor(segs, prof))
    assert max(abs(price_from_features(s["features"], alone) / s["measured_us"] - 1) for s in segs) > 0.05
    neg = [dict(s, measured_us=1.09 * s["features"]["sim_us"] - 20.0) for s in segs]
    assert set(fit_attn_line(neg, prof)) == {"mk_attn_factor"}
    one = [dict(segs[1], measured_us=m) for m in (120.0, 125.0, 130.0)]   # one sim_us: no line, the factor alone
    assert set(fit_attn_line(one, prof)) == {"mk_attn_factor"}


def test_megakernel_features_carry_the_attention_sim():
    """A mixed segment's attn_sim_us is its attention ops' own simulated makespans: per layer what attn-mk's
    attention-only segment of that layer simulates. Segments without attention among other ops carry none."""
    from mpk_runtime.models import load_config
    from mpk_runtime.planner.search import candidates
    cfg = load_config("tiny-llama")
    prof = dataclasses.replace(HardwareProfile.load(DEFAULT_PROFILE), num_sms=8)
    plans = {p.name: p for p in candidates(cfg, batch=1, context=256, prof=prof,
                                           families=("mono", "mega2", "attn-mk", "attn-conv"))}
    attn_only = [s.features["sim_us"] for s in plans["attn-mk"].segments
                 if s.kind == "megakernel" and s.features["attn_only"]]
    assert len(attn_only) == cfg.num_layers and max(attn_only) > 0
    mono = plans["mono"].segments[0].features
    assert mono["attn_mixed"] and mono["attn_sim_us"] == pytest.approx(sum(attn_only), rel=1e-9)
    halves = [s.features for s in plans["mega2"].segments if s.features.get("attn_mixed")]
    assert len(halves) == 2 and all(f["attn_sim_us"] == pytest.approx(attn_only[0] * f["attn_layers"], rel=1e-9)
                                    for f in halves)
    assert all("attn_sim_us" not in s.features for s in plans["attn-conv"].segments if s.kind == "megakernel")


def test_a_term_fitted_negative_is_written_as_zero():
    """A mixed term the rows push below 0 is written as 0 (not left out, which would keep the base regime's old
    value): no per-layer price in these segments, only the attention sim term."""
    segs = _as_segs(0.92, -3.0, 8.0, 0.2, -2.0, 18.0, random.Random(4))
    got = fit_megakernel(segs, 18.0, per_layer=True, per_attn_sim=True)
    assert got["mk_attn_layer_us"] == 0.0 and got["mk_mixed_attn_sim_scale"] > 0
