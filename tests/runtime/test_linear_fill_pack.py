"""Tiling.lin_fill (MPK_LIN_FILL=1, session 36) packed for the megakernel at llama-3.2-1b's real batch-1 shapes: o_proj,
gate_up and down each in 132 tiles (one per SM; 16-column tiles give 128), widths differing by at most one column,
covering the op in order; each packed record's n0 / n1 its task's and its weight pointers the op's own (the kernel
reads row n at w0 + n K). tests/runtime/test_pyvm.py checks the values; tests/gpu/test_megakernel.py the kernel."""
import dataclasses

import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import weight_shapes
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.runtime.packer import TaskPacker
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling


def test_filled_linear_tiles_at_llama_shapes():
    cfg = dataclasses.replace(load_config("llama-3.2-1b"), num_layers=1)
    g = build_graph(cfg, mode="decode", batch=1, context_len=0, max_seq_len=1024, tp=1, rank=0, attn_splits=8,
                    dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=132, lin_fill=True))[0]
    base = build_task_graphs([g], Tiling(num_sms=132, lin_fill=False))[0]
    kv = KVStore(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    w = {k: torch.empty(sh, dtype=torch.bfloat16) for k, sh in weight_shapes(cfg).items()}
    mem = RankMemory(g, w, kv)
    tasks = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu").pack()[0]
    a = lambda t, n: int(tasks[t.id, L.arg_index("linear", n)])   # noqa: E731
    for op, N in (("L0.o_proj", cfg.hidden_size), ("L0.gate_up", cfg.intermediate_size),
                  ("L0.down", cfg.hidden_size)):
        lin = sorted((t for t in tg.tasks if t.op == op and t.kind == "linear"), key=lambda t: t.params["n0"])
        assert len(lin) == 132, (op, len(lin))
        assert len([t for t in base.tasks if t.op == op and t.kind == "linear"]) == 128
        spans = [(a(t, "n0"), a(t, "n1")) for t in lin]
        assert spans == [(t.params["n0"], t.params["n1"]) for t in lin]
        assert spans[0][0] == 0 and spans[-1][1] == N and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
        widths = [n1 - n0 for n0, n1 in spans]
        assert max(widths) - min(widths) <= 1, (op, set(widths))
        assert len({a(t, "w0") for t in lin}) == 1 and a(lin[0], "tc_rows") == 0, op
