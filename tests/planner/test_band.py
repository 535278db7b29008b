"""planner/band.py: a profile's uncertainty band measured from validation rows, and the plans' band using it."""
import random
from dataclasses import replace

from mpk_runtime.models.config import load_config
from mpk_runtime.planner import band
from mpk_runtime.planner.profile import HardwareProfile
from mpk_runtime.planner.search import candidates


def _rows(prof, errors_by_batch):
    """One-segment megakernel rows whose measured step is the profile's price times (1 + error)."""
    rows = []
    for b, errs in errors_by_batch.items():
        p = prof.for_batch(b)
        for i, e in enumerate(errs):
            sim = 100.0 + 10 * i
            pred = p.megakernel_launch_us + p.mk_scale * sim + p.mk_offset_us
            rows.append({"model": "m", "tp": 1, "batch": b, "context": 512, "plan": f"p{i}", "measured_us": pred * (1 + e),
                         "predicted_us": pred, "segments": [{"kind": "megakernel", "predicted_us": pred,
                                                              "measured_us": pred * (1 + e),
                                                              "features": {"kind": "megakernel", "sim_us": sim}}]})
    return rows


def test_central_interval_holds_the_share_at_small_n():
    xs = list(range(28))
    lo, hi = band.central(xs, 0.9)
    assert (lo, hi) == (1, 26)   # floor(0.05 * 28) = 1 left out on each side: 26 / 28 >= 90%
    assert band.central(xs[:9], 0.9) == (0, 8)   # fewer than 20 rows: nothing can be left out


def test_bands_are_measured_per_regime_and_hold_their_rows():
    prof = HardwareProfile.load("h200_v36_cal")
    rnd = random.Random(0)
    errs = {1: [rnd.uniform(-0.05, 0.05) for _ in range(20)], 32: [rnd.uniform(-0.1, 0.3) for _ in range(40)],
            8: [0.01] * 5}   # too few rows at 8: no band measured there
    rows = _rows(prof, errs)
    bands = band.measure_bands(rows, prof)
    assert set(bands) == {1, 32}
    for b in (1, 32):
        s = sorted(errs[b])
        k = int(0.05 * len(s))
        assert bands[b][0] <= s[k] and bands[b][1] >= s[-1 - k]
        assert abs(bands[b][0] - s[k]) < 1e-4 and abs(bands[b][1] - s[-1 - k]) < 1e-4
    out = band.with_bands(prof, bands)
    assert out.for_batch(32).step_band == [bands[32][0], bands[32][1]]
    assert out.for_batch(64).step_band == out.for_batch(32).step_band        # the regime holds up to the next
    assert list(out.for_batch(8).step_band) == list(prof.for_batch(8).step_band)   # unmeasured: unchanged
    cov = band.coverage(rows, out)
    for b in (1, 32):
        inside, n = cov[b]
        assert inside >= 0.9 * n


def test_a_plans_band_is_the_profiles_measured_one():
    cfg = load_config("tiny-llama")
    prof = HardwareProfile.load("h200_v36_cal")
    prof = replace(prof, num_sms=8, regimes={**prof.regimes, "1": {**prof.regimes["1"], "step_band": [-0.05, 0.2]}})
    p = candidates(cfg, batch=1, context=64, prof=prof, families=("mono",))[0]
    assert abs(p.band[0] - 0.95 * p.predicted_us) < 1e-6 and abs(p.band[1] - 1.2 * p.predicted_us) < 1e-6


def test_bands_of_a_profile_with_a_simulator_term_need_resimulated_rows():
    """band.py --resimulate (session 35): a profile that changes the simulator itself (h200_v43's
    tc_pass_us_by_rows) must re-plan the rows before measuring its band; re-pricing alone reuses the measuring
    run's simulated makespans. Rows planned under v42, 'measured' at the price a term profile gives the same plans:
    re-priced under the term profile their megakernel plans still miss; re-simulated they are exact."""
    from mpk_runtime.planner.score import resimulate
    base = HardwareProfile.load("h200_v42")
    term = replace(base, regimes={**base.regimes, "32": {**base.regimes["32"],
                                                         "tc_pass_us_by_rows": {"8": 5.0, "16": 9.0, "32": 20.0}}})
    cfg = load_config("tiny-llama")
    truth = {p.name: p for p in candidates(cfg, batch=32, context=64, prof=term)}
    rows = []
    for p in candidates(cfg, batch=32, context=64, prof=base):
        t = truth[p.name]
        rows.append(dict(model="tiny-llama", batch=32, tp=1, context=64, attn_splits=p.attn_splits,
                         attn_wide_passes=True, plan=p.name, predicted_us=p.predicted_us, measured_us=t.predicted_us,
                         segments=[dict(kind=s.kind, ops=len(s.ops), first_op=s.ops[0], predicted_us=s.predicted_us,
                                        features=s.features, measured_us=ts.predicted_us)
                                   for s, ts in zip(p.segments, t.segments)]))
    assert any(r["plan"] == "mono" and r["measured_us"] > r["predicted_us"] * 1.001 for r in rows)
    repriced = band.rel_errors(rows, term)[32]
    resim = band.rel_errors(resimulate(rows, term, procs=1), term)[32]
    assert len(resim) == len(rows) and max(abs(e) for e in resim) < 1e-3
    assert max(abs(e) for e in repriced) > 1e-3
