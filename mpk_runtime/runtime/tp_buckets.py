"""Decode at world size > 1 under a plan book: one whole-step megakernel per batch bucket, over one KV cache.

At tp=1 the GPU runner runs any plan (megakernel_plans.PlannedDecoder: megakernel and conventional segments, CUDA
graphs). At tp > 1 it runs the plans of one megakernel for the whole step (families TP_FAMILIES), one kernel per
batch bucket of the book, each with its own task graph, activations, symmetric buffers and event counters on the
NVSHMEM heap, all over the same weights and the same KV cache. A step of n rows launches the kernel of the smallest
bucket >= n, so one live sequence streams one row's tiles, not max_batch rows' (at tp=1 the kernel built for 8 rows
took 1.476 ms a llama-3.2-1b step against 1.064 for the one built for 1 row, 1x H200). Before this, tp > 1 ran one
megakernel built for max_batch rows (plan=None, still there).

Every rank builds the same buckets in the same order (the heap's allocations are collective) and, since the engine
sends every rank the same rows, launches the same bucket in the same step.
"""
from __future__ import annotations

from ..ir.build import build_graph
from ..planner.book import bucket_key, pick_plan
from ..planner.plan import Plan

# the plan families a TP group's GPU runner can run: one megakernel for the whole step (its tiling variants);
# conventional segments at tp > 1 would need their all-reduces over NCCL between megakernels on the heap
TP_FAMILIES = ("mono", "mono-w2")


def plan_families(backend: str, world: int) -> tuple[str, ...] | None:
    """The families a book for this backend and world size may hold (None: every family)."""
    return TP_FAMILIES if backend == "megakernel" and world > 1 else None


def heap_bytes(cfg, world: int, batches, max_seq_len: int, max_batch: int) -> int:
    """Bytes a TP rank's runner places on the NVSHMEM heap: each kernel's symmetric buffers (parity-doubled partial
    sums, from the decode graph at that batch), its event counters, and the gathered logits of max_batch rows.
    At llama-3.1-70b tp=2 one kernel of 128 rows needs ~2.5 GiB, past NVSHMEM's 1 GiB default heap."""
    import math

    from ..ir.shard import shard_for
    total = 0
    for b in batches:
        g = build_graph(cfg, mode="decode", batch=int(b), context_len=0, max_seq_len=max_seq_len, tp=world, rank=0)
        for spec in g.tensors.values():
            if spec.kind == "sym":
                total += 2 * math.prod(spec.shape) * (4 if spec.dtype == "float32" else 2)
        total += 64 << 10   # event counters and the allocator's alignment, generously
    vmax = max(shard_for(cfg, world, q).n_vocab for q in range(world))
    return total + max_batch * vmax * 4


def tp_book_plans(book: dict, cfg, max_seq_len: int) -> dict[int, Plan]:
    """{bucket: Plan} of a book the TP runner can run, bucket ascending; ValueError saying what to do for any other
    (a plan of several segments, or one that does not cover the step's ops)."""
    out = {}
    for b in sorted(int(k) for k in book["buckets"]):
        plan = pick_plan(book, b)
        names = [o.name for o in build_graph(cfg, mode="decode", batch=b, context_len=0, max_seq_len=max_seq_len,
                                             tp=plan.tp, rank=0, attn_splits=plan.attn_splits).ops]
        segs = plan.segments
        if len(segs) != 1 or segs[0].kind != "megakernel" or list(segs[0].ops) != names:
            kinds = "+".join(s.kind for s in segs)
            raise ValueError(f"bucket {b}'s plan {plan.name!r} ({kinds}) is not one megakernel for the whole step: at "
                             f"tp > 1 the GPU runner runs families {TP_FAMILIES} only; make the book with "
                             f"planner.book.plan_book(cfg, tp, buckets, families={TP_FAMILIES!r}), pass plan='auto', "
                             "or plan=None (one megakernel for max_batch rows)")
        out[b] = plan
    return out


class TPBuckets:
    """The kernels of a TP rank, one per bucket (runtime.megakernel_runner.build_rank_kernel namespaces)."""

    def __init__(self, cfg, weights: dict, book: dict, *, rank: int, world: int, heap, kv, max_seq_len: int,
                 page_size: int, num_sms: int, dtype: str, timeout_s: float | None, device):
        from .megakernel_runner import build_rank_kernel
        from .plan_exec import _tiling
        self.book = book
        self.plans = tp_book_plans(book, cfg, max_seq_len)
        self.kernels = {}
        for b, plan in self.plans.items():   # ascending, on every rank: the heap's allocations pair up
            self.kernels[b] = build_rank_kernel(
                cfg, weights, rank=rank, world=world, heap=heap, batch=b, max_seq_len=max_seq_len,
                page_size=page_size, num_pages=kv.num_pages, num_sms=num_sms, attn_splits=plan.attn_splits,
                dtype=dtype, timeout_s=timeout_s, device=device, tiling=_tiling(plan.segments[0].tiling, num_sms),
                kv=kv)
        self.used: dict[int, str] = {}

    def kernel_for(self, n: int):
        """The namespace (mk, mem, pos, tables, width) of the bucket a step of n rows runs in."""
        b = bucket_key(self.book, n)
        if b < n:
            raise ValueError(f"a decode step of {n} rows is more than the largest bucket ({b})")
        self.used[b] = self.plans[b].name
        return self.kernels[b]

    def largest(self):
        return self.kernels[max(self.kernels)]
