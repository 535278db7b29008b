"""planner/trace_fit.py: per-cost-key task costs recovered from traced durations, on synthetic traces whose
durations come from known terms (the ground truth is the generator, not the fit), and the simulator's
Tensor Core key."""
import pytest

from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.planner.profile import HardwareProfile
from mpk_runtime.planner.simulate import cost_key, simulate
from mpk_runtime.planner.trace_fit import fit_task_costs, merge_points, task_points
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling

FAIR = 4.55e12 / 132 / 1e6   # bytes per us per SM
TRUE_FIXED = {"linear": 3.0, "linear@tc": 5.0, "linear@tc2": 6.5, "qkv_rope": 4.0, "qkv_rope@tc": 6.0, "attn_partial": 7.0,
              "attn_partial@w2": 6.0, "attn_merge": 2.0, "embed": 1.5, "argmax_partial": 2.5, "argmax_reduce": 2.0,
              "qk_norm_rope": 2.2}
TRUE_EFF = {"linear": 0.7, "linear@tc": 0.5, "linear@tc2": 0.4, "qkv_rope": 0.6, "qkv_rope@tc": 0.45, "attn_partial": 0.3,
            "attn_partial@w2": 0.35}


def _graph(model, B, ctx=512, S=2):
    g = build_graph(load_config(model), mode="decode", batch=B, context_len=ctx, max_seq_len=ctx + 24,
                    attn_splits=S, dtype="bfloat16")
    return build_task_graphs([g], Tiling(num_sms=16))[0]


def _trace(tg, step=1):
    """A Chrome trace of one step whose durations follow TRUE_FIXED + bytes / (TRUE_EFF x fair share)."""
    ev = []
    for t in tg.tasks:
        k = cost_key(t)
        dur = TRUE_FIXED[k] + (t.est_bytes / (TRUE_EFF[k] * FAIR) if k in TRUE_EFF else 0.0)
        ev.append({"name": t.kind, "cat": t.op, "ph": "X", "ts": 0.0, "dur": dur, "pid": 0, "tid": t.sm,
                   "args": {"label": t.label(), "step": step}})
    return ev


def test_cost_key_separates_tensor_core_tiles():
    keys1 = {cost_key(t) for t in _graph("tiny-llama", 1).tasks}
    keys8 = {cost_key(t) for t in _graph("tiny-llama", 8).tasks}
    assert "linear" in keys1 and "linear@tc" not in keys1 and "qkv_rope@tc" not in keys1
    assert "linear@tc" in keys8 and "qkv_rope@tc" in keys8 and "linear@tc2" in keys8   # gate_up: two weights
    assert all(len(t.params["weights"]) == 2 for t in _graph("tiny-llama", 8).tasks if cost_key(t) == "linear@tc2")


def test_cost_key_fallbacks():
    from mpk_runtime.planner.profile import HardwareProfile, key_fallbacks
    assert key_fallbacks("linear@tc2") == ["linear@tc2", "linear@tc", "linear"]
    assert key_fallbacks("qkv_rope@tc") == ["qkv_rope@tc", "qkv_rope"]
    assert key_fallbacks("embed") == ["embed"]
    from dataclasses import replace
    p = replace(HardwareProfile.load("h200_measured"), task_fixed_us_by_kind={"linear": 3.0, "linear@tc": 5.0})
    assert p.fixed_us("linear@tc2") == 5.0 and p.fixed_us("linear@tc") == 5.0 and p.fixed_us("linear") == 3.0


def test_fit_recovers_the_terms_that_made_the_trace():
    pts = merge_points(*(task_points(_trace(tg), tg) for tg in
                         (_graph("tiny-llama", 1), _graph("tiny-llama", 8), _graph("tiny-qwen3", 1, 256, 4),
                          _graph("tiny-qwen3", 8))))
    fixed, eff, fl = fit_task_costs(pts, FAIR)
    assert {"linear", "linear@tc", "linear@tc2", "qkv_rope@tc"} <= set(fixed)
    for k, xy in pts.items():   # every key: the fitted terms reproduce the durations
        for b, f, y in xy:
            pred = fixed[k] + b / (eff[k] * FAIR) * (eff[k] < 1.0 or k in TRUE_EFF) + f * fl[k]
            assert pred == pytest.approx(y, rel=0.05), k   # collinear bytes / flops (qkv_rope) split the slope
    # where bytes vary independently of flops the terms themselves are identified
    for k in ("linear", "linear@tc", "linear@tc2"):
        assert fixed[k] == pytest.approx(TRUE_FIXED[k], abs=0.05), k
        assert eff[k] == pytest.approx(TRUE_EFF[k], rel=0.02), k


def test_trace_of_another_graph_is_refused():
    tg1, tg8 = _graph("tiny-llama", 1), _graph("tiny-qwen3", 8)
    with pytest.raises(ValueError, match="does not match the task graph"):
        task_points(_trace(tg8), tg1)


def test_profiles_without_tc_keys_price_as_before():
    """A profile fitted before the "@tc" keys (h200_measured) falls back to the kind: Tensor Core tiles get the
    kind's fixed cost, and a fitted "@tc" term changes only those tiles."""
    base = HardwareProfile.load("h200_measured")
    tg = _graph("tiny-llama", 8)
    assert base.fixed_us("linear@tc") == base.fixed_us("linear")
    t0 = simulate([tg], base).makespan_us
    slower = HardwareProfile(**{**base.__dict__, "task_fixed_us_by_kind": {**base.task_fixed_us_by_kind,
                                                                          "linear@tc": 50.0}})
    assert simulate([tg], slower).makespan_us > t0 + 40
    tg1 = _graph("tiny-llama", 1)   # batch 1: no Tensor Core tile, unchanged
    assert simulate([tg1], slower).makespan_us == pytest.approx(simulate([tg1], base).makespan_us)
