"""Tiling.qkv_flat (MPK_QKV_FLAT=1) packed for the megakernel at qwen3-8b's real batch-1 shapes: the q / k rows of
each layer as 108 linear tiles into qk_raw plus 24 v pair parts (132 tasks, one per SM, none over 48 rows where the
head parts stream 64 on 96 SMs), each tile's weight pointer at its own row of wq or wk (the k tiles' pointer offset
back by the q rows: the kernel reads row n at w0 + n K), and its output columns its q / k rows' raw slots.
tests/runtime/test_pyvm.py checks the values; tests/gpu/test_megakernel.py the kernel."""
import dataclasses

import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.codegen import nvcc
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import weight_shapes
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling


def test_flat_qkv_tiles_at_qwen3_8b_shapes(monkeypatch):
    monkeypatch.setenv("MPK_QKV_FLAT", "1")
    cfg = dataclasses.replace(load_config("qwen3-8b"), num_layers=1)
    g = build_graph(cfg, mode="decode", batch=1, context_len=0, max_seq_len=1024, tp=1, rank=0, attn_splits=8,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=132))[0]
    kv = KVStore(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    w = {k: torch.empty(sh, dtype=torch.bfloat16) for k, sh in weight_shapes(cfg).items()}
    mem = RankMemory(g, w, kv)
    tasks = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu").pack()[0]
    qkv = [t for t in tg.tasks if t.op == "L0.qkv_rope" and t.kind in ("linear", "qkv_rope")]
    lin = [t for t in qkv if t.kind == "linear"]
    assert (len(lin), len(qkv)) == (108, 132)
    K, D, nq = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    wq, wk = (mem.t(f"model.layers.0.self_attn.{n}_proj.weight") for n in ("q", "k"))
    raw = [t for t in g.tensors if t.endswith("qk_raw")][0]
    a = lambda t, n: int(tasks[t.id, L.arg_index("linear", n)])   # noqa: E731
    for t in lin:
        n0, n1 = a(t, "n0"), a(t, "n1")
        assert n1 - n0 <= 48
        base, row = (wq, n0) if n0 < nq * D else (wk, n0 - nq * D)
        assert a(t, "w0") + n0 * K * 2 == base.data_ptr() + row * K * 2, t.label()
        assert a(t, "out") == mem.t(raw).data_ptr() and a(t, "tc_rows") == 0 and a(t, "kseg") == 1
    assert max(2 * (t.params["r1"] - t.params["r0"]) for t in qkv if t.kind == "qkv_rope") <= 44


def test_attention_qk_norm_packs_raw_heads_at_qwen3_8b_shapes(monkeypatch):
    """Tiling.attn_qk_norm (the default since session 33; its graphs need a -DMPK_ATT_QKNORM=1 build): no
    qk_norm_rope tasks; every attn_partial's q is qk_raw's address with the head norms and eps (the kernel reads its
    q heads at column g gs D and its k head at (nq + g) D of the row); they wait on the flat tiles that write those
    columns. The packer records that the build needs the define: the build made with the packer's needs has it, and
    a plain build or one with the define set to 0 is refused, naming it."""
    monkeypatch.setenv("MPK_QKV_FLAT", "1")
    monkeypatch.delenv("MPK_ATTN_QKNORM", raising=False)   # the default
    cfg = dataclasses.replace(load_config("qwen3-8b"), num_layers=1)
    g = build_graph(cfg, mode="decode", batch=1, context_len=0, max_seq_len=1024, tp=1, rank=0, attn_splits=8,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=132))[0]
    assert not any(t.kind == "qk_norm_rope" for t in tg.tasks)
    kv = KVStore(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    w = {k: torch.empty(sh, dtype=torch.bfloat16) for k, sh in weight_shapes(cfg).items()}
    mem = RankMemory(g, w, kv)
    packer = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")
    tasks = packer.pack()[0]
    raw = mem.t("L0.qk_raw")
    a = lambda t, n: int(tasks[t.id, L.arg_index("attn_partial", n)])   # noqa: E731
    att = [t for t in tg.tasks if t.kind == "attn_partial"]
    assert len(att) == 8 * 8
    for t in att:
        assert a(t, "q") == raw.data_ptr() and a(t, "eps") != 0
        assert a(t, "q_norm") == mem.t(t.params["q_norm"]).data_ptr() != a(t, "k_norm") != 0
    D, nq, gs = cfg.head_dim, cfg.num_heads, cfg.num_heads // cfg.num_kv_heads
    byid = {t.id: t for t in tg.tasks}
    for t in att:   # its producers: the flat tiles covering its q heads' and k head's raw columns, and v's parts
        gg = t.params["g"]
        need = [(gg * gs * D, (gg + 1) * gs * D), ((nq + gg) * D, (nq + gg + 1) * D)]
        prods = {tid for e, _lag in t.waits for _r, tid in tg.events[e].producers}
        tiles = [byid[p] for p in prods if byid[p].kind == "linear"]
        for lo, hi in need:
            assert any(x.params["n0"] < hi and lo < x.params["n1"] for x in tiles), (t.label(), lo, hi)
        assert any(byid[p].kind == "qkv_rope" and byid[p].params["head"] == gg for p in prods)
    monkeypatch.delenv("MPK_NVCC_DEFINES", raising=False)
    assert set(packer.needs) == {"MPK_ATT_QKNORM"}
    flags = nvcc.build_flags(needs=packer.needs)   # Megakernel's own build
    assert [f for f in flags if f.startswith("-D")] == ["-DMPK_ATT_QKNORM=1"]
    nvcc.check_defines(flags, packer.needs)
    with pytest.raises(ValueError, match=r"need a build with -DMPK_ATT_QKNORM=1 \(this one has none\)"):
        nvcc.check_defines(nvcc.build_flags(), packer.needs)   # a build given from elsewhere, without it
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_QKNORM=0")   # a value set by hand stands, and is refused
    with pytest.raises(ValueError, match=r"this one has -DMPK_ATT_QKNORM=0\): drop -DMPK_ATT_QKNORM=0 .*MPK_ATTN_QKNORM=0"):
        nvcc.check_defines(nvcc.build_flags(needs=packer.needs), packer.needs)
