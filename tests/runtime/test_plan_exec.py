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
        for s in range(STEPS):
            for m in mems:
                m.t("tokens").copy_(toks[s])
            ex.run(lambda r: grp.ctx([n + s for n in lens], tables, 1))
            got = torch.cat([m.t("logits") for m in mems], -1)
            err = ((got - ref_logits[s]).abs().max() / ref_logits[s].abs().max()).item()
            assert err < 1e-5, (plan.name, s, err)
            assert torch.equal(mems[0].t("next_tokens"), toks[s + 1]), plan.name


def test_plan_must_cover_the_graph():
    cfg = PRESETS["tiny-llama"]
    plan = candidates(cfg, batch=1, context=16, families=("mega2",))[0]
    plan.segments = plan.segments[:1]
    g = build_graph(cfg, batch=1, context_len=16, max_seq_len=32)
    with pytest.raises(ValueError, match="exactly once"):
        PlanExecutor(plan, [g], [None])
