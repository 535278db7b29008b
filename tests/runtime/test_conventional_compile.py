"""The compiled conventional executor (torch.compile of ConventionalExecutor.run, MPK_CONV_COMPILE=1 for plan
segments) against the eager one: the same greedy tokens, logits within bf16 tolerance, every segment of a split step
compiled (none left eager by Dynamo's recompile limit), and nothing compiled again once warm. CPU (Inductor's C++
backend); the GPU run times it."""
from __future__ import annotations

import pytest
import torch

from mpk_runtime.runtime.torch_exec import ConventionalExecutor, compile_segments
from mpk_runtime.tasks.ops import argmax as argmax_ops

from test_conventional_op_count import build


def test_compile_segments_flag(monkeypatch):
    monkeypatch.setenv("MPK_CONV_COMPILE", "1")
    assert compile_segments()
    monkeypatch.setenv("MPK_CONV_COMPILE", "yes")
    with pytest.raises(ValueError, match="MPK_CONV_COMPILE"):
        compile_segments()


def test_compiled_segments_match_eager(monkeypatch):
    """(Inductor C++ compile on the CPU: ~25 s.)"""
    import torch._dynamo.utils as du
    monkeypatch.setattr(argmax_ops, "host_syncs_ok", lambda dev: False)   # the GPU branches: no host syncs
    cfg, g, mem, eager, ctx = build("tiny-llama", 3, greedy=True)
    tok0 = mem.t("tokens").clone()
    eager.run([ctx])
    ref_tok, ref_logits = mem.t("next_tokens").clone(), mem.t("logits").float().clone()
    # the step cut in two after layer 0's attention (as an attention-megakernel plan cuts it), each part compiled
    names = [op.name for op in g.ops]
    cut = names.index("L0.attention") + 1
    segs = [ConventionalExecutor([g.subgraph(part)], [mem], compile=True) for part in (names[:cut], names[cut:])]
    torch._dynamo.reset()
    graphs = []
    for i in range(3):
        mem.t("tokens").copy_(tok0)
        steps = segs[0].new_step()
        for s in segs:
            s.run([ctx], steps)
        graphs.append(du.counters["stats"]["unique_graphs"])
        assert torch.equal(mem.t("next_tokens"), ref_tok), i
        err = (mem.t("logits").float() - ref_logits).abs().max() / ref_logits.abs().max()
        assert err < 0.03, (i, float(err))
    assert graphs[0] >= 2 and graphs[2] == graphs[1], graphs   # both segments compiled; warm: no new graphs
