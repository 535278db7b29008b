"""tp_invariant graphs pin the Tensor Core k-slice count (packed `kslices` word = 1) on every linear and qkv_rope
task, because the auto count follows the tile width and TP=1 / TP=2 tiles of a column-parallel op differ in
width (the GPU check at 57a623e: B=8 TP=1 != TP=2 from step 0 while B=1, CUDA-core path, was identical)."""
import torch

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.ir.graph import Graph
from mpk_runtime.models.config import load_config
from mpk_runtime.models.weights import get_weights
from mpk_runtime.runtime.packer import L_OPCODE, TaskPacker
from mpk_runtime.runtime.memory import KVStore, RankMemory
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.tiling import Tiling


def _pack(inv: int):
    cfg = load_config("tiny-llama")
    g = build_graph(cfg, mode="decode", batch=8, context_len=0, max_seq_len=64, tp=1, rank=0, attn_splits=2,
                    dtype="bfloat16", tp_invariant=inv)
    tg = build_task_graphs([g], Tiling(num_sms=8))[0]
    kv = KVStore(cfg.num_layers, 9, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16"), kv)
    tasks = TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu").pack()[0]
    out = {}
    for kind in ("linear", "qkv_rope"):
        rows = tasks[tasks[:, L.TASK_HEADER.index("opcode")] == L_OPCODE[kind]]
        out[kind] = set(rows[:, L.arg_index(kind, "kslices")].tolist())
    return g, out


def test_tp_invariant_pins_one_k_slice():
    g, inv = _pack(2)
    assert inv == {"linear": {1}, "qkv_rope": {1}}
    _, auto = _pack(1)
    assert auto == {"linear": {0}, "qkv_rope": {0}}
    # the flag survives serialisation and plan segments (subgraphs build the segment's task graphs)
    assert Graph.from_dict(g.to_dict()).tp_invariant == 2
    assert g.subgraph([o.name for o in g.ops[:3]]).tp_invariant == 2


def test_column_parallel_tiles_differ_in_width_between_tp1_and_tp2():
    """Why the pin is needed: the same gate/up op is cut into narrower tiles per rank at TP=2."""
    cfg = load_config("llama-3.2-1b")
    til = Tiling(num_sms=132)
    widths = []
    for tp in (1, 2):
        g = build_graph(cfg, mode="decode", batch=8, context_len=0, max_seq_len=64, tp=tp, rank=0, tp_invariant=2)
        op = g.op("L0.gate_up")
        widths.append(til.linear_n(g, op, g.tensors[op.attrs["out"]].shape[-1]))
    assert widths[0] != widths[1]
