import copy

import pytest

from mpk_runtime.ir import build_graph
from mpk_runtime.models import ModelConfig
from mpk_runtime.tasks import GraphCheckError, TaskGraph, Tiling, build_task_graphs, check_task_graphs


def graphs(name="tiny-qwen3", tp=2, batch=2, sms=6, **kw):
    cfg = ModelConfig.from_name(name)
    return build_task_graphs([build_graph(cfg, tp=tp, rank=r, batch=batch, attn_splits=2, **kw) for r in range(tp)],
                             Tiling(num_sms=sms, linear_cols=32))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_built_graphs_pass_checks(tp):
    tgs = graphs(tp=tp)
    stats = check_task_graphs(tgs)
    assert stats["deps"] > 0
    for g in tgs:
        assert all(len(t.waits) >= 1 for t in g.tasks if t.kind != "embed")
        assert TaskGraph.from_json(g.to_json()).to_json() == g.to_json()
        assert "tasks per SM" in g.summary()


def test_tile_level_dependencies():
    """Attention of KV group g waits only for the QKV heads of group g, not the whole QKV op."""
    g = graphs(name="tiny-llama", tp=1, batch=1)[0]
    attn = next(t for t in g.tasks if t.kind == "attn_partial" and t.params["g"] == 1)
    (eid, lag), = attn.waits
    prods = {g.tasks[tid].params["which"] + str(g.tasks[tid].params["head"]) for _, tid in g.events[eid].producers}
    gs = 4  # tiny-llama: 8 q heads, 2 kv heads
    assert prods == {f"q{h}" for h in range(gs, 2 * gs)} | {"k1", "v1"}


def test_allreduce_waits_on_matching_tiles_of_every_rank():
    tgs = graphs(tp=2)
    red = next(t for t in tgs[1].tasks if t.kind == "allreduce")
    # one wait per producing op: the residual's producer (embed, this rank), and the o_proj tiles
    assert len(red.waits) == 2
    prods = [(r, tid) for eid, _ in red.waits for r, tid in tgs[1].events[eid].producers
             if tgs[r].tasks[tid].kind != "embed"]
    assert {r for r, _ in prods} == {0, 1}
    for r, tid in prods:
        p = tgs[r].tasks[tid]
        assert p.kind == "linear" and p.params["n0"] < red.params["n1"] and red.params["n0"] < p.params["n1"]


def _drop_wait(tgs, kind):
    """Remove one dependency edge: the first `kind` task stops waiting for one of its producers."""
    tgs = copy.deepcopy(tgs)
    for g in tgs:
        for t in g.tasks:
            if t.kind == kind and t.waits:
                eid, lag = t.waits[0]
                ev = g.events[eid]
                # a fresh event without one producer: triggers stay consistent, the edge is gone
                victim = ev.producers[-1]
                new = copy.deepcopy(ev)
                new.id = len(g.events)
                new.producers = ev.producers[:-1]
                new.triggers = len(new.producers)
                g.events.append(new)
                t.waits[0] = (new.id, lag)
                for pr, pid in new.producers:
                    tgs[pr].tasks[pid].signals.append((g.rank, new.id))
                return tgs, t, victim
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["attn_partial", "linear", "allreduce", "argmax_reduce"])
def test_deleted_edge_is_caught_by_checker(kind):
    tgs, task, victim = _drop_wait(graphs(tp=2), kind)
    with pytest.raises(GraphCheckError, match="missing dependency"):
        check_task_graphs(tgs)


def test_wrong_triggers_and_deadlock_caught():
    tgs = graphs(tp=1)
    bad = copy.deepcopy(tgs)
    bad[0].events[3].triggers += 1
    with pytest.raises(GraphCheckError, match="triggers"):
        check_task_graphs(bad)
    # swap two dependent tasks of one SM list: the consumer first => deadlock
    bad = copy.deepcopy(tgs)
    g = bad[0]
    t = next(t for t in g.tasks if t.kind == "argmax_reduce")
    p = next(x for x in g.tasks if x.kind == "argmax_partial")
    # move the reduce onto the partial's SM, in front of it
    g.sm_lists[t.sm].remove(t.id)
    lst = g.sm_lists[p.sm]
    lst.insert(lst.index(p.id), t.id)
    for sm, l in enumerate(g.sm_lists):
        for i, tid in enumerate(l):
            g.tasks[tid].sm, g.tasks[tid].order = sm, i
    with pytest.raises(GraphCheckError, match="deadlock"):
        check_task_graphs(bad)


def test_signal_fan_out_stays_small():
    """Per-op wait groups: no producer signals one event per consumer tile (each signal is an atomic)."""
    cfg = ModelConfig.from_name("llama-3.2-1b")
    g = build_task_graphs([build_graph(cfg, batch=1)], Tiling(num_sms=132))[0]
    assert max(len(t.signals) for t in g.tasks) <= 2
    assert sum(len(t.signals) for t in g.tasks) < 2 * len(g.tasks)


def test_real_model_graph_checks():
    cfg = ModelConfig.from_name("llama-3.2-1b")
    tgs = build_task_graphs([build_graph(cfg, batch=1)], Tiling(num_sms=132))
    check_task_graphs(tgs, steps=2)
    assert tgs[0].meta["makespan_us"] > 0


def test_attention_partials_spread_over_the_sms():
    """A layer's attention partials get an SM each when there are SMs for all of them (llama-3.2-1b shapes, 8
    sequences x 8 KV heads x 2 splits = 128 partials on 132 SMs): the merges, which wait on the partials, come
    after them in the task order and so cannot take an SM a partial needs (they did: 128 partials on 88 SMs)."""
    import collections
    from mpk_runtime.tasks.tiling import attn_splits_for
    cfg = ModelConfig.from_name("llama-3.2-1b").replace(num_layers=2)
    S = attn_splits_for(8, cfg.num_kv_heads, 4096)
    assert S == 2
    tg = build_task_graphs([build_graph(cfg, batch=8, context_len=4096, max_seq_len=4128, attn_splits=S)],
                           Tiling(num_sms=132))[0]
    for layer in ("L0", "L1"):
        per_sm = collections.Counter(t.sm for t in tg.tasks
                                     if t.op == f"{layer}.attention" and t.kind == "attn_partial")
        assert sum(per_sm.values()) == 128 and max(per_sm.values()) == 1, (layer, len(per_sm))
    check_task_graphs([tg], steps=2)


def test_attn_splits_for():
    from mpk_runtime.tasks.tiling import attn_splits_for
    assert attn_splits_for(8, 8, 512) == 2          # a full batch of 8 rows x 8 KV heads: 128 tasks
    assert attn_splits_for(1, 8, 4096) == 16        # one sequence: 128 tasks of 256 keys
    assert attn_splits_for(1, 8, 100) == 2          # >= 64 keys per split
    assert attn_splits_for(128, 8, 4096) == 1
    assert attn_splits_for(1, 1, 1 << 20) == 32     # at most 32
