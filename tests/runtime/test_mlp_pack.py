"""MPK_MLP_FUSE=1 packed for the megakernel at llama-3.2-1b's real batch-1 shapes (one layer): each gate_up tile is
an `mlp` record whose gate / up / down pointers are the layer's weights, n0 / n1 its tile, `tiles` the layer's tile
count, all tiles of a layer on one ticket (its own), the accumulator the layer's; the graph asks for a -DMPK_MLP=1
build; and a shape the device op cannot run is refused with what to do."""
import dataclasses

import pytest
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import weight_shapes
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.ops import OPCODES
from mpk_runtime.tasks.tiling import Tiling


def _pack(cfg, batch=1, dtype=torch.bfloat16):
    g = build_graph(cfg, mode="decode", batch=batch, context_len=0, max_seq_len=1024, tp=1, rank=0, attn_splits=8,
                    dtype="bfloat16" if dtype == torch.bfloat16 else "float32")
    tg = build_task_graphs([g], Tiling(num_sms=132))[0]
    kv = KVStore(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, dtype)
    mem = RankMemory(g, {k: torch.empty(sh, dtype=dtype) for k, sh in weight_shapes(cfg).items()}, kv)
    pk = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")
    return tg, mem, pk, pk.pack()[0]


def test_fused_mlp_records_at_llama_shapes(monkeypatch):
    monkeypatch.setenv("MPK_MLP_FUSE", "1")
    cfg = dataclasses.replace(load_config("llama-3.2-1b"), num_layers=1)
    tg, mem, pk, tasks = _pack(cfg)
    mlp = [t for t in tg.tasks if t.kind == "mlp"]
    assert len(mlp) == 128 and not any(t.op == "L0.down" for t in tg.tasks)
    a = lambda t, n: int(tasks[t.id, L.arg_index("mlp", n)])   # noqa: E731
    p = "model.layers.0.mlp."
    ticket = a(mlp[0], "ticket")
    assert ticket == pk.tickets.data_ptr() + 8 * pk._ticket_of[("L0.gate_up", -1, -1)]
    cols = []
    for t in mlp:
        assert int(tasks[t.id, L.TASK_HEADER.index("opcode")]) == OPCODES.index("mlp")
        assert a(t, "w0") == mem.t(p + "gate_proj.weight").data_ptr()
        assert a(t, "w1") == mem.t(p + "up_proj.weight").data_ptr()
        assert a(t, "wd") == mem.t(p + "down_proj.weight").data_ptr()
        assert a(t, "acc") == mem.t("L0.mlp_acc").data_ptr() and a(t, "ticket") == ticket
        assert (a(t, "m"), a(t, "k"), a(t, "i"), a(t, "n"), a(t, "tiles")) == (1, 2048, 8192, 2048, 128)
        assert (a(t, "tc_rows"), a(t, "kseg"), a(t, "row_stride"), a(t, "epilogue")) == (0, 1, 1,
                                                                                       L.EPILOGUES.index("silu_mul"))
        assert int(tasks[t.id, L.TASK_HEADER.index("stage")]) == 0   # op_linear's path, never staged
        cols.append((a(t, "n0"), a(t, "n1")))
    assert sorted(cols) == [(i * 64, i * 64 + 64) for i in range(128)]
    assert "MPK_MLP" in pk.needs


def test_a_shape_the_device_op_cannot_run_is_refused(monkeypatch):
    monkeypatch.setenv("MPK_MLP_FUSE", "1")
    cfg = dataclasses.replace(load_config("tiny-llama"), num_layers=1)
    with pytest.raises(ValueError, match="fused MLP tile cannot run this shape: activations and weights other than "
                                         "bf16; unset MPK_MLP_FUSE"):
        _pack(cfg, dtype=torch.float32)
