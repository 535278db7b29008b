"""Deferred KV appends (ir/defer.py, MPK_KV_DEFER=1): in attn-mk plans the conventional qkv_rope leaves the step's
k / v rows in kv_new and the attention megakernel's partial that owns the new position appends them. The step
must compute what the reference computes, and leave the same KV cache as the appending plan."""
import pytest
import torch

from mpk_runtime.ir import build_graph
from mpk_runtime.ir.defer import defer_kv_appends, kv_defer_layers
from mpk_runtime.models import PRESETS
from mpk_runtime.planner import Plan, candidates
from mpk_runtime.runtime.plan_exec import PlanExecutor
from tests.runtime.test_plan_exec import check_steps
from tests.runtime.test_pyvm import setup


def _run(cfg, tp, family, batch=4, splits=2):
    grp, lens, tables, ref_logits, toks = setup(cfg, tp, batch)
    plan = candidates(cfg.replace(dtype="float32"), tp=tp, batch=batch, context=16, families=(family,))[0]
    plan = Plan.from_json(plan.to_json())
    for s in plan.segments:
        s.tiling.update(num_sms=4, linear_cols=16)
    graphs = grp.graphs("decode", batch, 1, attn_splits=splits)
    mems = grp._mems(graphs)
    ex = PlanExecutor(plan, graphs, mems, backend="pyvm", seed=3)
    check_steps(ex, grp, mems, lens, tables, ref_logits, toks, family)
    caches = [torch.stack([m.kv(f"L{i}.{w}_cache").clone() for i in range(cfg.num_layers) for w in "kv"])
              for m in mems]
    return ex, caches


@pytest.mark.parametrize("model,tp,splits,groups", [("tiny-llama", 1, 2, ""), ("tiny-qwen3", 1, 2, ""),
                                                    ("tiny-qwen3", 2, 2, ""), ("tiny-llama", 1, 1, "2"),
                                                    ("tiny-qwen3", 1, 1, "2"), ("tiny-llama", 1, 8, ""),
                                                    ("tiny-llama-g8", 1, 1, "8"), ("tiny-qwen2", 2, 2, "")])
def test_deferred_appends_match_the_reference_and_the_appending_plan(model, tp, splits, groups, monkeypatch):
    """Two attention splits: only the last chunk's partial appends; 8 splits: more splits than some sequences have
    keys (empty chunks); one split with groups=2: a partial of two KV groups appends both groups' rows. Several
    steps, so the next step's attention reads the rows the deferred append wrote."""
    cfg = PRESETS[model]
    if groups:
        monkeypatch.setenv("MPK_ATT_GROUPS", groups)
    monkeypatch.setenv("MPK_KV_DEFER", "0")
    ex0, want = _run(cfg, tp, "attn-mk", splits=splits)
    assert ex0.kv_defer_layers == set()
    monkeypatch.setenv("MPK_KV_DEFER", "1")
    ex1, got = _run(cfg, tp, "attn-mk", splits=splits)
    assert ex1.kv_defer_layers == set(range(cfg.num_layers))
    ngs = {t.params.get("ng", 1) for kind, vm in ex1.segments if kind == "megakernel" for tg in vm.graphs
           for t in tg.tasks if t.kind == "attn_partial"}
    assert ngs == ({int(groups)} if groups else {1})
    for a, b in zip(got, want):   # (unwritten slots hold the pool's NaN poison in both)
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_only_layers_split_between_conventional_qkv_and_megakernel_attention_defer(monkeypatch):
    monkeypatch.setenv("MPK_KV_DEFER", "1")
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "0")   # (with it, wholly conventional layers defer too: below)
    cfg = PRESETS["tiny-llama"]
    g = build_graph(cfg, batch=2, context_len=16, max_seq_len=32)
    ops = [o.name for o in g.ops]
    assert kv_defer_layers(g, [("megakernel", ops)]) == set()
    assert kv_defer_layers(g, [("conventional", ops)]) == set()
    # layer 0 split (qkv conventional, attention megakernel), layer 1 all in one megakernel
    a0 = ops.index("L0.attention")
    parts = [("conventional", ops[:a0]), ("megakernel", ops[a0:])]
    assert kv_defer_layers(g, parts) == {0}
    d = defer_kv_appends(g, {0})
    assert d.op("L0.qkv_rope").attrs["kv_defer"] and "L0.kv_new" in d.op("L0.qkv_rope").outputs
    assert "L0.k_cache" not in d.op("L0.qkv_rope").outputs
    assert "L0.kv_new" in d.op("L0.attention").inputs
    assert "kv_defer" not in d.op("L1.qkv_rope").attrs
    assert "kv_defer" not in g.op("L0.qkv_rope").attrs        # the graph given is not changed
    monkeypatch.setenv("MPK_KV_DEFER", "0")
    assert kv_defer_layers(g, parts) == set()
    prefill = build_graph(cfg, mode="prefill", batch=1, tokens_per_seq=4, context_len=0, max_seq_len=32)
    monkeypatch.setenv("MPK_KV_DEFER", "1")
    assert kv_defer_layers(prefill, [("conventional", ops[:a0]), ("megakernel", ops[a0:])]) == set()
    with pytest.raises(ValueError, match="decode"):
        defer_kv_appends(prefill, {0})


def test_a_deferred_qkv_rope_is_not_decomposed_into_tasks(monkeypatch):
    from mpk_runtime.tasks.build import build_task_graphs
    from mpk_runtime.tasks.tiling import Tiling
    cfg = PRESETS["tiny-llama"]
    g = defer_kv_appends(build_graph(cfg, batch=2, context_len=16, max_seq_len=32), {0})
    with pytest.raises(ValueError, match="conventional qkv_rope"):
        build_task_graphs([g], Tiling(num_sms=4))


