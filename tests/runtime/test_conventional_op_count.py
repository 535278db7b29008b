"""Kernel count of a conventional decode step (a CPU proxy for the GPU launches of a CUDA-graphed step: every
non-view aten op is a kernel or a copy on the GPU, ~2-3 us each inside a graph), and the whole-op versions
(runtime/conventional_ops.py) computing bit for bit what the task kinds' semantics compute.

Per-layer counts are taken over layers 1.. (layer 0 also builds the per-step values every layer shares:
positions, RoPE tables, KV slots, attention masks). Before the whole-op linear/embed, per-step values and
in-place epilogues (07e32f7), bf16, batch 1, GPU branches of argmax, per layer:
    tiny-qwen3 150 aten ops (96 kernels), tiny-llama 134 (80), qwen3-0.6b 150 (96); per step 1045 / 863 / 4795
after: 70 (44), 62 (36), 70 (44); per step 601 / 515 / 2351 (docs/perf-notes.md, v7)
Run `python tests/runtime/test_conventional_op_count.py [models]` for the breakdown per op kind."""
from __future__ import annotations

import collections
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpk_runtime.ir import build_graph
from mpk_runtime.models import PRESETS, load_config, random_weights
from mpk_runtime.models.reference import rope_inv_freq
from mpk_runtime.runtime import torch_exec
from mpk_runtime.runtime.memory import KVStore, RankMemory, StepCtx
from mpk_runtime.runtime.torch_exec import ConventionalExecutor
from mpk_runtime.tasks.ops import argmax as argmax_ops

# ops that launch no GPU kernel: views / aliases, and allocations
VIEWS = {"view", "_unsafe_view", "unsqueeze", "squeeze", "permute", "transpose", "t", "slice", "select", "expand",
         "alias", "split", "split_with_sizes", "unbind", "chunk", "detach", "as_strided", "narrow", "reshape",
         "_reshape_alias", "empty"}

# upper bounds (aten ops per layer, of which kernels; aten ops per step), batch 1, bf16: measured + ~5%
# (measured: tiny-qwen3 70 / 44 / 601, tiny-llama 62 / 36 / 515; qwen3-0.6b 70 / 44 per layer)
BOUNDS = {"tiny-qwen3": (74, 46, 630), "tiny-llama": (66, 38, 540)}


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str]] = []
        self.tag = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((self.tag, str(func)))
        return func(*args, **(kwargs or {}))


def is_kernel(op: str) -> bool:
    return op.split(".")[1] not in VIEWS


