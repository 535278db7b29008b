import dataclasses

import pytest

from mpk_runtime.ir import build_graph
from mpk_runtime.models import PRESETS
from mpk_runtime.planner import HardwareProfile, Plan, candidates, simulate
from mpk_runtime.planner.categories import classify
from mpk_runtime.tasks import Tiling, build_task_graphs
from mpk_runtime.tasks.graph import Event, Task, TaskGraph


def flat_profile(**kw) -> HardwareProfile:
    """A profile with round numbers: 1 MB/us per SM whatever the SM count, 1 us fixed, 0.5 us sync."""
    p = HardwareProfile.load("h200")
    return dataclasses.replace(p, num_sms=2, hbm_bw_by_sms={"1": 1e12, "2": 2e12}, task_fixed_us=1.0,
                               sync_us=0.5, task_fixed_us_by_kind={}, stream_eff_by_kind={}, **kw)


def chain_graph(sms: list[int], nbytes: int = 1_000_000) -> TaskGraph:
    """t0 -> t1 -> t2 ..., each waiting on its predecessor, placed on the given SMs."""
    tasks, events = [], []
    for i, sm in enumerate(sms):
        t = Task(i, 0, "linear", "x", {}, [], [], est_bytes=nbytes, est_flops=0, sm=sm)
        if i:
            events.append(Event(i - 1, 0, 1, [(0, i - 1)]))
            tasks[i - 1].signals.append((0, i - 1))
            t.waits.append((i - 1, 0))
        tasks.append(t)
    lists = [[t.id for t in tasks if t.sm == s] for s in range(2)]
    for l in lists:
        for k, tid in enumerate(l):
            tasks[tid].order = k
    return TaskGraph(0, 1, 2, tasks, events, lists)


def test_simulator_chain_costs_add_up():
    prof = flat_profile()
    # same SM: each task 1 us fixed + 1 MB / 1 MB/us; the signal still takes sync_us to become visible
    r = simulate([chain_graph([0, 0, 0])], prof)
    assert r.makespan_us == pytest.approx(3 * 2.0 + 2 * 0.5)
    r = simulate([chain_graph([0, 1, 0])], prof)
    assert r.makespan_us == pytest.approx(3 * 2.0 + 2 * 0.5)


def test_simulator_shares_bandwidth():
    prof = flat_profile()
    two = TaskGraph(0, 1, 2, [Task(0, 0, "linear", "x", {}, [], [], est_bytes=2_000_000, sm=0, order=0),
                              Task(1, 0, "linear", "x", {}, [], [], est_bytes=2_000_000, sm=1, order=0)],
                    [], [[0], [1]])
    assert simulate([two], prof).makespan_us == pytest.approx(1 + 2)      # 2 SMs, 2 MB/us total: no contention
    slow = dataclasses.replace(prof, hbm_bw_by_sms={"1": 1e12, "2": 1e12})  # saturated: 0.5 MB/us each
    assert simulate([two], slow).makespan_us == pytest.approx(1 + 4)
    half = dataclasses.replace(prof, stream_eff_by_kind={"linear": 0.5})
    assert simulate([two], half).makespan_us == pytest.approx(1 + 4)


def test_real_graph_prediction_is_above_the_floor():
    cfg = PRESETS["llama-3.2-1b"]
    prof = HardwareProfile.load("h200")
    tgs = build_task_graphs([build_graph(cfg, batch=1)], Tiling(num_sms=132))
    r = simulate(tgs, prof, record=True)
    floor_us = build_graph(cfg).weight_bytes() / prof.bw(132) * 1e6
    assert floor_us < r.makespan_us < 3 * floor_us
    assert len(r.start) == len(tgs[0].tasks) and 0 < r.busy_fraction <= 1
    assert len(r.to_chrome_trace(tgs)) == len(tgs[0].tasks)


def test_candidates_and_plan_json():
    cfg = PRESETS["tiny-qwen3"]
    plans = candidates(cfg, tp=2, batch=2, context=64)
    names = [p.name for p in plans]
    assert {"mono", "mega2", "mega3", "attn-conv", "conventional"} <= set(names)
    assert plans == sorted(plans, key=lambda p: p.predicted_us)
    g = build_graph(cfg, batch=2, context_len=64, tp=2)
    for p in plans:
        assert [n for s in p.segments for n in s.ops] == [o.name for o in g.ops]
        assert p.band[0] < p.predicted_us < p.band[1]
        assert Plan.from_json(p.to_json()) == p


