"""K/V pass buffers of the attention tasks (Tiling.attn_stages, attention.cuh's NB): 3 when a task walks more than
two passes at the graph's context, else 2; packed into the record's `stages` word, with the shared memory the
kernel is launched with grown to that layout; bad values refused with the variable's name."""
import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling


def _pack(context_len: int, splits: int, **tiling):
    cfg = load_config("tiny-qwen3")
    g = build_graph(cfg, mode="decode", batch=1, context_len=context_len, max_seq_len=1024, tp=1, rank=0,
                    attn_splits=splits, dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8, **tiling))[0]
    kv = KVStore(cfg.num_layers, 1024 // 16 + 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-qwen3", cfg, seed=0, dtype="bfloat16"), kv)
    p = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")
    tasks = p.pack()[0]
    col = L.arg_index("attn_partial", "stages")
    return cfg, p, {int(tasks[t.id, col]) for t in tg.tasks if t.kind == "attn_partial"}


# context + 1 keys (the step's own token): 256 keys are two passes, 257 three
@pytest.mark.parametrize("context,splits,want", [(200, 1, 2), (255, 1, 2), (256, 1, 3), (900, 4, 2), (900, 3, 3)])
def test_auto_stages_follow_the_keys_per_task(context, splits, want):
    cfg, p, stages = _pack(context, splits)
    assert stages == {want}
    assert p.smem >= L.att_smem_bytes(cfg.head_dim, stages=want)


def test_forced_stages_and_their_shared_memory():
    cfg, p2, s2 = _pack(64, 1, attn_stages=2)
    _, p3, s3 = _pack(64, 1, attn_stages=3)
    assert (s2, s3) == ({2}, {3})
    grow = L.att_smem_bytes(cfg.head_dim, stages=3) - L.att_smem_bytes(cfg.head_dim, stages=2)
    assert grow == 2 * L.CONSTANTS["ATT_KP"] * (cfg.head_dim + 8) * 2
    assert p3.smem - p2.smem == grow      # attention is the tiny model's largest layout


def test_three_buffers_fit_a_cta_at_the_largest_head_dim():
    assert L.att_smem_bytes(L.CONSTANTS["MAX_HEAD_DIM"], stages=3) <= 227 * 1024


def test_bad_stage_counts_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="attn_stages=4"):
        Tiling(attn_stages=4)
    monkeypatch.setenv("MPK_ATT_STAGES", "4")
    with pytest.raises(ValueError, match="MPK_ATT_STAGES='4'"):
        Tiling()
    monkeypatch.setenv("MPK_ATT_STAGES", "3")
    assert Tiling().attn_stages == 3
