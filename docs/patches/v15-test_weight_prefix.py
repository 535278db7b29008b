"""The weight prefix (codegen/layout.py PF_SMEM_*): before a linear or qkv_rope task waits on its events, thread 0
bulk-copies the first weight rows of its tile into shared memory past the task's own buffers, and linear.cuh reads
those rows from there. The packer decides offset and size; these tests pin its rules on CPU (the device side is
checked bitwise against prefix 0 in tests/gpu/test_megakernel.py)."""
import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.runtime.megakernel import TaskPacker, _prefix_smem_default
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling

_CACHE: dict = {}


def _rig(model, B):
    if (model, B) not in _CACHE:
        cfg = load_config(model)
        g = build_graph(cfg, mode="decode", batch=B, context_len=0, max_seq_len=64, attn_splits=2, dtype="bfloat16")
        tg = build_task_graphs([g], Tiling(num_sms=8))[0]
        kv = KVStore(cfg.num_layers, B * 4 + 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
        _CACHE[model, B] = (cfg, tg, RankMemory(g, get_weights(model, cfg, seed=0, dtype="bfloat16"), kv))
    return _CACHE[model, B]


def _own_need(t, cfg, tg, mem, B):
    """A task's own shared memory, computed here from the kernel's layouts (not read back from the packer)."""
    p = t.params
    if t.kind == "linear":
        K = mem.t(p["x"]).shape[1]
        M = mem.t(p["out"]).shape[0] if not p["push"] else mem.syms[p["out"]].shape[-2]
        return L.linear_geometry(M, K, p["n1"] - p["n0"], len(p["weights"]), p.get("k_segments", 1))[1]
    K = mem.t(p["x"]).shape[1]
    xr = B if B < L.CONSTANTS["TC_MIN_M"] else L.CONSTANTS["ROW_TILE"]
    return ((xr * K * 2 + 15) & ~15) + xr * L.CONSTANTS["MAX_HEAD_DIM"] * 4 + 2 * 8 * 16 * 8 * 4


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("total", [0, 8 * 1024, 16 * 1024, 24 * 1024, L.SMEM_PF_TOTAL])
def test_prefix_fits_past_the_tasks_own_buffers(model, B, total):
    cfg, tg, mem = _rig(model, B)
    p = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu", prefix_smem=total)
    tasks = p.pack()[0]
    pf = p.prefetch
    n_prefix = n_partial = 0
    for t in tg.tasks:
        off, nb = int(pf[t.id, L.PF_SMEM_OFF]), int(pf[t.id, L.PF_SMEM_BYTES])
        if t.kind not in ("linear", "qkv_rope"):
            assert (off, nb) == (0, 0), t.label()
            continue
        if nb == 0:
            continue
        n_prefix += 1
        nr = int(pf[t.id, 0] != 0) + int(pf[t.id, 2] != 0)
        K = mem.t(t.params["x"]).shape[1]
        rows, rem = divmod(nb, 2 * K)
        assert rem == 0 and rows > 0                                   # whole weight rows
        assert nb <= int(pf[t.id, 1]) and (nr == 1 or nb <= int(pf[t.id, 3]))
        assert off % L.SMEM_PF_ALIGN == 0 and off >= _own_need(t, cfg, tg, mem, B), t.label()
        assert off + nr * nb <= total and off + nr * nb <= p.smem       # inside the CTA's dynamic shared memory
        assert all(int(pf[t.id, 2 * r]) % 16 == 0 for r in range(nr))  # bulk copies need 16-byte alignment
        partial = nb < int(pf[t.id, 1])
        n_partial += partial
        tc = (tasks[t.id, L.arg_index("linear", "tc_rows")] > 0 if t.kind == "linear"
              else B >= L.CONSTANTS["TC_MIN_M"])
        if tc and partial:
            assert rows % 16 == 0, t.label()                           # whole 16-row n-tiles on Tensor Cores
    if total == 0:
        assert n_prefix == 0
    if total == L.SMEM_PF_TOTAL:   # tiny tiles fit whole
        assert n_prefix == sum(t.kind in ("linear", "qkv_rope") for t in tg.tasks) and n_partial == 0


def test_partial_prefixes_exist_at_the_tight_budgets_the_gpu_test_uses():
    """tests/gpu compares prefix budgets 8/16/24 KiB against 0 bitwise; they must include partial prefixes (rows
    read from shared memory and the rest from global memory in one tile) on both models and batch sizes."""
    for model in ("tiny-llama", "tiny-qwen3"):
        for B in (1, 8):
            cfg, tg, mem = _rig(model, B)
            part = 0
            for total in (8 * 1024, 16 * 1024, 24 * 1024):
                p = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu", prefix_smem=total)
                p.pack()
                pf = p.prefetch
                part += int(((pf[:, L.PF_SMEM_BYTES] > 0) & (pf[:, L.PF_SMEM_BYTES] < pf[:, 1])).sum())
            assert part > 0, (model, B)


def test_prefix_budget_from_the_environment(monkeypatch):
    monkeypatch.delenv("MPK_PREFIX_SMEM", raising=False)
    assert _prefix_smem_default() == L.SMEM_PF_TOTAL
    monkeypatch.setenv("MPK_PREFIX_SMEM", "0")
    assert _prefix_smem_default() == 0
    monkeypatch.setenv("MPK_PREFIX_SMEM", "lots")
    with pytest.raises(ValueError, match="byte count"):
        _prefix_smem_default()
    monkeypatch.setenv("MPK_PREFIX_SMEM", str(300 * 1024))
    with pytest.raises(ValueError, match="227 KiB"):
        _prefix_smem_default()
