"""Whether a megakernel segment can launch: the shared memory of its largest task (the packer's layouts, one
definition in codegen/layout.py) against a CTA's. A linear tile keeps its input rows in shared memory (8 rows x K bf16
from TC_MIN_M rows on); rows too long for that are held in chunks (layout.linear_tile: the MLP down projections of
llama-3.1-8b, qwen3-14b / 32b, qwen2.5-7b), but not where the input is normed (RMSNorm needs the whole row) or K is
reduced in segments (tp_invariant graphs). Segments holding an op that fits no layout are not candidates; plans that
keep it out of megakernels (attn-mk, conventional) still are."""
from __future__ import annotations

from ..codegen import layout as L
from ..ir.graph import Graph
from ..tasks import Tiling
from ..tasks.build import build_task_graphs

LIMIT = L.ATT_SMEM_MAX   # a task's dynamic shared memory, at most (the kernel's static share reserved)


def task_smem(task, graph: Graph) -> int:
    """Dynamic shared bytes the packer lays out for this task (linear and qkv_rope: the ones that grow with K; the
    other kinds are sized to fit by construction or raise in the packer with their own remedy)."""
    p = task.params
    if task.kind == "linear":
        K = graph.tensors[p["x"]].shape[1]
        M = graph.tensors[p["out"]].shape[-2]    # (M, N), or a push buffer's (..., M, N)
        return L.linear_geometry(M, K, p["n1"] - p["n0"], len(p["weights"]), p.get("k_segments", 1),
                                 bool(p.get("norm")))[1]
    if task.kind == "qkv_rope":
        M, K = graph.tensors[p["x"]].shape
        return L.qkv_rope_smem(M, K)
    return 0


class SmemCheck:
    """Per op (memoised on its kind and shapes: identical layers are checked once): the largest task's shared bytes;
    `problem(ops)` names the first op of a segment over LIMIT, or None."""

    def __init__(self, graphs: list[Graph], tiling: Tiling):
        self.graphs, self.graph, self.tiling = graphs, graphs[0], tiling   # (one graph per rank; rank 0's tasks)
        self._op = {o.name: o for o in self.graph.ops}
        self._memo: dict = {}

    def op_need(self, name: str) -> int:
        o = self._op[name]
        if o.kind not in ("linear", "qkv_rope"):
            return 0
        key = (o.kind, tuple(self.graph.tensors[t].shape for t in o.inputs + o.outputs), len(o.attrs.get("weights", ())),
               o.attrs.get("k_segments", 1), bool(o.attrs.get("norm")))
        if key not in self._memo:
            tg = build_task_graphs([g.subgraph([name]) for g in self.graphs], self.tiling)[0]
            self._memo[key] = max((task_smem(t, self.graph) for t in tg.tasks), default=0)
        return self._memo[key]

    def problem(self, ops: list[str]) -> str | None:
        for n in ops:
            need = self.op_need(n)
            if need > LIMIT:
                o = self._op[n]
                K = self.graph.tensors[o.attrs["x"]].shape[1]
                return (f"{n} ({o.kind}, K={K}) needs {need} B of shared memory per task, over the {LIMIT} B a CTA has "
                        f"(its input rows, normed or in K segments, are kept whole)")
        return None
