"""CUDA-graph replay of a plan step (PlanExecutor.capture) computes what the eager step computes (GPU only).

Whole-step graphs (megakernel launches captured, counters zeroed and the step run as step 1 inside the graph)
and per-segment graphs, for one megakernel, attention-conventional and all-conventional plans; the graph is
replayed twice with pos / tokens updated in place between replays (the graph must stay valid across steps)."""
import pytest
import torch

from mpk_runtime.ir import build_graph
from mpk_runtime.models import PRESETS, random_weights
from mpk_runtime.models.reference import rope_inv_freq
from mpk_runtime.planner import candidates
from mpk_runtime.runtime.memory import KVStore, RankMemory, StepCtx
from mpk_runtime.runtime.plan_exec import PlanExecutor

pytestmark = pytest.mark.gpu


def _rig(cfg, B=2, context=24, ps=16):
    dev = "cuda"
    w = random_weights(cfg, seed=0, device=dev)
    max_seq = context + 16
    pps = -(-max_seq // ps)
    g = build_graph(cfg, batch=B, context_len=context, max_seq_len=max_seq, attn_splits=2)
    kv = KVStore(cfg.num_layers, B * pps + 1, ps, g.tensors["L0.k_cache"].shape[1], cfg.head_dim,
                 w["model.norm.weight"].dtype, device=dev, poison=False)
    gen = torch.Generator(device=dev).manual_seed(0)
    for c in kv.k + kv.v:
        c.normal_(0, 1.0, generator=gen)
    mem = RankMemory(g, w, kv, device=dev)
    tables = ((torch.arange(B * pps) + 1).view(B, pps)).to(dev)
    pos = torch.full((B,), context, dtype=torch.int64, device=dev)
    inv = rope_inv_freq(cfg).to(dev)
    ctx = StepCtx(cfg, 1, pos, tables, ps, 1, inv, kv_len_cap=max_seq)

    def make_mk(tg, m):
        from mpk_runtime.runtime.megakernel import Megakernel
        return Megakernel(tg, m, page_size=ps, block_tables=tables, pos=pos, inv_freq=inv.cpu(), head_dim=cfg.head_dim)
    return g, mem, pos, ctx, make_mk


def _plan(cfg, B, context, family):
    plan = candidates(cfg, batch=B, context=context, families=(family,))[0]
    for s in plan.segments:
        s.tiling.update(num_sms=16)
    return plan


def _step(ex, mem, pos, ctx, tok, position):
    """One step at `position` with tokens `tok` (inputs updated in place); its logits and next tokens."""
    mem.t("tokens").copy_(tok)
    pos.fill_(position)
    ex.run(lambda r: ctx)
    torch.cuda.synchronize()
    for mk in ex.megakernels():
        mk.check()
    return mem.t("logits").clone(), mem.t("next_tokens").clone()


@pytest.mark.parametrize("mode", ["step", "segments"])
@pytest.mark.parametrize("family", ["mono", "attn-conv", "conventional"])
def test_graph_replay_matches_eager(family, mode):
    cfg = PRESETS["tiny-llama"].replace(dtype="bfloat16")
    B, context = 2, 24
    plan = _plan(cfg, B, context, family)
    g, mem, pos, ctx, make_mk = _rig(cfg, B, context)
    ex = PlanExecutor(plan, [g], [mem], backend="megakernel", make_megakernel=make_mk, check=False)
    toks = [torch.tensor([3, 7], device="cuda"), torch.tensor([11, 5], device="cuda")]
    # eager reference: two steps at positions context, context + 1
    want = [_step(ex, mem, pos, ctx, t, context + s) for s, t in enumerate(toks)]
    mem.t("tokens").copy_(toks[0])
    pos.fill_(context)
    ex.capture(lambda r: ctx, mode=mode, warmup=1)
    for s, t in enumerate(toks):   # the same steps replayed, inputs updated in place
        got, got_nt = _step(ex, mem, pos, ctx, t, context + s)
        lg, nt = want[s]
        err = ((got - lg).abs().max() / lg.abs().max()).item()
        assert err < 1e-3, (family, mode, s, err)
        assert torch.equal(got_nt, nt), (family, mode, s)
    other = StepCtx(cfg, 1, pos.clone(), ctx.block_tables, ctx.page_size, 1, ctx.inv_freq, ctx.kv_len_cap)
    with pytest.raises(ValueError, match="captured StepCtx"):
        ex.run(lambda r: other)


@pytest.mark.parametrize("family", ["mono", "attn-mk"])
def test_programmatic_dependent_launches_match_plain_ones(family, monkeypatch):
    """MPK_MK_PDL=1 (runtime/megakernel.py launch_config, megakernel.cu griddepcontrol.wait): each megakernel may
    start while the kernel before it drains; eager and whole-step graph replays (counters zeroed at the graph's
    start, not just before each launch) compute what plain launches compute (a launch that read its inputs before
    the previous kernel wrote them would see the step before's activations)."""
    cfg = PRESETS["tiny-llama"].replace(dtype="bfloat16")
    B, context = 2, 24
    plan = _plan(cfg, B, context, family)
    toks = [torch.tensor([3, 7], device="cuda"), torch.tensor([11, 5], device="cuda")]
    got = {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("MPK_MK_PDL", pdl)
        g, mem, pos, ctx, make_mk = _rig(cfg, B, context)
        ex = PlanExecutor(plan, [g], [mem], backend="megakernel", make_megakernel=make_mk, check=False)
        assert all(mk.pdl == (pdl == "1") for mk in ex.megakernels())
        out = []
        for graphed in (False, True):
            if graphed:
                mem.t("tokens").copy_(toks[0])
                pos.fill_(context)
                ex.capture(lambda r: ctx, mode="step", warmup=1)
            out += [_step(ex, mem, pos, ctx, t, context + s) for s, t in enumerate(toks)]
        got[pdl] = out
    for i, ((a, ta), (b, tb)) in enumerate(zip(got["0"], got["1"])):
        err = ((a - b).abs().max() / a.abs().max()).item()
        assert err < 1e-3 and torch.equal(ta, tb), (family, i, err)


def test_an_eager_step_after_a_capture_that_never_replayed_is_right():
    """After capture() the captured launches have set each megakernel's host step to 1 while its counters hold the
    warm-up's values; an eager step then (a failed capture's fallback: drop_graphs, run eagerly) must start afresh,
    not pass its waits on the stale counts."""
    cfg = PRESETS["tiny-llama"].replace(dtype="bfloat16")
    B, context = 2, 24
    plan = _plan(cfg, B, context, "mono")
    g, mem, pos, ctx, make_mk = _rig(cfg, B, context)
    ex = PlanExecutor(plan, [g], [mem], backend="megakernel", make_megakernel=make_mk, check=False)
    toks = torch.tensor([3, 7], device="cuda")
    for _ in range(3):   # eager steps at one position: the host step and the counters move to 3 (the tokens are
        #                  set before each: a greedy step writes its next tokens into them)
        want, _ = _step(ex, mem, pos, ctx, toks, context)
    ex.capture(lambda r: ctx, mode="step", warmup=1)
    ex.drop_graphs()
    mem.t("logits").fill_(0)
    got, _ = _step(ex, mem, pos, ctx, toks, context)
    assert torch.equal(got, want)
