"""The conventional path must be capturable in a CUDA graph: no host-to-device copies of Python data
(torch.tensor / as_tensor -> aten.lift_fresh, which a capture refuses unless the source is pinned) and no host
syncs (.item(), bool(tensor) -> aten._local_scalar_dense). Checked on a CPU by recording the aten ops of a
whole all-conventional step (greedy and sampled argmax), with the static key count a GPU run uses.

This is the CPU guard for the bug the first GPU validation hit (conventional plans ran eagerly: 'Cannot copy
between CPU and CUDA tensors during CUDA graph capture'); tests/runtime/test_plan_exec_graph.py is the GPU check."""
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpk_runtime.models import PRESETS
from mpk_runtime.planner import Plan, candidates
from mpk_runtime.runtime.plan_exec import PlanExecutor
from mpk_runtime.tasks.ops import argmax as argmax_ops
from tests.runtime.test_pyvm import setup

FORBIDDEN = {"aten.lift_fresh.default", "aten._local_scalar_dense.default"}


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("greedy", [False, True])
def test_all_conventional_step_has_no_host_copies_or_syncs(monkeypatch, greedy):
    monkeypatch.setattr(argmax_ops, "host_syncs_ok", lambda dev: False)   # take the GPU branches
    monkeypatch.setenv("MPK_CONV_GREEDY_FAST", "1")   # greedy: session 25's greedy partial / merge (the default)
    cfg = PRESETS["tiny-qwen3"]
    grp, lens, tables, _, toks = setup(cfg, 1, 4)
    plan = candidates(cfg.replace(dtype="float32"), tp=1, batch=4, context=16, families=("conventional",))[0]
    plan = Plan.from_json(plan.to_json())
    graphs = grp.graphs("decode", 4, 1)
    mems = grp._mems(graphs)
    ex = PlanExecutor(plan, graphs, mems, backend="pyvm")
    ctx = dataclasses.replace(grp.ctx(lens, tables, 1), kv_len_cap=16, greedy=greedy)   # static key count, as on a GPU
    mems[0].t("tokens").copy_(toks[0])
    ex.run(lambda r: ctx)                                                 # warm-up (lazy init off the record)
    rec = _Record()
    with rec:
        ex.run(lambda r: ctx)
    assert len(rec.ops) > 50, "the step ran no ops under the recorder"
    bad = sorted({o for o in rec.ops if o in FORBIDDEN})
    assert not bad, f"not capturable in a CUDA graph: {bad}"


def test_conventional_segment_without_collectives_at_tp2():
    """A TP>1 conventional segment holding no all-reduce / argmax (attention only, as the attn-conv plans cut
    it) builds: the GPU TP=2 validation of attn-conv failed with KeyError 'allreduce' (07e32f7)."""
    from mpk_runtime.runtime.torch_exec import ConventionalExecutor

    class _Comm:   # one process holds one rank; this segment never calls it
        world_size = 2

        def all_gather(self, t, dim=0):
            raise AssertionError("an attention-only segment has no collective")

    cfg = PRESETS["tiny-qwen3"]
    grp, lens, tables, _, toks = setup(cfg, 2, 4)
    graphs = grp.graphs("decode", 4, 1)
    mems = grp._mems(graphs)
    attn = [o.name for o in graphs[0].ops if o.kind == "attention"][:1]
    ex = ConventionalExecutor([graphs[0].subgraph(attn)], [mems[0]], comm=_Comm())
    assert set(ex.kernels) == {"whole:attention"}


def test_greedy_argmax_at_tp2_gives_the_full_paths_tokens(monkeypatch):
    """The promised-greedy argmax (StepCtx.greedy: each rank's slots get entry 0 only, the merge takes the first
    slot with the largest value) over a vocabulary split between two ranks: the same tokens as the full path."""
    monkeypatch.setenv("MPK_CONV_GREEDY_FAST", "1")   # session 25's greedy partial / merge (the default)
    cfg = PRESETS["tiny-qwen3"]
    out = {}
    for greedy in (False, True):
        grp, lens, tables, _, toks = setup(cfg, 2, 4)
        plan = candidates(cfg.replace(dtype="float32"), tp=2, batch=4, context=16, families=("conventional",))[0]
        graphs = grp.graphs("decode", 4, 1)
        mems = grp._mems(graphs)
        ex = PlanExecutor(Plan.from_json(plan.to_json()), graphs, mems, backend="pyvm")
        ctx = dataclasses.replace(grp.ctx(lens, tables, 1), kv_len_cap=16, greedy=greedy)
        seq = []
        for m in mems:
            m.t("tokens").copy_(toks[0])
        for _ in range(3):   # the argmax feeds the next step's tokens
            ex.run(lambda r: ctx)
            seq.append([m.t("tokens").clone() for m in mems])
        out[greedy] = seq
    for a, b in zip(out[False], out[True]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
        assert torch.equal(b[0], b[1])   # both ranks agree
