"""Folded attention merge (Tiling.attn_fold_merge) as packed for the kernel: no attn_merge tasks, every partial of
a (sequence, KV group) carries the same ticket counter address (distinct per group and layer, inside the packer's
zeroed ticket tensor) and the group's output address; the output's consumers wait on every partial of the groups
they read; unfolded partials carry ticket 0."""
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import L_OPCODE, TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling


def _pack(fold: bool, batch: int = 2):
    cfg = load_config("tiny-qwen3")
    g = build_graph(cfg, mode="decode", batch=batch, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=4,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8, attn_fold_merge=fold))[0]
    kv = KVStore(cfg.num_layers, batch * 4 + 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-qwen3", cfg, seed=0, dtype="bfloat16"), kv)
    p = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")
    return cfg, tg, p, p.pack()[0]


def test_folded_partials_share_their_groups_ticket_and_feed_the_output_consumers():
    cfg, tg, p, tasks = _pack(True)
    assert not any(t.kind == "attn_merge" for t in tg.tasks)
    parts = [t for t in tg.tasks if t.kind == "attn_partial"]
    col = lambda n: L.arg_index("attn_partial", n)   # noqa: E731
    by_group = {}
    for t in parts:
        row = tasks[t.id]
        assert int(row[L.TASK_HEADER.index("opcode")]) == L_OPCODE["attn_partial"]
        by_group.setdefault((t.op, t.params["b"], t.params["g"]), set()).add(
            (int(row[col("ticket")]), int(row[col("out")])))
    base, n = p.tickets.data_ptr(), p.tickets.numel()
    tickets = set()
    for key, vals in by_group.items():
        assert len(vals) == 1, key                   # one ticket and one output per group
        (tk, out), = vals
        assert out != 0 and base <= tk < base + 8 * n and (tk - base) % 8 == 0
        tickets.add(tk)
    assert len(tickets) == len(by_group) == n == cfg.num_layers * 2 * cfg.num_kv_heads
    assert not p.tickets.any()
    # o_proj tiles wait on every attention partial of their layer (and on the residual's producer)
    for t in tg.tasks:
        if t.kind == "linear" and t.op.endswith("o_proj"):
            prods = [tg.tasks[tid] for e, lag in t.waits if lag == 0 for _r, tid in tg.events[e].producers]
            attn = {u.id for u in prods if u.kind == "attn_partial"}
            assert attn == {u.id for u in parts if u.op.split(".")[0] == t.op.split(".")[0]}   # all of its layer
            assert all(u.kind in ("attn_partial", "embed", "allreduce", "linear") for u in prods)   # (residual)


def test_unfolded_partials_carry_no_ticket():
    _, tg, p, tasks = _pack(False)
    assert any(t.kind == "attn_merge" for t in tg.tasks)
    for t in tg.tasks:
        if t.kind == "attn_partial":
            assert int(tasks[t.id, L.arg_index("attn_partial", "ticket")]) == 0


def test_the_fold_switch_takes_0_or_1_and_says_so_otherwise(monkeypatch):
    import pytest
    monkeypatch.setenv("MPK_ATTN_FOLD", "1")
    assert Tiling().attn_fold_merge
    monkeypatch.setenv("MPK_ATTN_FOLD", "0")
    assert not Tiling().attn_fold_merge
    monkeypatch.delenv("MPK_ATTN_FOLD")
    assert Tiling().attn_fold_merge            # on by default since session 12
    monkeypatch.setenv("MPK_ATTN_FOLD", "yes")
    with pytest.raises(ValueError, match="MPK_ATTN_FOLD='yes': expected 1"):
        Tiling()
