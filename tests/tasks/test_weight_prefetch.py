"""weight_prefetch tasks (tasks/ops/prefetch.py, Tiling.l2_prefetch_mb): which bytes they cover, where they run,
what they wait for, how they are packed, and that they change no value (pyvm, bitwise, against prefetch off)."""
import collections
import functools

import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.runtime.packer import L_OPCODE, TaskPacker
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.pyvm_runner import TPGroup
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.check import check_task_graphs
from mpk_runtime.tasks.ops.prefetch import PREFETCH_RANGES
from mpk_runtime.tasks.tiling import Tiling


def _tg(model="llama-3.2-1b", B=1, mb=24.0, sms=132):
    return _built(model, B, mb, sms)


@functools.lru_cache(maxsize=None)   # a deterministic build that no test changes: once per shape in this module
def _built(model, B, mb, sms):
    g = build_graph(load_config(model), batch=B, context_len=512, attn_splits=8 if B == 1 else 2)
    tgs = build_task_graphs([g], Tiling(num_sms=sms, l2_prefetch_mb=mb))
    check_task_graphs(tgs)
    return g, tgs[0]


def test_off_by_default_and_no_change_to_other_tasks():
    _, off = _tg(mb=0.0)
    _, on = _tg(mb=24.0)
    assert not any(t.kind == "weight_prefetch" for t in off.tasks)
    strip = lambda tg: [(t.kind, t.op, t.sm) for t in tg.tasks if t.kind != "weight_prefetch"]  # noqa: E731
    assert strip(on) == strip(off)   # the other tasks keep their SMs (prefetch tasks take the idle ones)


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-8b"])
def test_ranges_cover_o_proj_whole_and_the_same_share_of_every_gate_up_tile(model):
    g, tg = _tg(model)
    by_layer = collections.defaultdict(list)
    for t in tg.tasks:
        if t.kind == "weight_prefetch":
            by_layer[t.op.split(".")[0]].append(t)
    assert len(by_layer) == load_config(model).num_layers
    for layer, pts in by_layer.items():
        assert all(len(t.params["ranges"]) <= PREFETCH_RANGES for t in pts)
        got = collections.Counter()
        for t in pts:
            for name, r0, rows, K in t.params["ranges"]:
                got[(name, r0)] += rows
        tiles = {op: [t for t in tg.tasks if t.op == f"{layer}.{op}"] for op in ("o_proj", "gate_up")}
        share = {}
        for op, ts in tiles.items():   # the same first-row count of every tile of an op (equal tiles)
            rows = {got.pop((w, t.params["n0"]), 0) for t in ts for w in t.params["weights"]}
            assert len(rows) == 1, (layer, op, rows)
            share[op] = rows.pop() / (ts[0].params["n1"] - ts[0].params["n0"])
        assert not got                                   # nothing else
        assert share["o_proj"] > 0 and (share["gate_up"] == 0 or share["o_proj"] == 1.0)   # o_proj first
        total = sum(t.est_bytes for t in pts)
        assert 20e6 < total <= 24e6


def test_prefetch_runs_with_attention_on_idle_sms_after_q():
    g, tg = _tg()
    for layer in ("L0", "L7"):
        att = [t for t in tg.tasks if t.op == f"{layer}.attention"]
        pf = [t for t in tg.tasks if t.op == f"{layer}.prefetch"]
        assert {t.sm for t in att}.isdisjoint({t.sm for t in pf})
        # it waits on the producers of q (the layer's qkv_rope parts), like attention does
        qkv = {t.id for t in tg.tasks if t.op == f"{layer}.qkv_rope"}
        for t in pf:
            prods = {p for e, _ in t.waits for _, p in tg.events[e].producers}
            assert prods and prods <= qkv
        first_o = min(t.id for t in tg.tasks if t.op == f"{layer}.o_proj")
        assert max(t.id for t in pf) < first_o


def test_packed_addresses_are_rows_of_the_weights():
    cfg = load_config("tiny-llama")
    g = build_graph(cfg, mode="decode", batch=1, context_len=0, max_seq_len=64, attn_splits=2, dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=16, l2_prefetch_mb=0.05))[0]
    kv = KVStore(cfg.num_layers, 5, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16"), kv)
    tasks = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu").pack()[0]
    n_checked = 0
    for t in tg.tasks:
        if t.kind != "weight_prefetch":
            continue
        row = tasks[t.id]
        assert row[L.TASK_HEADER.index("opcode")] == L_OPCODE["weight_prefetch"]
        assert row[L.arg_index("weight_prefetch", "n")] == len(t.params["ranges"])
        for i, (name, r0, rows, K) in enumerate(t.params["ranges"]):
            w = mem.t(name)
            p, nb = int(row[L.arg_index("weight_prefetch", f"p{i}")]), int(row[L.arg_index("weight_prefetch", f"b{i}")])
            assert p == w.data_ptr() + r0 * K * 2 and nb == rows * K * 2 and nb % 16 == 0
            assert p + nb <= w.data_ptr() + w.numel() * 2
            n_checked += 1
    assert n_checked > 0


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("batch", [1, 4])
def test_values_unchanged_in_pyvm(model, batch):
    cfg = load_config(model)
    w = get_weights(model, cfg, seed=0, dtype="bfloat16")
    outs = []
    for mb in (0.0, 1.0):
        grp = TPGroup(cfg, [w], num_pages=batch * 4 + 1, page_size=16, max_seq_len=64,
                      tiling=Tiling(num_sms=8, l2_prefetch_mb=mb), attn_splits=2, dtype="bfloat16", seed=1)
        tables = [[1 + b * 4 + j for j in range(4)] for b in range(batch)]
        tok = torch.arange(batch) + 3
        lg = []
        for s in range(4):
            lg.append(grp.decode(tok, torch.full((batch,), s), tables))
            tok = grp.next_tokens(batch)
        outs.append(torch.stack(lg))
        assert any(t.kind == "weight_prefetch" for t in grp.decode_vm(batch)[2].graphs[0].tasks) == (mb > 0)
    assert torch.equal(outs[0], outs[1])
