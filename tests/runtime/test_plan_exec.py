"""Every candidate plan the planner produces runs and computes the same step as the reference: one
megakernel, several, per-layer, attention-conventional, all-conventional; TP 1 and 2."""
import pytest
import torch

from mpk_runtime.ir import build_graph
from mpk_runtime.models import PRESETS
from mpk_runtime.planner import Plan, candidates
from mpk_runtime.runtime.memory import RankMemory, connect
from mpk_runtime.runtime.plan_exec import PlanExecutor
from tests.runtime.test_pyvm import STEPS, setup


@pytest.mark.parametrize("tp", [1, 2])
def test_all_candidate_plans_match_reference(tp):
    cfg = PRESETS["tiny-qwen3"]
    grp, lens, tables, ref_logits, toks = setup(cfg, tp, 4)
    plans = candidates(cfg.replace(dtype="float32"), tp=tp, batch=4, context=16)
    assert {"mono", "mega2", "mega3", "attn-conv", "attn-mk", "conventional"} <= {p.name for p in plans}
    graphs = grp.graphs("decode", 4, 1)
    for plan in plans:
        plan = Plan.from_json(plan.to_json())  # plans travel as JSON (controller -> workers)
        for s in plan.segments:
            s.tiling.update(num_sms=4, linear_cols=16)
        mems = grp._mems(graphs)
        ex = PlanExecutor(plan, graphs, mems, backend="pyvm", seed=3)
        check_steps(ex, grp, mems, lens, tables, ref_logits, toks, plan.name)


def check_steps(ex, grp, mems, lens, tables, ref_logits, toks, label):
    """STEPS decode steps of the executor against the reference's logits (fp32) and greedy tokens."""
    for s in range(STEPS):
        for m in mems:
            m.t("tokens").copy_(toks[s])
        ex.run(lambda r: grp.ctx([n + s for n in lens], tables, 1))
        got = torch.cat([m.t("logits") for m in mems], -1)
        err = ((got - ref_logits[s]).abs().max() / ref_logits[s].abs().max()).item()
        assert err < 1e-5, (label, s, err)
        assert torch.equal(mems[0].t("next_tokens"), toks[s + 1]), (label, s)


def test_plan_must_cover_the_graph():
    cfg = PRESETS["tiny-llama"]
    plan = candidates(cfg, batch=1, context=16, families=("mega2",))[0]
    plan.segments = plan.segments[:1]
    g = build_graph(cfg, batch=1, context_len=16, max_seq_len=32)
    with pytest.raises(ValueError, match="exactly once"):
        PlanExecutor(plan, [g], [None])


@pytest.mark.parametrize("family", ["attn-mk", "conventional", "attn-conv"])
def test_conventional_segments_of_a_step_share_its_per_step_values(family, monkeypatch):
    """Row positions (and the RoPE tables, KV slots and masks built from them) are computed once per step however
    many conventional segments the plan has (attn-mk: one per layer): on a GPU each recomputation is ~10 small
    kernels (~30-50 us measured per segment at batch 1 before the sharing). Eager per-segment units (timing)
    share them the same way and compute the same step as run(). (The gather + SDPA attention's values: under
    TRITON_INTERPRET=1 the paged kernel would take the attention and need no masks.)"""
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")
    from mpk_runtime.runtime import conventional_ops
    cfg = PRESETS["tiny-llama"]
    grp, lens, tables, ref_logits, toks = setup(cfg, 1, 2)
    plan = candidates(cfg.replace(dtype="float32"), tp=1, batch=2, context=16, families=(family,))[0]
    n_conv = sum(s.kind == "conventional" for s in plan.segments)
    assert n_conv == {"attn-mk": cfg.num_layers + 1, "conventional": 1, "attn-conv": cfg.num_layers}[family]
    for s in plan.segments:
        s.tiling.update(num_sms=4, linear_cols=16)
    graphs = grp.graphs("decode", 2, 1)
    mems = grp._mems(graphs)
    ex = PlanExecutor(plan, graphs, mems, backend="pyvm", seed=3)
    calls = []   # per-step values computed: row positions (qkv_rope), attention's pages and masks
    real_rows, real_attn = conventional_ops.row_positions, conventional_ops._attn_step

    def attn_step(cache, ctx, g, dtype, dev):
        if ("attn", g, dtype) not in cache:
            calls.append("attn")
        return real_attn(cache, ctx, g, dtype, dev)
    monkeypatch.setattr(conventional_ops, "row_positions", lambda ctx: calls.append("rows") or real_rows(ctx))
    monkeypatch.setattr(conventional_ops, "_attn_step", attn_step)
    once = {"attn-mk": ["rows"], "conventional": ["attn", "rows"], "attn-conv": ["attn"]}[family]
    ctx = grp.ctx(lens, tables, 1)
    for m in mems:
        m.t("tokens").copy_(toks[0])
    ex.run(lambda r: ctx)
    assert sorted(calls) == once, (family, calls)
    got = mems[0].t("logits").clone()
    assert ((got - ref_logits[0]).abs().max() / ref_logits[0].abs().max()).item() < 1e-5
    calls.clear()
    for m in mems:                           # the same step again (same pos: rewrites the same KV slots)
        m.t("tokens").copy_(toks[0])
    for unit in ex.eager_units([ctx]):
        unit()
    assert sorted(calls) == once and torch.equal(mems[0].t("logits"), got)


