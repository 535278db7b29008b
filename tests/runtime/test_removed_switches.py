"""Switches that measured no gain and were removed: an old A/B script that asks for one is refused by name, not
silently given the default build. The per-warp weight page rings (-DMPK_WRING, MPK_RING_OPS, MPK_RING_QUIET) lost
at batch 1 in every layout of sessions 28-32; batch-1 linear ops in one tile per SM (MPK_LIN_FILL) in session 37;
the down projection fused into the gate_up tiles (MPK_MLP_FUSE, its build -DMPK_MLP=1) in session 38."""
import dataclasses

import pytest
import torch

from mpk_runtime.codegen import nvcc
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import weight_shapes
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling


@pytest.mark.parametrize("defines", ["-DMPK_WRING=128", "-DMPK_WRING=112 -DMPK_RING_SLOT=3584"])
def test_ring_builds_are_refused(monkeypatch, defines):
    monkeypatch.setenv("MPK_NVCC_DEFINES", defines)
    with pytest.raises(nvcc.CompileError, match="MPK_WRING=.*removed.*sessions 28-32.*drop it"):
        nvcc._defines()
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_WRING=0")   # the value the code has: harmless
    assert nvcc._defines() == ["-DMPK_WRING=0"]


def _packer():
    cfg = dataclasses.replace(load_config("tiny-llama"), num_layers=1)
    g = build_graph(cfg, mode="decode", batch=1, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=2,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8))[0]
    kv = KVStore(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, {k: torch.zeros(sh, dtype=torch.bfloat16) for k, sh in weight_shapes(cfg).items()}, kv)
    return TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")


@pytest.mark.parametrize("name,value", [("MPK_RING_OPS", "down,qkv_rope"), ("MPK_RING_QUIET", "1")])
def test_ring_switches_are_refused(monkeypatch, name, value):
    for n in ("MPK_RING_OPS", "MPK_RING_QUIET"):
        monkeypatch.delenv(n, raising=False)
    assert _packer().pack()[0].shape[0] > 0   # unset: packs as always
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}': this option was removed .*session 32"):
        _packer()


def test_lin_fill_is_refused(monkeypatch):
    monkeypatch.setenv("MPK_LIN_FILL", "0")   # asks for what is now the only tiling: harmless
    tiles = _packer().tg.tasks
    assert any(t.kind == "linear" for t in tiles)
    monkeypatch.setenv("MPK_LIN_FILL", "1")
    with pytest.raises(ValueError, match="MPK_LIN_FILL='1': this option was removed .*session 37"):
        _packer()
    with pytest.raises(TypeError):
        Tiling(num_sms=8, lin_fill=True)


def test_mlp_fuse_is_refused(monkeypatch):
    monkeypatch.setenv("MPK_MLP_FUSE", "0")   # asks for the two phases, now the only MLP: harmless
    tg = _packer().tg
    assert {"L0.gate_up", "L0.down"} <= {t.op for t in tg.tasks if t.kind == "linear"}
    monkeypatch.setenv("MPK_MLP_FUSE", "1")
    with pytest.raises(ValueError, match=r"MPK_MLP_FUSE='1': this option was removed .*\+1\.66 / \+3\.97 us a layer.*"
                                         r"\+5\.0 / \+18\.1.*session 38\); unset MPK_MLP_FUSE"):
        _packer()
    cfg = dataclasses.replace(load_config("tiny-qwen3"), num_layers=1)
    with pytest.raises(ValueError, match="MPK_MLP_FUSE"):   # every graph, not only the batch-1 decode ones it fused
        build_graph(cfg, mode="prefill", batch=2, tokens_per_seq=8, context_len=0, max_seq_len=64)


@pytest.mark.parametrize("defines", ["-DMPK_MLP=1", "-DMPK_MLP", "-DMPK_ATT_QKNORM=1 -DMPK_MLP=1"])
def test_mlp_build_is_refused(monkeypatch, defines):
    monkeypatch.setenv("MPK_NVCC_DEFINES", defines)
    with pytest.raises(nvcc.CompileError, match=r"-DMPK_MLP(=1)?: this switch was removed .*MPK_MLP_FUSE.*\+1\.66 / "
                                                 r"\+3\.97 us a layer.*session 38\); drop it"):
        nvcc.build_flags()
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_MLP=0")   # the value the code has: harmless
    assert "-DMPK_MLP=0" in nvcc.build_flags()
