"""MPK_ATT_DIRECT (tiling.attn_direct): only a folded attention group of one split is packed for the direct write
of its output (attention.cuh: the chunk written as the merge of one chunk writes it)."""
import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling, attn_groups_cost, attn_groups_max


@pytest.mark.parametrize("splits,fold,env,want", [(1, True, "1", 1), (1, True, "", 1), (1, True, "0", 0),
                                                  (2, True, "1", 0), (1, False, "1", 0)])
def test_direct_flag_packed_only_for_a_folded_single_split(monkeypatch, splits, fold, env, want):
    monkeypatch.setenv("MPK_ATT_DIRECT", env)
    cfg = load_config("tiny-llama")
    g = build_graph(cfg, mode="decode", batch=2, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=splits,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8, attn_fold_merge=fold))[0]
    kv = KVStore(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16"), kv)
    tasks = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu").pack()[0]
    col = L.arg_index("attn_partial", "direct")
    rows = [int(tasks[t.id][col]) for t in tg.tasks if t.kind == "attn_partial"]
    assert rows and all(r == want for r in rows)


@pytest.mark.parametrize("direct_env,groups", [("1", 2), ("0", 2), ("1", 1)])
def test_grouped_attention_tasks_are_packed_with_their_group_count_and_need_the_direct_write(monkeypatch, direct_env,
                                                                                              groups):
    """Tiling.attn_groups: the packed `ng` word is the task's group count, its smem need covers the merge region,
    and a grouped task without the direct write is refused with what to change."""
    monkeypatch.setenv("MPK_ATT_DIRECT", direct_env)
    cfg = load_config("tiny-llama")
    g = build_graph(cfg, mode="decode", batch=2, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=1,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8, attn_fold_merge=True, attn_groups=groups))[0]
    kv = KVStore(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16"), kv)
    packer = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")
    if groups > 1 and direct_env == "0":
        with pytest.raises(ValueError, match="MPK_ATT_DIRECT"):
            packer.pack()
        return
    tasks = packer.pack()[0]
    col = L.arg_index("attn_partial", "ng")
    rows = [int(tasks[t.id][col]) for t in tg.tasks if t.kind == "attn_partial"]
    assert rows and set(rows) == {groups}
    assert len(rows) * groups == 2 * cfg.num_kv_heads * cfg.num_layers
    assert packer.smem >= L.att_smem_bytes(cfg.head_dim, ng=groups) > (L.att_smem_bytes(cfg.head_dim)
                                                                          if groups > 1 else 0)


def test_att_groups_env_overrides_a_cached_plans_tiling(monkeypatch):
    """A plan book on disk carries its tiling; MPK_ATT_GROUPS (the A/B switch) still applies to it, and a bad value
    is refused with the variable's name."""
    from mpk_runtime.runtime.plan_exec import _tiling
    monkeypatch.delenv("MPK_ATTN_FOLD", raising=False)
    d = Tiling(num_sms=8, attn_groups=1).to_dict()
    monkeypatch.delenv("MPK_ATT_GROUPS", raising=False)
    assert _tiling(d, None).attn_groups == 1
    monkeypatch.setenv("MPK_ATT_GROUPS", "2")
    assert _tiling(d, 16).attn_groups == 2 and _tiling(d, 16).num_sms == 16
    monkeypatch.setenv("MPK_ATT_GROUPS", "two")
    with pytest.raises(ValueError, match="MPK_ATT_GROUPS"):
        _tiling(d, None)
    monkeypatch.delenv("MPK_ATT_GROUPS")
    assert _tiling(d, None).attn_fold_merge is True    # every env-backed field alike (tiling.ENV_FIELDS)
    monkeypatch.setenv("MPK_ATTN_FOLD", "0")
    assert _tiling(d, None).attn_fold_merge is False


def test_attention_stages_size_the_shared_memory_and_too_many_are_refused(monkeypatch):
    """MPK_ATT_STAGES (a compile-time define of the warp-pipelined attention): the packer sizes the task's shared
    memory for that many K/V buffers, and refuses a layout past 227 KiB with what to lower."""
    cfg = load_config("tiny-llama")
    g = build_graph(cfg, mode="decode", batch=2, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=1,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8, attn_fold_merge=True))[0]
    kv = KVStore(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16"), kv)
    sizes = {}
    for st in (2, 3):
        monkeypatch.setenv("MPK_NVCC_DEFINES", f"-DMPK_ATT_WARP_PIPE=1 -DMPK_ATT_STAGES={st}")
        p = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")
        p.pack()
        sizes[st] = p.smem
        assert p.smem >= L.att_smem_bytes(cfg.head_dim, stages=st)
    assert sizes[3] >= L.att_smem_bytes(cfg.head_dim, stages=3) > L.att_smem_bytes(cfg.head_dim, stages=2)
    packer = TaskPacker(tg, mem, 0x6000, 128, device="cpu")   # a 128-wide head with 6 narrow stages: 421 KB
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_WARP_PIPE=1 -DMPK_ATT_STAGES=6")
    with pytest.raises(ValueError, match="fewer stages"):
        packer.pack()


def test_attention_groups_auto_default_applies_only_where_it_can(monkeypatch):
    """Tiling.attn_groups = 0 (the default): KV groups per task where the keys are one split, the direct write is on
    and the groups' q heads (ATT_MAX_QH) and shared memory fit, as many as minimise waves x per-task passes
    (tiling.attn_groups_cost); one group elsewhere (no error: the user asked for nothing). An explicit
    MPK_ATT_GROUPS is taken as asked (the packer refuses what cannot run)."""
    for v in ("MPK_ATT_GROUPS", "MPK_NVCC_DEFINES", "MPK_ATT_DIRECT", "MPK_ATTN_FOLD", "MPK_ATT_GROUPS_MAX"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("MPK_ATT_WIDE", "0")   # narrow passes: the grouping rule alone (yielding to wide ones: below)
    t = Tiling()   # 132 SMs
    assert t.attn_groups == 0
    # a cap of 2 (the default before session 23's A/B): grouped from one wave of pairs on
    monkeypatch.setenv("MPK_ATT_GROUPS_MAX", "2")
    assert t.attn_g(1, 4, 8, 64, 128) == 2 and t.attn_g(1, 4, 8, 128, 17) == 2 and t.attn_g(1, 4, 8, 128, 16) == 1
    monkeypatch.delenv("MPK_ATT_GROUPS_MAX")   # the default cap: 8 (every KV group of a sequence)
    assert attn_groups_max() == 8
    assert t.attn_g(1, 4, 8, 128, 32) == 2                      # 256 units: one wave of 2-group tasks
    assert t.attn_g(1, 4, 8, 64, 128) == 8                      # 1024 units: one wave of whole sequences
    assert t.attn_g(1, 4, 8, 64, 128, keys=513) == 8 and t.attn_g(1, 4, 8, 64, 96, keys=513) == 2
    assert t.attn_g(1, 4, 8, 128, 16) == 1                      # 128 units: one per SM, grouping would only serialise
    assert t.attn_g(1, 4, 8, 64, 8, keys=4097) == 1
    assert t.attn_g(2, 4, 8, 128, 32) == 1                      # keys split: groups do not apply
    assert t.attn_g(1, 8, 8, 128, 128) == 4                     # 4 x 8 q heads = ATT_MAX_QH
    assert Tiling(attn_groups=8).attn_g(1, 8, 8, 128, 128) == 4   # asked for more: the most that fit
    assert t.attn_g(1, 4, 1, 128, 256) == 1                     # one KV head
    assert Tiling(num_sms=8).attn_g(1, 4, 8, 128, 2) == 2      # 16 units on 8 SMs
    assert Tiling(attn_fold_merge=False).attn_g(1, 4, 8, 128, 32) == 1
    assert Tiling(attn_groups=2).attn_g(1, 4, 8, 128, 1) == 2   # asked for: taken whatever the batch
    # the model: a wave of whole sequences beats 4 waves of pairs at 1024 units, and 8 waves of singles
    assert attn_groups_cost(1024, 8, 3, 132) < attn_groups_cost(1024, 2, 3, 132) < attn_groups_cost(1024, 1, 3, 132)
    assert attn_groups_cost(64, 1, 3, 132) < attn_groups_cost(64, 2, 3, 132)
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_STAGES=3")   # 3 K/V stages of 128-wide heads: no room
    assert L.att_smem_bytes(128, ng=2, stages=3) > L.ATT_SMEM_MAX >= L.att_smem_bytes(64, ng=2, stages=3)
    assert t.attn_g(1, 4, 8, 128, 32) == 1 and t.attn_g(1, 4, 8, 64, 32) == 2
    assert Tiling(attn_groups=2).attn_g(1, 4, 8, 128, 32) == 2  # asked for: kept (the packer says what to lower)
    monkeypatch.delenv("MPK_NVCC_DEFINES")
    monkeypatch.setenv("MPK_ATT_DIRECT", "0")
    assert t.attn_g(1, 4, 8, 128, 32) == 1 and Tiling(attn_groups=2).attn_g(1, 4, 8, 128, 32) == 2
    cfg = load_config("tiny-llama")   # the default with the direct write off packs (one group per task)
    g = build_graph(cfg, mode="decode", batch=2, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=1,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8))[0]
    kv = KVStore(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16"), kv)
    tasks = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu").pack()[0]
    assert {int(tasks[u.id][L.arg_index("attn_partial", "ng")]) for u in tg.tasks if u.kind == "attn_partial"} == {1}


@pytest.mark.parametrize("env,defines,head_dim,want", [("", "", 16, 2), ("", "", 64, 2), ("0", "", 64, 1),
                                                        ("", "", 128, 1), ("1", "-DMPK_ATT_WARP_PIPE=0", 64, 1),
                                                        ("", "-DMPK_ATT_STAGES=3", 64, 1), ("1", "", 16, 2),
                                                        # the packed word when narrow: the only packing case
                                                        # (tiny-llama's head dim 16) where attn_wide says 1
                                                        ("0", "", 16, 1)])
def test_wide_attention_passes_are_packed_where_the_head_and_shared_memory_allow(monkeypatch, env, defines,
                                                                                  head_dim, want):
    """tiling.attn_wide: two 16-key tiles per warp and pass for head dims <= 64 with the warp pipe, where the doubled
    K/V buffers fit (three stages of grouped 64-wide tasks do not), else narrow (128-wide heads always);
    MPK_ATT_WIDE=0 keeps narrow passes, =1 is the default. The packed `wide` word is that width, and the kernel's
    shared memory covers its buffers."""
    from mpk_runtime.tasks.tiling import attn_wide
    monkeypatch.setenv("MPK_ATT_WIDE", env)
    monkeypatch.setenv("MPK_NVCC_DEFINES", defines)
    monkeypatch.delenv("MPK_ATT_GROUPS", raising=False)
    ng = 2 if "STAGES=3" in defines else 1
    monkeypatch.setenv("MPK_ATT_GROUPS", "0")
    assert attn_wide(head_dim, ng) == want
    if head_dim != 16:
        return
    cfg = load_config("tiny-llama")   # head_dim 16
    g = build_graph(cfg, mode="decode", batch=2, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=1,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8, attn_fold_merge=True))[0]
    kv = KVStore(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16"), kv)
    packer = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")
    tasks = packer.pack()[0]
    col = L.arg_index("attn_partial", "wide")
    rows = [int(tasks[t.id][col]) for t in tg.tasks if t.kind == "attn_partial"]
    assert rows and set(rows) == {want}
    assert packer.smem >= L.att_smem_bytes(cfg.head_dim, wide=want)
    assert L.att_smem_bytes(64, wide=2) - L.att_smem_bytes(64) == 2 * 2 * L.CONSTANTS["ATT_KP"] * 72 * 2   # K + V, 2 stages
    assert L.att_smem_bytes(128, wide=2) > L.ATT_SMEM_MAX   # (why 128-wide heads keep narrow passes)


@pytest.mark.parametrize("bad", ["2", "ring", "yes"])
def test_bad_wide_switch_is_refused(monkeypatch, bad):
    """MPK_ATT_WIDE takes unset, 1 or 0: anything else is an error naming them, not a silent default (ring too:
    removed in session 20, slower than the narrow passes on qwen3-8b)."""
    from mpk_runtime.tasks.tiling import attn_wide
    monkeypatch.setenv("MPK_ATT_WIDE", bad)
    with pytest.raises(ValueError, match=r"MPK_ATT_WIDE=.*unset or 1.*or 0"):
        attn_wide(64)


def test_grouping_yields_to_the_wide_passes_of_small_heads(monkeypatch):
    """Auto grouping (two KV groups per task) keeps one group where two would leave a small head no room for the wide
    passes (here: a shared memory limit between the two needs); with MPK_ATT_WIDE=0 it groups as the narrow rule
    says; 128-wide heads (narrow passes) group by default. Three K/V stages leave 64-wide heads no room for wide
    passes at all (231 KB + the kernel's static shared memory > 227 KB): narrow passes, grouped."""
    from mpk_runtime.tasks import tiling
    for v in ("MPK_ATT_GROUPS", "MPK_NVCC_DEFINES", "MPK_ATT_DIRECT", "MPK_ATTN_FOLD", "MPK_ATT_WIDE"):
        monkeypatch.delenv(v, raising=False)
    t = Tiling()
    assert t.attn_g(1, 4, 8, 128, 32) == 2 and t.attn_g(1, 4, 8, 64, 32) == 2
    assert tiling.attn_wide(64, 2) == 2
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_STAGES=3")
    assert L.att_smem_bytes(64, stages=3, wide=2) > L.ATT_SMEM_MAX >= L.att_smem_bytes(64, ng=2, stages=3)
    assert tiling.attn_wide(64, 1) == 1 and t.attn_g(1, 4, 8, 64, 32) == 2
    monkeypatch.delenv("MPK_NVCC_DEFINES")
    limit = (L.att_smem_bytes(64, wide=2) + L.att_smem_bytes(64, ng=2, wide=2)) // 2
    monkeypatch.setattr(L, "ATT_SMEM_MAX", limit)
    tiling._attn_wide.cache_clear()
    try:
        assert tiling.attn_wide(64, 1) == 2 and tiling.attn_wide(64, 2) == 1 and t.attn_g(1, 4, 8, 64, 32) == 1
        monkeypatch.setenv("MPK_ATT_WIDE", "0")
        assert t.attn_g(1, 4, 8, 64, 32) == 2
    finally:
        tiling._attn_wide.cache_clear()


def test_128_wide_heads_are_packed_narrow_and_grouped(monkeypatch):
    """tiny-qwen3-d128 (qwen3-8b's head dim) by default: attention tasks packed with narrow passes (wide = 1), two
    KV groups each where auto grouping applies, and the kernel's shared memory covers them within the SM's limit."""
    for v in ("MPK_ATT_GROUPS", "MPK_NVCC_DEFINES", "MPK_ATT_DIRECT", "MPK_ATTN_FOLD", "MPK_ATT_WIDE"):
        monkeypatch.delenv(v, raising=False)
    cfg = load_config("tiny-qwen3-d128")
    g = build_graph(cfg, mode="decode", batch=200, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=1,
                    dtype="bfloat16")   # 400 (sequence, KV group) units on 8 SMs: auto groups
    tg = build_task_graphs([g], Tiling(num_sms=8, attn_fold_merge=True))[0]
    kv = KVStore(cfg.num_layers, 800, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-qwen3-d128", cfg, seed=0, dtype="bfloat16"), kv)
    packer = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")
    tasks = packer.pack()[0]
    att = [t for t in tg.tasks if t.kind == "attn_partial"]
    assert {int(tasks[t.id][L.arg_index("attn_partial", "wide")]) for t in att} == {1}
    assert {int(tasks[t.id][L.arg_index("attn_partial", "ng")]) for t in att} == {2}
    assert L.att_smem_bytes(128, ng=2) <= packer.smem <= L.ATT_SMEM_MAX


def test_three_stages_keep_64_wide_heads_narrow_and_removed_switches_are_refused(monkeypatch):
    """Three K/V stages of wide passes do not fit at head dim 64 (padded rows), so MPK_ATT_STAGES=3 keeps them
    narrow; a build switch that was measured and removed (MPK_ATT_SWIZZLE, session 21) is refused by name, not
    silently ignored."""
    from mpk_runtime.codegen import nvcc
    from mpk_runtime.tasks import tiling
    for v in ("MPK_ATT_GROUPS", "MPK_ATT_DIRECT", "MPK_ATTN_FOLD", "MPK_ATT_WIDE"):
        monkeypatch.delenv(v, raising=False)
    assert L.att_smem_bytes(64, stages=2, wide=2) <= L.ATT_SMEM_MAX < L.att_smem_bytes(64, stages=3, wide=2)
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_STAGES=3")
    assert tiling.attn_wide(64) == 1
    monkeypatch.setenv("MPK_NVCC_DEFINES", "")
    assert tiling.attn_wide(64) == 2 and tiling.attn_wide(128) == 1
    for define in ("-DMPK_ATT_SWIZZLE=1", "-DMPK_ATT_EXP2=1", "-DMPK_ATT_ISSUE_UNROLL=4"):
        monkeypatch.setenv("MPK_NVCC_DEFINES", f"-DMPK_ATT_STAGES=2 {define}")
        with pytest.raises(nvcc.CompileError, match=f"{define.split('=')[0]}=.*removed.*drop it"):
            tiling.attn_wide(64)


@pytest.mark.parametrize("tp_inv,tp", [(1, 1), (2, 1), (2, 2)])
def test_tp_invariant_graphs_keep_one_kv_group_per_attention_task(tp_inv, tp):
    """The default build runs a task's groups side by side over 8 / ng warps each (attention.cuh gwm), so a
    group's sums depend on ng, and ng follows the rank's KV heads: tp_invariant graphs (TP=1 and TP=R bit for bit)
    keep ng = 1 at every degree, even where the tiling is asked for groups; other graphs group as asked."""
    cfg = load_config("tiny-llama")
    til = Tiling(num_sms=8, attn_fold_merge=True, attn_groups=2)
    gs = [build_graph(cfg, mode="decode", batch=2, context_len=0, max_seq_len=64, tp=tp, rank=r, attn_splits=1,
                      dtype="bfloat16", tp_invariant=tp_inv) for r in range(tp)]
    tg = build_task_graphs(gs, til)[0]
    ngs = [t.params.get("ng", 1) for t in tg.tasks if t.kind == "attn_partial"]
    want = 1 if tp_inv > 1 else 2
    assert ngs and set(ngs) == {want}
    assert len(ngs) * want == 2 * (cfg.num_kv_heads // tp) * cfg.num_layers