@pytest.mark.parametrize("family", ["attn-mk", "conventional"])
def test_sampled_steps_run_the_argmax_as_a_megakernel(family):
    """A plan whose argmax op is conventional runs steps with sampled rows through a variant where the argmax is a
    megakernel of its own (the conventional sampler is ~340 small kernels on a GPU); greedy steps (StepCtx.greedy)
    run the plan as it is. Both draw what the one-megakernel plan draws: the sampling contract is the same token
    on every executor and tiling (ir/sampling.py)."""
    import dataclasses
    cfg = PRESETS["tiny-llama"]
    grp, lens, tables, ref_logits, toks = setup(cfg, 1, 3)
    graphs = grp.graphs("decode", 3, 1)
    drawn = {}
    for name in ("mono", family):
        plan = candidates(cfg.replace(dtype="float32"), tp=1, batch=3, context=16, families=(name,))[0]
        for s in plan.segments:
            s.tiling.update(num_sms=4, linear_cols=16)
        mems = grp._mems(graphs)
        ex = PlanExecutor(plan, graphs, mems, backend="pyvm", seed=3)
        if name != "mono":
            kinds = [k for k, _ in ex.segments_for(False)]
            assert kinds[-1] == "megakernel" and [k for k, _ in ex.segments_for(True)][-1] == "conventional"
            assert ex.segments_for(False)[:-2] == ex.segments[:-1]     # the other segments are the same executors
        m = mems[0]
        m.t("sample.temperature").copy_(torch.tensor([0.0, 0.8, 1.3]))
        m.t("sample.top_k").copy_(torch.tensor([0, 20, 5]))
        m.t("sample.top_p").copy_(torch.tensor([1.0, 0.9, 1.0]))
        m.t("sample.seed").copy_(torch.tensor([0, 11, -5]))
        out = []
        for s in range(3):
            m.t("tokens").copy_(toks[s])
            ctx = grp.ctx([n + s for n in lens], tables, 1)
            ex.run(lambda r: ctx)
            out.append(m.t("next_tokens").clone())
            assert torch.equal(out[-1][0], toks[s + 1][0]), (name, s)   # the greedy row: the reference token
        drawn[name] = out
        if name != "mono":   # a greedy step (greedy rows only) through the plan's own conventional argmax
            m.t("sample.temperature").zero_()
            m.t("tokens").copy_(toks[0])
            ctx = dataclasses.replace(grp.ctx(lens, tables, 1), greedy=True)
            ex.run(lambda r: ctx)
            assert torch.equal(m.t("next_tokens"), toks[1])
    assert all(torch.equal(a, b) for a, b in zip(drawn["mono"], drawn[family])), drawn
    assert any(not torch.equal(d[1:], t[1:]) for d, t in zip(drawn["mono"], toks[1:])), "no row sampled off-greedy"
