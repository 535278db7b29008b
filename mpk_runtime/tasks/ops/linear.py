"""linear: y[:, n0:n1] = epilogue(norm?(x) @ W[n0:n1].T) (+ residual), one task per output-column tile.

Fusions (each saves a dependency, which costs about as much as streaming 2 MB of weights):
  norm       RMSNorm of the input rows recomputed in every tile (reads B x K, tiny next to the weight tile)
  silu_mul   two weights (gate, up): y = silu(x Wg^T) * (x Wu^T) on the same columns
  residual   y += residual[:, n0:n1]                                  (tp == 1 row-parallel projections)
  push       y goes, in fp32 (not rounded to bf16), into slot `rank` of every rank's symmetric partial-sum buffer
             (tp > 1)
  k_segments K reduced in equal segments, each as one rank of a wider TP group would, summed in fp32 in order
             (build_graph tp_invariant: TP=1 and TP=R then produce bit-identical activations on the GPU)
  k_slices   Tensor Core tiles: how many warp k-slices each 16-column n-tile's K segment is summed in (0 = auto
             from the tile width, which differs between a TP=1 and a TP=R tile; tp_invariant graphs fix it to 1,
             one fp32 chain over K per column, so the sum order no longer depends on the tile width)
  row_select the LM head of a prefill chunk reads only each sequence's last row
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..graph import Region, Task
from . import decomposer, task_kind
from .common import rms_norm


@decomposer("linear")
def decompose(op, graph, tiling, rank):
    a = op.attrs
    out = graph.tensors[a["out"]]
    M_in, K = graph.tensors[a["x"]].shape
    N = out.shape[-1]
    M = out.shape[-2]
    tasks = []
    for n0, n1 in tiling.linear_tiles(graph, op, N):
        if a["push"]:
            writes = [Region(a["out"], r, ((rank, rank + 1), (0, M), (n0, n1))) for r in range(graph.tp)]
        else:
            writes = [Region(a["out"], rank, ((0, M), (n0, n1)))]
        tasks.append(tile_task(op.name, graph, rank, a, n0, n1, M, M_in, K, writes))
    return tasks


def tile_task(op_name: str, graph, rank: int, a: dict, n0: int, n1: int, M: int, M_in: int, K: int,
              writes: list) -> Task:
    """The linear task of output columns [n0, n1) of a linear's attributes `a` (also built by other decomposers:
    qkv_rope's flat q / k tiles)."""
    nw = len(a["weights"])
    reads = [Region(a["x"], rank, ((0, M_in), (0, K)))]
    if a["residual"]:
        reads.append(Region(a["residual"], rank, ((0, M), (n0, n1))))
    params = {k: a[k] for k in ("x", "weights", "norm", "eps", "epilogue", "residual", "out", "push", "row_select")}
    params["ll"] = bool(a.get("ll", False))
    params.update(n0=n0, n1=n1, weight_row0=a.get("weight_row0", 0), k_segments=a.get("k_segments", 1),
                  k_slices=1 if graph.tp_invariant > 1 else 0)
    return Task(-1, rank, "linear", op_name, params, reads=reads, writes=writes,
                est_bytes=nw * (n1 - n0) * K * 2 + M_in * K * 2 + M * (n1 - n0) * 2,
                est_flops=2 * nw * M * (n1 - n0) * K)


def ll_flag(step: int) -> int:
    """The LL flag of a step: its low 32 bits, as a signed int32 (the kernel's uint32)."""
    f = step & 0xFFFFFFFF
    return f - (1 << 32) if f >= 1 << 31 else f


def put_ll(words: torch.Tensor, y: torch.Tensor, step: int) -> None:
    """words (..., n) int64: each the pair (fp32 bits of y, flag of step) in memory order (little endian: value
    in the low half, as the kernel's 8-byte store {value, flag})."""
    pairs = words.view(torch.int32).view(*words.shape, 2)
    pairs[..., 0] = y.float().contiguous().view(torch.int32)
    pairs[..., 1] = ll_flag(step)


@task_kind("linear")
def execute(task, mem, ctx):
    p = task.params
    n0, n1 = p["n0"], p["n1"]
    r0 = p["weight_row0"]
    x = mem.t(p["x"])
    if p["row_select"]:
        x = x[p["row_select"]["offset"]::p["row_select"]["stride"]]
    if p["norm"]:
        x = rms_norm(x, mem.t(p["norm"]), p["eps"])
    kseg = p.get("k_segments", 1)
    if p["push"] or kseg > 1:   # fp32 partial sums, segment by segment, added in order
        assert p["epilogue"] == "none" and len(p["weights"]) == 1
        w = mem.t(p["weights"][0])[r0 + n0:r0 + n1]
        ks = x.shape[1] // kseg
        y = sum(x[:, s * ks:(s + 1) * ks].float() @ w[:, s * ks:(s + 1) * ks].float().T for s in range(kseg))
        if p["push"]:
            for peer in mem.peers:  # stores through peer pointers (nvshmem_ptr) on the GPU
                if p.get("ll"):     # (fp32 bits, step flag) in one 8-byte word per element
                    put_ll(peer.sym(p["out"], ctx.parity)[mem.rank, :, n0:n1], y, ctx.step)
                else:
                    peer.sym(p["out"], ctx.parity)[mem.rank, :, n0:n1] = y
            return
        y = y.to(x.dtype)   # the bf16 matmul result, as a single-segment tile rounds it
    else:
        ys = [x @ mem.t(w)[r0 + n0:r0 + n1].T for w in p["weights"]]
        y = F.silu(ys[0]) * ys[1] if p["epilogue"] == "silu_mul" else ys[0]
    if p["residual"]:
        y = mem.t(p["residual"])[:, n0:n1] + y
    out = mem.t(p["out"])
    out[:, n0:n1] = y.to(out.dtype)
