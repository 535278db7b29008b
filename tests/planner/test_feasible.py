"""planner/feasible.py: a megakernel segment whose task needs more shared memory than a CTA has is not a candidate.
A linear tile keeps its input rows in shared memory (8 rows x K bf16 from TC_MIN_M rows on); long rows without a norm
are held in chunks (codegen/layout.py linear_tile), normed ones cannot be. The per-task bytes are the packer's own
(checked against TaskPacker on the same task graph), and a search of only infeasible families says why."""
import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models import ModelConfig, load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.planner import candidates
from mpk_runtime.planner.feasible import LIMIT, SmemCheck, task_smem
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling

# one layer whose normed inputs (the q / k / v and gate / up projections, the LM head) are 16384 wide: whole rows only
WIDE = ModelConfig(name="wide-h", family="llama", vocab_size=256, hidden_size=16384, intermediate_size=64,
                   num_layers=1, num_heads=128, num_kv_heads=8, head_dim=128, max_position_embeddings=256,
                   tie_word_embeddings=True)


@pytest.mark.parametrize("model,batch", [("tiny-qwen2", 1), ("tiny-qwen2", 3), ("tiny-llama", 8),
                                         ("tiny-llama-k16k", 2), ("tiny-llama-k16k", 8)])
def test_task_bytes_are_the_packers(model, batch):
    cfg = load_config(model)
    g = build_graph(cfg, mode="decode", batch=batch, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=2,
                    dtype="bfloat16")
    tiling = Tiling(num_sms=8)
    tg = build_task_graphs([g], tiling)[0]
    kv = KVStore(cfg.num_layers, batch * 4 + 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights(model, cfg, seed=0, dtype="bfloat16"), kv)
    packer = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu", stage_smem=0)
    tasks = packer.pack()[0]
    sized = [t for t in tg.tasks if t.kind in ("linear", "qkv_rope")]
    assert {t.kind for t in sized} == {"linear", "qkv_rope"}
    for t in sized:
        assert task_smem(t, g) == packer.task_smem[t.id] > 0, (t.op, t.kind)
    check = SmemCheck([g], tiling)
    for o in g.ops:
        if o.kind in ("linear", "qkv_rope"):
            assert check.op_need(o.name) == max(packer.task_smem[t.id] for t in sized if t.op == o.name) <= LIMIT
    if model == "tiny-llama-k16k":   # the down projection's record: rows per pass and x chunks (2 from batch 3)
        word = {int(tasks[t.id][L.arg_index("linear", "tc_rows")]) for t in sized if t.op.endswith(".down")}
        assert word == ({0} if batch < 3 else {8 | 2 << 8})


def test_normed_rows_too_long_for_a_cta_keep_their_ops_out_of_megakernels():
    plans = candidates(WIDE, batch=8, context=128)
    names = {p.name for p in plans}
    assert "mono" not in names and "conventional" in names, names
    why = plans[0].notes["infeasible"]["mono"]
    assert "K=16384" in why and str(LIMIT) in why and int(why.split(" needs ")[1].split(" B")[0]) > LIMIT
    assert "mono" in {p.name for p in candidates(WIDE, batch=2, context=128)}   # its own 2 rows fit
    with pytest.raises(ValueError, match="no plan of mono.*K=16384"):
        candidates(WIDE, batch=8, context=128, families=("mono",))


def test_long_down_projections_fit_in_chunks():
    """The presets whose MLP down projection is too long for whole rows from batch 3 (llama-3.1-8b 14336, qwen3-14b
    17408, qwen2.5-7b 18944): in chunks every op fits. qwen2.5-7b's whole rows need 304128 B, what the megakernel asked
    for at launch on the H100 before chunks (bench/results/s59)."""
    for name in ("llama-3.1-8b", "qwen3-14b", "qwen2.5-7b"):
        cfg = load_config(name)
        g = build_graph(cfg, mode="decode", batch=8, context_len=512, tp=1, rank=0, attn_splits=1)
        check = SmemCheck([g], Tiling(num_sms=132))
        assert check.problem([o.name for o in g.ops][:12]) is None, name
        assert check.op_need("L0.down") <= L.SMEM_BUDGET
    tg = build_task_graphs([g.subgraph(["L0.down"])], Tiling(num_sms=132))[0]
    whole = {L._tile_geometry(8, 18944, t.params["n1"] - t.params["n0"], 1, 1)[1] for t in tg.tasks}
    assert whole == {304128}
