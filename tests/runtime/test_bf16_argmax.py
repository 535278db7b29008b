"""MPK_CONV_BF16_ARGMAX: a greedy conventional step whose fp32 logits nobody reads afterwards (StepCtx.greedy and
StepCtx.logits_unread) lets its argmax take the LM head's bf16 product and skips the fp32 logits copy. The tokens
must be the same bits as the default path's; the logits buffer must be left unwritten exactly when the promise is
made, the switch is on and the argmax runs in the same segment; every other step writes the logits as before."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mpk_runtime.planner import candidates
from mpk_runtime.runtime.plan_exec import PlanExecutor
from mpk_runtime.runtime.torch_exec import ConventionalExecutor
from tests.runtime.test_conventional_op_count import _Record, build

SENTINEL = -12345.0


def _step(model, B, vocab, monkeypatch, switch: str, unread: bool, steps: int = 3, dev: str = "cpu"):
    """`steps` greedy conventional decode steps (bf16; on the CPU the eager gather + SDPA attention, on a GPU the
    default one) with the logits buffer set to SENTINEL before each; (tokens of each step, logits after each)."""
    if dev == "cpu":
        monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")
    monkeypatch.setenv("MPK_CONV_BF16_ARGMAX", switch)
    cfg, g, mem, ex, ctx = build(model, B, greedy=True, vocab=vocab, dev=dev)
    ctx = dataclasses.replace(ctx, logits_unread=unread)
    toks, logits = [], []
    for s in range(steps):
        mem.t("logits").fill_(SENTINEL)
        ex.run([dataclasses.replace(ctx, step=s + 1)])
        toks.append(mem.t("next_tokens").clone())
        logits.append(mem.t("logits").clone())
        mem.t("tokens").copy_(mem.t("next_tokens"))
    return toks, logits


CASES = [("tiny-llama", 1, None), ("tiny-llama", 3, 9000), ("tiny-qwen3", 3, None)]


@pytest.mark.parametrize("model,B,vocab", CASES)
def test_unread_logits_keep_the_tokens_and_skip_the_fp32_write(model, B, vocab, monkeypatch, dev="cpu"):
    base_t, base_l = _step(model, B, vocab, monkeypatch, "0", unread=True, dev=dev)
    on_t, on_l = _step(model, B, vocab, monkeypatch, "1", unread=True, dev=dev)
    read_t, read_l = _step(model, B, vocab, monkeypatch, "1", unread=False, dev=dev)
    for s in range(len(base_t)):
        assert torch.equal(on_t[s], base_t[s]) and torch.equal(read_t[s], base_t[s]), (model, B, s)
        assert not (base_l[s] == SENTINEL).any()                 # the default path writes every logit
        assert (on_l[s] == SENTINEL).all()                       # the promise + switch: no fp32 write at all
        assert torch.equal(read_l[s], base_l[s])                 # logits wanted: written, the same bits


@pytest.mark.gpu
@pytest.mark.parametrize("model,B,vocab", CASES + [("tiny-qwen3", 8, 20000)])
def test_unread_logits_keep_the_tokens_and_skip_the_fp32_write_gpu(model, B, vocab, monkeypatch):
    """The same on a GPU (cuBLAS's product, the CUDA max over bf16 against fp32 values, the default attention)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    test_unread_logits_keep_the_tokens_and_skip_the_fp32_write(model, B, vocab, monkeypatch, dev="cuda")


def test_the_promise_alone_or_a_sampled_step_changes_nothing(monkeypatch):
    """Without greedy (a sampled step) or without the switch, the logits are written whatever logits_unread says."""
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")
    monkeypatch.setenv("MPK_CONV_BF16_ARGMAX", "1")
    cfg, g, mem, ex, ctx = build("tiny-llama", 3, greedy=False)
    mem.t("logits").fill_(SENTINEL)
    ex.run([dataclasses.replace(ctx, logits_unread=True)])
    assert not (mem.t("logits") == SENTINEL).any()


def test_only_logits_read_by_an_argmax_in_the_same_segment_qualify(monkeypatch):
    """_argmax_only_outputs: the whole step's executor has the LM head's logits; a segment that ends at the LM head
    (its argmax in another segment, e.g. a megakernel) has none, and neither does one without the LM head."""
    cfg, g, mem, ex, ctx = build("tiny-llama", 3, greedy=True)
    assert ex.bf16_logits == [frozenset({"logits"})]
    names = [o.name for o in g.ops]
    head = ConventionalExecutor([g.subgraph(names[:-1])], [mem])          # everything but the argmax
    tail = ConventionalExecutor([g.subgraph(names[-1:])], [mem])          # the argmax alone
    assert names[-1] == "argmax" and head.bf16_logits == [frozenset()] and tail.bf16_logits == [frozenset()]


def test_one_fewer_copy_a_step(monkeypatch):
    """The step's aten ops with the switch: the same, less the LM head's fp32 copy (the GPU launch it saves)."""
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")
    counts = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("MPK_CONV_BF16_ARGMAX", switch)
        cfg, g, mem, ex, ctx = build("tiny-llama", 3, greedy=True)
        ctx = dataclasses.replace(ctx, logits_unread=True)
        ex.run([ctx])
        rec = _Record()
        with rec:
            ex.run([ctx])
        counts[switch] = [op for _, op in rec.ops]
    removed = list(counts["0"])
    for op in counts["1"]:
        removed.remove(op)
    assert [op.split(".")[1] for op in removed] == ["copy_"], removed


@pytest.mark.parametrize("family", ["conventional", "attn-mk"])
def test_planned_step_under_the_promise(family, monkeypatch):
    """Through PlanExecutor (pyvm backend; bf16): the conventional plan, and attn-mk, whose LM head and argmax share
    its last conventional segment with the megakernels (pyvm) between: the same tokens as the default path, and the
    fp32 logits left unwritten under the promise and the switch."""
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")
    got = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("MPK_CONV_BF16_ARGMAX", switch)
        cfg, g, mem, _, ctx = build("tiny-llama", 3, greedy=True)
        plan = next(p for p in candidates(cfg, tp=1, batch=3, context=40) if p.name == family)
        for seg in plan.segments:
            seg.tiling.update(num_sms=4, linear_cols=16)
        ex = PlanExecutor(plan, [g], [mem], backend="pyvm", seed=3)
        out = []
        for s in range(3):
            mem.t("logits").fill_(SENTINEL)
            ex.run(lambda r: dataclasses.replace(ctx, step=s + 1, logits_unread=True))
            out.append((mem.t("next_tokens").clone(), bool((mem.t("logits") == SENTINEL).all())))
            mem.t("tokens").copy_(mem.t("next_tokens"))
        got[switch] = out
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got["0"], got["1"])), family
    assert [u for _, u in got["0"]] == [False] * 3 and [u for _, u in got["1"]] == [True] * 3, family
