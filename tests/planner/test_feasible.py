"""planner/feasible.py: a megakernel segment whose task needs more shared memory than a CTA has is not a candidate
(a linear tile keeps its input rows whole: 8 rows x K bf16 from TC_MIN_M rows on). Its per-task bytes are the packer's
own (checked against TaskPacker on the same task graph), and a search of only such families says why."""
import pytest
import torch

from mpk_runtime.ir.build import build_graph
from mpk_runtime.models import ModelConfig, load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.planner import candidates
from mpk_runtime.planner.feasible import LIMIT, SmemCheck, task_smem
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling

# one layer with an MLP reduction as long as qwen2.5-7b's down projection (K = 18944), at test size otherwise
LONG_K = ModelConfig(name="long-k", family="qwen2", vocab_size=256, hidden_size=64, intermediate_size=18944,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
                     tie_word_embeddings=True)


@pytest.mark.parametrize("cfg,batch", [(load_config("tiny-qwen2"), 1), (load_config("tiny-qwen2"), 3),
                                       (load_config("tiny-llama"), 8), (LONG_K, 2)], ids=str)
def test_task_bytes_are_the_packers(cfg, batch):
    g = build_graph(cfg, mode="decode", batch=batch, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=2,
                    dtype="bfloat16")
    tiling = Tiling(num_sms=8)
    tg = build_task_graphs([g], tiling)[0]
    kv = KVStore(cfg.num_layers, batch * 4 + 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights(cfg.name if cfg is not LONG_K else "", cfg, seed=0, dtype="bfloat16"), kv)
    packer = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu", stage_smem=0)
    packer.pack()
    sized = [t for t in tg.tasks if t.kind in ("linear", "qkv_rope")]
    assert {t.kind for t in sized} == {"linear", "qkv_rope"}
    for t in sized:
        assert task_smem(t, g) == packer.task_smem[t.id] > 0, (t.op, t.kind)
    check = SmemCheck([g], tiling)
    for o in g.ops:
        if o.kind in ("linear", "qkv_rope"):
            assert check.op_need(o.name) == max(packer.task_smem[t.id] for t in sized if t.op == o.name)


def test_a_long_reduction_is_kept_out_of_megakernels_from_the_tensor_core_batch():
    for batch, fits in ((2, True), (3, False), (8, False)):
        plans = candidates(LONG_K, batch=batch, context=128)
        names = {p.name for p in plans}
        assert ("mono" in names) == fits and {"attn-mk", "conventional"} <= names, (batch, names)
        if not fits:
            why = plans[0].notes["infeasible"]["mono"]
            assert "L0.down" in why and "K=18944" in why and str(LIMIT) in why
            assert int(why.split(" needs ")[1].split(" B")[0]) > 8 * 18944 * 2 > LIMIT   # 8 rows x K bf16, and more
    with pytest.raises(ValueError, match="no plan of mono.*L0.down"):
        candidates(LONG_K, batch=8, context=128, families=("mono",))


def test_presets_whose_down_projection_does_not_fit():
    """The presets with K past ~14.5k inputs (qwen2.5-7b 18944, qwen3-14b 17408) have no one-megakernel plan from
    batch 3; qwen3-8b (12288) keeps it."""
    for name, fits in (("qwen2.5-7b", False), ("qwen3-14b", False), ("qwen3-8b", True)):
        cfg = load_config(name)
        g = build_graph(cfg, mode="decode", batch=8, context_len=512, tp=1, rank=0, attn_splits=1)
        check = SmemCheck([g], Tiling(num_sms=132))
        assert (check.problem([o.name for o in g.ops][:12]) is None) == fits, name
        if name == "qwen2.5-7b":   # what the megakernel asked for at launch on the H100 (bench/results/s59)
            assert check.op_need("L0.down") == 304128
