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
