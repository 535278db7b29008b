"""The fast prediction path gives the same numbers as the slow one.

* `simulate` (flat tables, streaming heap) == `simulate_reference` (the original event loop), start times too;
* candidates() == predictions recorded by the full simulation (data/pred_ref_tc.json; re-recorded for the
  Tensor Core linear model, was pred_ref_d11eed4.json from before the speed work);
* segments extrapolated from short simulations == the full simulation of the segment.
"""
import json
import os

import pytest

from mpk_runtime.ir import build_graph
from mpk_runtime.models import PRESETS
from mpk_runtime.planner import HardwareProfile, candidates, simulate
from mpk_runtime.planner.simulate_ref import simulate_reference
from mpk_runtime.tasks import Tiling, build_task_graphs

REF = os.path.join(os.path.dirname(__file__), "data", "pred_ref_tc.json")


@pytest.mark.parametrize("name,tp,batch,sms,profile", [
    ("tiny-qwen3", 2, 2, 6, "h200_measured"), ("tiny-llama", 1, 8, 132, "h200_measured"),
    ("tiny-qwen3", 4, 3, 8, "h200"), ("tiny-qwen3", 2, 64, 132, "h200_measured")])
def test_fast_simulator_matches_reference(name, tp, batch, sms, profile):
    prof = HardwareProfile.load(profile).for_batch(batch)
    gs = [build_graph(PRESETS[name], batch=batch, context_len=64, tp=tp, rank=r, attn_splits=2) for r in range(tp)]
    tgs = build_task_graphs(gs, Tiling(num_sms=sms))
    for steps in (1, 2):
        a = simulate_reference(tgs, prof, steps=steps, record=True)
        b = simulate(tgs, prof, steps=steps, record=True)
        assert b.makespan_us == pytest.approx(a.makespan_us, rel=1e-12, abs=0)
        assert b.per_rank_us == pytest.approx(a.per_rank_us, rel=1e-12, abs=0)
        assert b.stream_bytes == a.stream_bytes
        assert b.busy_fraction == pytest.approx(a.busy_fraction, rel=1e-12)
        assert a.start.keys() == b.start.keys() and a.end.keys() == b.end.keys()
        assert max(abs(a.start[k] - b.start[k]) for k in a.start) <= 1e-9 * a.makespan_us
        assert max(abs(a.end[k] - b.end[k]) for k in a.end) <= 1e-9 * a.makespan_us


def _point(d, **kw):
    cfg = PRESETS[d["model"]].replace(num_layers=d["num_layers"])
    return candidates(cfg, tp=d["tp"], batch=d["batch"], context=d["context"],
                      prof=HardwareProfile.load(d["profile"]), **kw)


def test_predictions_unchanged_vs_recorded(monkeypatch):
    """Recorded with the full simulation (extrapolate=False). A deliberate change of the cost model re-records
    them (run candidates() on these points and rewrite the JSON) and says so in its commit. Re-recorded in
    session 3 for the Tensor Core linear model + refit h200_measured (was pred_ref_d11eed4.json, the speed work's
    reference, recorded before it with the CUDA-core row_tile model). Recorded with the KV appends in qkv_rope
    (MPK_KV_DEFER=0); the deferred appends' price is the exact credit tests/runtime/test_kv_defer.py checks. And
    with a normed model's batch-1/2 qkv in head parts (MPK_QKV_FLAT=0, the default before session 32): a task-graph
    switch, not a cost-model change; the other tests here simulate the flat tiles' graphs. Likewise with the
    qk_norm_rope tasks (MPK_ATTN_QKNORM=0, the default before session 33), and with the greedy argmax's fp32 logits
    copy (MPK_CONV_BF16_ARGMAX=0, the default before session 43: cost.logits_copy_saved_us)."""
    monkeypatch.setenv("MPK_CONV_BF16_ARGMAX", "0")
    monkeypatch.setenv("MPK_KV_DEFER", "0")
    monkeypatch.setenv("MPK_QKV_FLAT", "0")
    monkeypatch.setenv("MPK_ATTN_QKNORM", "0")
    ref = json.load(open(REF))
    extrapolated = 0
    for d in ref["points"]:
        plans = _point(d)
        got = {p.name: p for p in plans}
        assert set(got) == set(d["predicted_us"]), d
        for name, (total, segs) in d["predicted_us"].items():
            assert got[name].predicted_us == pytest.approx(total, rel=1e-9, abs=0), (d["model"], d["batch"], name)
            assert [s.predicted_us for s in got[name].segments] == pytest.approx(segs, rel=1e-9, abs=0)
        extrapolated += plans[0].notes["extrapolated_segments"]
    assert extrapolated > 0   # the recorded points do exercise the extrapolation


def test_extrapolated_segments_equal_full_simulation():
    d = {"model": "tiny-qwen3", "num_layers": 12, "tp": 2, "batch": 8, "context": 64, "profile": "h200_measured"}
    fast, full = _point(d), _point(d, extrapolate=False)
    assert fast[0].notes["extrapolated_segments"] > 0 and full[0].notes["extrapolated_segments"] == 0
    f = {p.name: p for p in full}
    for p in fast:
        assert p.predicted_us == pytest.approx(f[p.name].predicted_us, rel=1e-9, abs=0), p.name
        for a, b in zip(p.segments, f[p.name].segments):
            assert a.ops == b.ops and a.features["kind"] == b.features["kind"]
            assert a.predicted_us == pytest.approx(b.predicted_us, rel=1e-9, abs=0)


def test_tc_pass_term_is_serial_per_pass_and_the_same_in_both_simulators():
    """profile.tc_pass_us_by_rows (session 34, no default profile sets it): a Tensor Core linear tile's fixed part
    gains tc_pass_us(tc_rows) once per pass (CUDA-core tiles and other kinds unchanged), and the fast simulator
    still equals the reference one with it set."""
    from dataclasses import replace

    from mpk_runtime.planner.simulate import cost_key, linear_passes, task_serial_us
    base = HardwareProfile.load("h200_v42").for_batch(32)
    prof = replace(base, tc_pass_us_by_rows={"8": 1.5, "16": 4.0, "32": 10.0})
    g = build_graph(PRESETS["tiny-llama"], batch=32, context_len=64, attn_splits=2)
    tg = build_task_graphs([g], Tiling(num_sms=16))[0]
    seen = set()
    for t in tg.tasks:
        extra = task_serial_us(t, prof) - base.fixed_us(cost_key(t))
        rows, passes = linear_passes(t) if t.kind == "linear" else (0, 0)
        assert extra == pytest.approx(passes * {8: 1.5, 16: 4.0, 32: 10.0}.get(rows, 0.0) if rows else 0.0)
        seen.add(rows)
    assert seen - {0}, "no Tensor Core tile at batch 32"
    a = simulate_reference([tg], prof, steps=2, record=True)
    b = simulate([tg], prof, steps=2, record=True)
    assert b.makespan_us == pytest.approx(a.makespan_us, rel=1e-12, abs=0)
    assert b.makespan_us > simulate([tg], base, steps=2).makespan_us