def test_bad_switch_value_says_what_to_do(monkeypatch):
    monkeypatch.setenv("MPK_KV_DEFER", "yes")
    cfg = PRESETS["tiny-llama"]
    g = build_graph(cfg, batch=1, context_len=16, max_seq_len=32)
    with pytest.raises(ValueError, match="MPK_KV_DEFER"):
        kv_defer_layers(g, [("megakernel", [o.name for o in g.ops])])


def test_the_planner_prices_a_deferred_append_without_its_two_indexed_puts(monkeypatch):
    """attn-mk's conventional qkv_rope ops lose two kernels each (the measured 4-kernel sequence's cost less two
    conv_kernel_us, until a deferred one is measured); the one-megakernel plan is priced the same either way."""
    from mpk_runtime.planner.profile import HardwareProfile
    cfg = PRESETS["llama-3.2-1b"]
    prof = HardwareProfile.load().for_batch(32)
    price = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MPK_KV_DEFER", flag)
        price[flag] = {p.name: p.predicted_us for p in candidates(cfg, batch=32, context=512, prof=prof,
                                                                    families=("attn-mk", "mono"))}
    saved = cfg.num_layers * prof.conv_fixed_scale * 2 * prof.conv_kernel_us
    assert price["0"]["attn-mk"] - price["1"]["attn-mk"] == pytest.approx(saved, rel=1e-6)
    assert price["0"]["mono"] == price["1"]["mono"]


def test_deferred_attention_tasks_are_packed_with_the_new_rows(monkeypatch):
    """The packed kv_new word is the rows' address (with their row stride) for a deferred layer's attention
    partials, 0 for the other layers; the kernel appends from the last split's partial."""
    from mpk_runtime.codegen import layout as L
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.weights import get_weights
    from mpk_runtime.runtime.memory import KVStore, RankMemory
    from mpk_runtime.runtime.packer import TaskPacker
    from mpk_runtime.tasks.build import build_task_graphs
    from mpk_runtime.tasks.tiling import Tiling
    cfg = load_config("tiny-llama")
    g = build_graph(cfg, mode="decode", batch=2, context_len=0, max_seq_len=64, attn_splits=2, dtype="bfloat16")
    names = [o.name for o in g.ops if o.name.startswith(("L0.attention", "L1.attention"))]
    d = defer_kv_appends(g, {0}).subgraph(names)
    tg = build_task_graphs([d], Tiling(num_sms=8))[0]
    kv = KVStore(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16"), kv)
    tasks = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu").pack()[0]
    col, ld = L.arg_index("attn_partial", "kv_new"), L.arg_index("attn_partial", "ldkv")
    rows = {(t.params["layer"], int(tasks[t.id][col]), int(tasks[t.id][ld]))
            for t in tg.tasks if t.kind == "attn_partial"}
    kvn = mem.t("L0.kv_new")
    assert rows == {(0, kvn.data_ptr(), 2 * cfg.num_kv_heads * cfg.head_dim), (1, 0, 0)}


def test_an_inactive_row_appends_nothing_and_the_others_match(monkeypatch):
    """A padded batch row (position -1): the deferred append skips it (the appending plan writes it into the scratch
    page); the active rows compute the reference's logits and leave the appending plan's caches."""
    cfg = PRESETS["tiny-llama"]
    caches = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MPK_KV_DEFER", flag)
        grp, lens, tables, ref_logits, toks = setup(cfg, 1, 4)
        plan = Plan.from_json(candidates(cfg.replace(dtype="float32"), batch=4, context=16,
                                         families=("attn-mk",))[0].to_json())
        for s in plan.segments:
            s.tiling.update(num_sms=4, linear_cols=16)
        graphs = grp.graphs("decode", 4, 1)
        mems = grp._mems(graphs)
        ex = PlanExecutor(plan, graphs, mems, backend="pyvm", seed=3)
        for s in range(3):
            mems[0].t("tokens").copy_(toks[s])
            ex.run(lambda r: grp.ctx([n + s for n in lens[:3]] + [-1], tables, 1))
            got = mems[0].t("logits")[:3]
            err = ((got - ref_logits[s][:3]).abs().max() / ref_logits[s][:3].abs().max()).item()
            assert err < 1e-5, (flag, s, err)
        kv = mems[0].kvstore
        caches[flag] = torch.stack([t[:kv.scratch].clone() for t in kv.k + kv.v])   # (the scratch page aside)
    torch.testing.assert_close(caches["1"], caches["0"], rtol=0, atol=0, equal_nan=True)


def test_conventional_attention_takes_the_rows_with_the_paged_kernel(monkeypatch):
    """MPK_CONV_TRITON_ATTN=1: a conventional attention appends the deferred rows (runtime/paged_attention.py, or its
    gather path's own append), so layers whose qkv_rope and attention are both conventional defer as well; a layer
    whose attention is in a megakernel and qkv_rope too still does not."""
    monkeypatch.setenv("MPK_KV_DEFER", "1")
    monkeypatch.setenv("MPK_CONV_TRITON_ATTN", "1")
    cfg = PRESETS["tiny-llama"]
    g = build_graph(cfg, batch=2, context_len=16, max_seq_len=32)
    ops = [o.name for o in g.ops]
    assert kv_defer_layers(g, [("conventional", ops)]) == set(range(cfg.num_layers))
    assert kv_defer_layers(g, [("megakernel", ops)]) == set()
    q1 = ops.index("L1.qkv_rope")
    assert kv_defer_layers(g, [("megakernel", ops[:q1]), ("conventional", ops[q1:])]) == {1}
    monkeypatch.setenv("MPK_KV_DEFER", "0")
    assert kv_defer_layers(g, [("conventional", ops)]) == set()