def build(model: str, B: int = 1, context: int = 40, T: int = 1, dtype: str = "bfloat16", seed: int = 0,
          dev: str = "cpu", greedy: bool = False, vocab: int | None = None):
    """A bf16 rank-0 memory with a random, filled KV cache and one conventional executor (as on a GPU: static key
    count kv_len_cap, unpoisoned cache). Row 1 (if B > 1) is inactive (pos -1). vocab: another vocabulary size
    (>= 8192 gives the argmax several slices, as the real models have)."""
    cfg = load_config(model).replace(dtype=dtype, **({"vocab_size": vocab} if vocab else {}))
    ps, max_seq = 16, context + T + 16
    pps = -(-max_seq // ps)
    mode = "decode" if T == 1 else "prefill"
    g = build_graph(cfg, mode=mode, batch=B, tokens_per_seq=None if T == 1 else T, context_len=context,
                    max_seq_len=max_seq)
    w = {k: v.to(dev) for k, v in random_weights(cfg, seed=seed).items()}
    kv = KVStore(cfg.num_layers, B * pps + 1, ps, g.tensors["L0.k_cache"].shape[1], cfg.head_dim,
                 w["model.norm.weight"].dtype, device=dev, poison=False)
    gen = torch.Generator().manual_seed(seed)
    for c in kv.k + kv.v:
        c.copy_(torch.randn(c.shape, generator=gen))
    mem = RankMemory(g, w, kv, device=dev)
    mem.t("tokens").copy_(torch.randint(0, cfg.vocab_size, (B * T,), generator=gen))
    tables = (torch.randperm(B * pps, generator=gen) + 1).view(B, pps)
    pos = torch.tensor([context - 3 * b for b in range(B)])
    if B > 1:
        pos[1] = -1
    ctx = StepCtx(cfg, 1, pos.to(dev), tables.to(dev), ps, T, rope_inv_freq(cfg).to(dev), kv_len_cap=context + T,
                  greedy=greedy)
    return cfg, g, mem, ConventionalExecutor([g], [mem]), ctx


def count(model: str, B: int = 1, greedy: bool = False) -> dict:
    """Aten ops of one conventional decode step (GPU branches of argmax), per op and per layer."""
    cfg, g, mem, ex, ctx = build(model, B, greedy=greedy)
    old = argmax_ops.host_syncs_ok
    argmax_ops.host_syncs_ok = lambda dev: False
    try:
        ex.run([ctx])                                   # warm-up (lazy init off the record)
        rec = _Record()
        kernels = dict(ex.kernels)
        for kind, f in kernels.items():
            def tagged(t, *args, f=f):
                rec.tag = t.name if hasattr(t, "name") else getattr(t.op, "name", t.op)   # Op / task
                f(t, *args)
                rec.tag = ""
            ex.kernels[kind] = tagged
        with rec:
            ex.run([ctx])
        ex.kernels = kernels
    finally:
        argmax_ops.host_syncs_ok = old
    L = cfg.num_layers
    steady = [o for tag, o in rec.ops if tag.startswith("L") and int(tag[1:].split(".")[0]) >= 1]
    by_op = collections.Counter(tag.split(".")[-1] if tag.startswith("L") else tag for tag, _ in rec.ops)
    return dict(model=model, layers=L, step=len(rec.ops), next_tokens=mem.t("next_tokens").clone(), step_kernels=sum(map(is_kernel, (o for _, o in rec.ops))),
                argmax_kernels=sum(is_kernel(o) for tag, o in rec.ops if tag == "argmax"),
                layer=len(steady) / (L - 1), layer_kernels=sum(map(is_kernel, steady)) / (L - 1), by_op=by_op,
                steady=collections.Counter(steady))


@pytest.mark.parametrize("model", sorted(BOUNDS))
def test_conventional_decode_step_op_count(model, monkeypatch):
    # the eager gather + SDPA attention's ops (under TRITON_INTERPRET=1 the paged kernel's interpreter would count)
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")
    c = count(model)
    ops, kernels, step = BOUNDS[model]
    assert c["step"] <= step, f"{model}: {c['step']} aten ops per step, bound {step}; {dict(c['by_op'])}"
    assert c["layer"] <= ops and c["layer_kernels"] <= kernels, (
        f"{model}: {c['layer']:.1f} aten ops ({c['layer_kernels']:.1f} kernels) per layer, bound {ops} ({kernels}); "
        f"{dict(c['steady'].most_common())}")


@pytest.mark.parametrize("B", [1, 3])
def test_greedy_steps_skip_the_sampling_work(B, monkeypatch):
    """StepCtx.greedy (the runner's promise that no row samples): the argmax of a step (GPU branches: no host
    check) drops from ~340 aten ops (candidates, the serial prefix sums and the draw for every row, ~0.6 ms of small
    kernels measured on an H200) to ~50 (a max per slice and the merge, views included), with the same tokens. A greedy promise with a sampled row is refused
    where it can be checked (CPU)."""
    monkeypatch.delenv("MPK_CONV_GREEDY_FAST", raising=False)   # the default: session 25's greedy partial / merge
    full, fast = count("tiny-llama", B), count("tiny-llama", B, greedy=True)
    assert full["by_op"]["argmax"] > 300 and fast["by_op"]["argmax"] <= 30, (full["by_op"], fast["by_op"])
    assert fast["argmax_kernels"] <= 5, fast["argmax_kernels"]   # 26 before session 25's greedy partial / merge
    monkeypatch.setenv("MPK_CONV_GREEDY_FAST", "0")   # the older greedy path (the default until session 26)
    slow = count("tiny-llama", B, greedy=True)
    assert slow["argmax_kernels"] >= 20 and torch.equal(slow["next_tokens"], fast["next_tokens"])
    assert torch.equal(full["next_tokens"], fast["next_tokens"])
    for f in ("1", "0"):   # a broken promise is refused on a CPU by either greedy path
        monkeypatch.setenv("MPK_CONV_GREEDY_FAST", f)
        cfg, g, mem, ex, ctx = build("tiny-llama", B, greedy=True)
        mem.t("sample.temperature")[0] = 0.7
        with pytest.raises(ValueError, match="greedy"):
            ex.run([ctx])


def _acts(mem, g):
    out = {n: mem.t(n).clone() for n, s in g.tensors.items() if s.kind in ("act", "io")}
    sc = mem.kvstore.scratch     # the whole op parks inactive rows' K/V there (the tasks skip them): garbage
    for i, (k, v) in enumerate(zip(mem.kvstore.k, mem.kvstore.v)):
        out[f"k{i}"], out[f"v{i}"] = k[:sc].clone(), v[:sc].clone()
    return out


CASES = [("tiny-qwen3", 1, 1), ("tiny-qwen3", 3, 1), ("tiny-llama", 3, 1), ("tiny-qwen3", 1, 5), ("tiny-llama", 2, 4)]


@pytest.mark.parametrize("model,B,T", CASES)
def test_whole_ops_match_task_semantics_bitwise(model, B, T, monkeypatch, dev="cpu"):
    """embed / linear / qkv_rope whole ops vs their task kinds with one coarse tile (the pyvm / megakernel
    contract), bf16: every activation, the logits, the next tokens and the KV cache bit for bit. Attention is
    the same whole op in both runs."""
    res = []
    for whole in (True, False):
        if not whole:
            monkeypatch.setattr(torch_exec, "runs_whole", lambda op: op.kind == "attention")
        cfg, g, mem, ex, ctx = build(model, B, T=T, dev=dev)
        ex.run([ctx])
        res.append(_acts(mem, g))
    a, b = res
    assert a.keys() == b.keys()
    bad = {n: (a[n].float() - b[n].float()).abs().max().item() for n in a if not torch.equal(a[n], b[n])}
    assert not bad, (model, B, T, bad)


@pytest.mark.gpu
@pytest.mark.parametrize("model,B,T", CASES)
def test_whole_ops_match_task_semantics_bitwise_gpu(model, B, T, monkeypatch):
    """The same on a GPU (cuBLAS / CUDA elementwise kernels, `out=` and in-place variants)."""
    test_whole_ops_match_task_semantics_bitwise(model, B, T, monkeypatch, dev="cuda")


if __name__ == "__main__":
    for m in (sys.argv[1] if len(sys.argv) > 1 else "tiny-qwen3,tiny-llama,qwen3-0.6b").split(","):
        c = count(m)
        print(f"== {m}: {c['step']} aten ops / step ({c['step_kernels']} kernels); per layer (1..{c['layers'] - 1}): "
              f"{c['layer']:.1f} aten ops, {c['layer_kernels']:.1f} kernels")
        print("   by op:", dict(c["by_op"].most_common()))
        print("   per layer:", {k: round(v / (c['layers'] - 1), 1) for k, v in c["steady"].most_common()})


@pytest.mark.parametrize("vocab,B", [(None, 3), (16384, 1), (16384, 4)])
def test_greedy_argmax_picks_the_first_maximum_across_slices(vocab, B, monkeypatch):
    """The greedy partial and merge (StepCtx.greedy: entry 0 of each slot, then the first slot holding the largest
    value) give torch.argmax's token (the lowest index among equal maxima), the full path's and the older greedy
    path's (MPK_CONV_GREEDY_FAST=0, the default), with ties inside a slice and across the slices of a 16384-word vocabulary (4
    slices of 4096)."""
    toks = {}
    for greedy, fast in ((False, "1"), (True, "1"), (True, "0")):
        monkeypatch.setenv("MPK_CONV_GREEDY_FAST", fast)
        cfg, g, mem, ex, ctx = build("tiny-llama", B, greedy=greedy, vocab=vocab)
        op = [o for o in g.ops if o.kind == "argmax"][0]
        S = op.attrs["slices"]
        assert S == (4 if vocab else 1)
        V = cfg.vocab_size
        logits = mem.t(op.attrs["logits"])
        gen = torch.Generator().manual_seed(1)
        logits.copy_(torch.randn(logits.shape, generator=gen))
        logits[0, [5, 7]] = 9.0                    # row 0: a tie inside slice 0 -> 5
        if B > 1:
            logits[1, [V - 1, V // 2, V // 4 + 3]] = 9.0   # row 1: ties across slices -> V / 4 + 3 (slice 1)
        if B > 2:
            logits[2, V - 1] = 9.0                 # row 2: the last index
        tasks = [t for t in ex.tasks[0] if getattr(t, "kind", "") in ("argmax_partial", "argmax_reduce")]
        assert [t.kind for t in tasks] == ["argmax_partial", "argmax_reduce"]
        for t in tasks:
            ex.kernels[t.kind](t, mem, ctx)
        toks[greedy, fast] = (mem.t(op.attrs["out"]).clone(), mem.t("tokens").clone())
        ref = logits.argmax(-1)
    fast = toks[True, "1"]
    for other in (toks[False, "1"], toks[True, "0"]):
        assert torch.equal(fast[0], other[0]) and torch.equal(fast[1], other[1])
    assert torch.equal(fast[0].long(), ref.long())
    assert fast[0][0] == 5 and (B < 2 or fast[0][1] == cfg.vocab_size // 4 + 3)
