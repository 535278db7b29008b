"""MPK_ATT_DIRECT (packer.attn_direct): only a folded attention group of one split is packed for the direct write
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
from mpk_runtime.tasks.tiling import Tiling


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
