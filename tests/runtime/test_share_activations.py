"""Activation sharing for executors that run ops one after another (RankMemory(share_activations=True)):
the slot plan never lets two tensors that are live at the same op share storage, an op's outputs never alias
its inputs, it shrinks a prefill graph's memory by about the layer count, and the conventional executor gives
bit-identical results with and without it (prefill and decode, TP=1 and TP=2 as threads)."""
import math

import pytest
import torch

from mpk_runtime.ir import build_graph
from mpk_runtime.ir.graph import DTYPE_BYTES
from mpk_runtime.models import PRESETS, random_weights
from mpk_runtime.runtime.memory import KVStore, RankMemory, StepCtx, connect, share_plan
from mpk_runtime.runtime.pyvm_runner import shard_weights
from mpk_runtime.runtime.torch_exec import ConventionalExecutor
from mpk_runtime.models.reference import rope_inv_freq


def _live(g):
    first, last = {}, {}
    for i, op in enumerate(g.ops):
        for n in list(op.outputs) + list(op.inputs):
            first.setdefault(n, i)
            last[n] = i
    return first, last


@pytest.mark.parametrize("name,tp,mode", [("qwen3-8b", 2, "prefill"), ("llama-3.2-1b", 1, "prefill"),
                                          ("tiny-qwen3", 2, "decode")])
def test_slots_never_overlap_and_outputs_never_alias_inputs(name, tp, mode):
    g = build_graph(PRESETS[name], mode=mode, batch=4, tokens_per_seq=64 if mode == "prefill" else None,
                    context_len=0, max_seq_len=512, tp=tp, rank=tp - 1)
    slot = share_plan(g)
    first, last = _live(g)
    by_slot = {}
    for n, s in slot.items():
        by_slot.setdefault(s, []).append(n)
    for names in by_slot.values():
        spans = sorted((first[n], last[n], n) for n in names)
        assert len({(g.tensors[n].kind, g.tensors[n].shape, g.tensors[n].dtype) for n in names}) == 1
        for (a0, a1, x), (b0, b1, y) in zip(spans, spans[1:]):
            assert a1 < b0, f"{x} [{a0},{a1}] and {y} [{b0},{b1}] share slot storage while both live"
    for op in g.ops:
        outs = {slot[n] for n in op.outputs if n in slot}
        ins = {slot[n] for n in op.inputs if n in slot and n not in op.outputs}
        assert not outs & ins, f"{op.name} writes into storage it reads"
    assert all(g.tensors[n].kind in ("act", "sym") for n in slot)   # io tensors keep their own storage
    if mode == "prefill":
        def nb(t):
            return math.prod(t.shape) * DTYPE_BYTES[t.dtype]
        full = sum(nb(t) for t in g.tensors.values() if t.kind in ("act", "sym"))
        shared = sum(nb(g.tensors[names[0]]) for names in by_slot.values()) + \
            sum(nb(t) for t in g.tensors.values() if t.kind in ("act", "sym") and t.name not in slot)
        assert shared * 8 < full   # 16 / 36 layers: well over 8x less


@pytest.mark.parametrize("tp,mode", [(1, "prefill"), (2, "prefill"), (2, "decode")])
def test_conventional_results_identical_with_sharing(tp, mode):
    cfg = PRESETS["tiny-qwen3"].replace(dtype="float32")
    w = random_weights(cfg, seed=4)
    B, T, PS, MAXLEN = 3, (8 if mode == "prefill" else 1), 4, 32
    width = MAXLEN // PS
    outs = []
    for share in (False, True):
        gs = [build_graph(cfg, mode=mode, batch=B, tokens_per_seq=T if mode == "prefill" else None, context_len=0,
                          max_seq_len=MAXLEN, tp=tp, rank=r, dtype="float32") for r in range(tp)]
        kvs = [KVStore(cfg.num_layers, B * width + 1, PS, gs[r].tensors["L0.k_cache"].shape[1], cfg.head_dim,
                       torch.float32, poison=False) for r in range(tp)]
        mems = [RankMemory(g, shard_weights(cfg, w, tp, r), kvs[r], share_activations=share)
                for r, g in enumerate(gs)]
        connect(mems)
        acts = [n for n, t in gs[0].tensors.items() if t.kind == "act"]
        storages = {mems[0].t(n).data_ptr() for n in acts}
        assert (len(storages) <= len(acts) // 2) if share else (len(storages) == len(acts))
        ex = ConventionalExecutor(gs, mems)
        g = torch.Generator().manual_seed(0)
        tables = (torch.arange(B * width) + 1).view(B, width)
        pos = torch.tensor([0, 3, 9]) if mode == "decode" else torch.zeros(B, dtype=torch.long)
        for step in range(2):   # the second step runs over storage the first left behind
            toks = torch.randint(0, cfg.vocab_size, (B * T,), generator=g)
            for m in mems:
                m.t("tokens").copy_(toks)
            ctx = StepCtx(cfg, step + 1, pos + step * T, tables, PS, T, rope_inv_freq(cfg))
            ex.run([ctx] * tp)
            outs.append((mems[0].t("logits").clone(), mems[0].t("next_tokens").clone()))
    n = len(outs) // 2
    for (la, ta), (lb, tb) in zip(outs[:n], outs[n:]):
        assert torch.equal(la, lb) and torch.equal(ta, tb)