def test_classify_reports_category_and_features():
    c = classify(PRESETS["tiny-llama"], tp=1, batches=(1, 4), context=64)
    assert c["category"] in ("monolith-stable", "multi-megakernel-stable", "conventional-stable", "crossover")
    assert set(c["best"]) == {1, 4}
    f = c["features"]
    assert f[1]["intensity_ratio"] > f[0]["intensity_ratio"]   # batching raises arithmetic intensity
    assert all(0 < x["launch_share"] < 1 for x in f)


def test_unknown_profile_lists_known():
    with pytest.raises(FileNotFoundError, match="known: .*h200"):
        HardwareProfile.load("a100-nonexistent")


def test_plans_with_a_conventional_argmax_price_their_sampled_steps():
    """A step with sampled rows runs a conventional argmax as a megakernel of its own (PlanExecutor.segments_for):
    such plans carry that step's price beside the greedy one they are ranked by; a plan whose argmax is a megakernel
    already samples on device (no second price)."""
    from mpk_runtime.planner.cost import conventional_us
    cfg = PRESETS["tiny-llama"]
    plans = {p.name: p for p in candidates(cfg, batch=4, context=64, families=("mono", "attn-mk", "conventional"))}
    assert "sampled_us" not in plans["mono"].notes
    g = build_graph(cfg, batch=4, context_len=64, attn_splits=plans["attn-mk"].attn_splits)
    prof = HardwareProfile.load().for_batch(4)
    for name in ("attn-mk", "conventional"):
        p = plans[name]
        greedy_argmax = conventional_us(g, ["argmax"], prof)
        # the greedy step less its conventional argmax, plus a launch gap and an argmax megakernel (> 0)
        assert p.notes["sampled_us"] > p.predicted_us - greedy_argmax + prof.graph_kernel_gap_us, name
        assert p.notes["sampled_us"] < p.predicted_us + 200, name     # a one-op megakernel: tens of us here


def test_the_greedy_bf16_argmax_is_priced_as_the_copy_it_skips(monkeypatch):
    """MPK_CONV_BF16_ARGMAX (the default since session 43): a greedy conventional argmax reads the LM head's bf16
    product, so the step loses the fp32 logits copy (a kernel, 2 + 4 bytes a logit) and half the argmax's reads (2
    bytes a logit). The planner prices exactly that on the argmax op at TP=1 decode, nothing on the megakernel plan,
    nothing at TP=2, and a sampled step (which keeps the copy) the same either way."""
    from mpk_runtime.planner.cost import conventional_features, conventional_us, price_from_features
    cfg = PRESETS["tiny-llama"]
    B = 8
    prof = HardwareProfile.load().for_batch(B)
    g = build_graph(cfg, batch=B, context_len=64, attn_splits=2)
    ops = [o.name for o in g.ops]
    V = g.tensors["logits"].shape[1]
    want = prof.conv_kernel_us + 8 * B * V / (prof.bw(prof.num_sms) * prof.conv_bw_fraction) * 1e6
    got, plans = {}, {}
    for v in ("0", "1"):
        monkeypatch.setenv("MPK_CONV_BF16_ARGMAX", v)
        got[v] = (conventional_us(g, ops, prof), conventional_us(g, ["argmax"], prof))
        f = conventional_features(g, ops, prof)
        assert price_from_features(f, prof) == pytest.approx(got[v][0], rel=1e-8)   # (features round to 1e-7 us)
        plans[v] = {p.name: p for p in candidates(cfg, batch=B, context=64, families=("mono", "conventional"),
                                                  prof=prof)}
        g2 = [build_graph(cfg, batch=B, context_len=64, tp=2, rank=r, attn_splits=2) for r in range(2)]
        got[v + "tp2"] = conventional_us(g2[0], ["argmax"], prof)
    assert got["0"][0] - got["1"][0] == pytest.approx(want, rel=1e-9) and want > prof.conv_kernel_us
    assert got["0"][1] - got["1"][1] == pytest.approx(want, rel=1e-9)                 # all of it on the argmax op
    assert got["0tp2"] == got["1tp2"]
    assert plans["0"]["mono"].predicted_us == plans["1"]["mono"].predicted_us
    assert plans["0"]["conventional"].predicted_us - plans["1"]["conventional"].predicted_us == \
        pytest.approx(want, rel=1e-6)
    assert plans["0"]["conventional"].notes["sampled_us"] == pytest.approx(
        plans["1"]["conventional"].notes["sampled_us"], rel=1e-9)
