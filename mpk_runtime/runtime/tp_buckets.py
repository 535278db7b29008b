"""Decode at world size > 1 under a plan book: per batch bucket one whole-step megakernel, or the conventional plan.

At tp=1 the GPU runner runs any plan (megakernel_plans.PlannedDecoder: megakernel and conventional segments, CUDA
graphs). At tp > 1 it runs two kinds of plan (families TP_FAMILIES), the two ends of the planner's range:
- one megakernel for the whole step (mono / mono-w2): one kernel per such bucket on every rank (TPBuckets), each with
  its own task graph, activations, symmetric buffers and event counters on the NVSHMEM heap, over the same weights
  and KV cache, launched per step after a heap barrier (MPK_TP_BURSTS=1: an engine burst's steps back to back, one
  barrier a burst; docs/tp-nvshmem.md). A step of n rows runs the kernel of the smallest bucket >= n,
  so one live sequence streams one row's tiles, not max_batch rows' (plan=None; at tp=1 the kernel built for 8 rows
  took 1.476 ms a llama-3.2-1b step against 1.064 for the one built for 1 row, 1x H200);
- the conventional plan (torch ops, the all-reduces and the vocab-parallel argmax over the group's torch.distributed
  communicator, NCCL on GPUs), replayed as CUDA graphs per bucket by PlannedDecoder(tp=..., comm=...): what the
  planner picks from B=8 at tp=2 (llama-3.2-1b, h200_v56: 1748 us predicted at B=128 against 8184 for the one
  megakernel; qwen3-8b 5702 against 42903).
Plans that mix megakernel and conventional segments are not run by the engine at tp > 1. scripts/validate_planner.py
measures them there (PlanExecutor: each megakernel segment with its own counters on the heap, launched eagerly between
the conventional segments' graphs, a heap barrier a step: a step cannot be one CUDA graph, since a replay zeroes its
megakernels' counters, which at tp > 1 every rank's replay would have to agree on); at tp=2 none of them is the
planner's pick at llama-3.2-1b's or qwen3-8b's buckets (h200_v56), so the engine's book leaves them out.

Every rank builds the same buckets in the same order (the heap's allocations and the graphs' NCCL captures are
collective) and, since the engine sends every rank the same rows, runs the same bucket in the same step.
"""
from __future__ import annotations

import logging

from ..ir.build import build_graph
from ..planner.book import bucket_key, pick_plan
from ..planner.plan import Plan

log = logging.getLogger(__name__)

# the plan families a TP group's GPU runner can run (module docstring)
TP_FAMILIES = ("mono", "mono-w2", "conventional")
MK_FAMILIES = ("mono", "mono-w2")   # ... without a communicator for the conventional ops' collectives


def plan_families(backend: str, world: int) -> tuple[str, ...] | None:
    """The families a book for this backend and world size may hold (None: every family)."""
    return TP_FAMILIES if backend == "megakernel" and world > 1 else None


def heap_bytes(cfg, world: int, batches, max_seq_len: int, max_batch: int) -> int:
    """Bytes a TP rank's runner places on the NVSHMEM heap: each kernel's symmetric buffers (parity-doubled partial
    sums, from the decode graph at that batch), its event counters, and the gathered logits of max_batch rows.
    At llama-3.1-70b tp=2 one kernel of 128 rows needs ~2.5 GiB, past NVSHMEM's 1 GiB default heap."""
    from ..ir.shard import shard_for
    total = 0
    for b in batches:
        g = build_graph(cfg, mode="decode", batch=int(b), context_len=0, max_seq_len=max_seq_len, tp=world, rank=0)
        total += sum(2 * spec.nbytes for spec in g.tensors.values() if spec.kind == "sym")   # (2 parities)
        total += 64 << 10   # event counters and the allocator's alignment, generously
    vmax = max(shard_for(cfg, world, q).n_vocab for q in range(world))
    return total + max_batch * vmax * 4


def split_tp_book(book: dict, cfg, max_seq_len: int) -> tuple[dict | None, dict | None]:
    """(the book's one-megakernel buckets, its conventional buckets) as two books (None where it has none), bucket
    keys ascending; ValueError saying what to do for any other plan (segments of both kinds, or ops not covered).
    A step of n rows is run by the part that holds bucket_key(book, n): that part's own smallest bucket >= n is
    the same bucket."""
    parts: dict[str, dict] = {"megakernel": {}, "conventional": {}}
    for b in sorted(int(k) for k in book["buckets"]):
        plan = pick_plan(book, b)
        names = [o.name for o in build_graph(cfg, mode="decode", batch=b, context_len=0, max_seq_len=max_seq_len,
                                             tp=plan.tp, rank=0, attn_splits=plan.attn_splits).ops]
        segs = plan.segments
        kinds = {s.kind for s in segs}
        covered = [n for s in segs for n in s.ops] == names
        if covered and kinds == {"conventional"}:
            parts["conventional"][b] = book["buckets"].get(b, book["buckets"].get(str(b)))
        elif covered and len(segs) == 1 and kinds == {"megakernel"}:
            parts["megakernel"][b] = book["buckets"].get(b, book["buckets"].get(str(b)))
        else:
            raise ValueError(f"bucket {b}'s plan {plan.name!r} ({'+'.join(s.kind for s in segs)}) is neither one "
                             f"megakernel for the whole step nor all conventional: at tp > 1 the GPU runner runs "
                             f"families {TP_FAMILIES} only; make the book with planner.book.plan_book(cfg, tp, "
                             f"buckets, families={TP_FAMILIES!r}), pass plan='auto', or plan=None (one megakernel "
                             "for max_batch rows)")
    return tuple(dict(book, buckets=v) if v else None for v in (parts["megakernel"], parts["conventional"]))


def tp_book_plans(book: dict, cfg, max_seq_len: int) -> dict[int, Plan]:
    """{bucket: Plan} of a book of one-megakernel plans only (what TPBuckets builds), bucket ascending."""
    mk, conv = split_tp_book(book, cfg, max_seq_len)
    if conv is not None:
        raise ValueError(f"buckets {sorted(conv['buckets'])} have conventional plans: TPBuckets builds one-megakernel "
                         "buckets; give the conventional ones to PlannedDecoder (split_tp_book)")
    return {b: pick_plan(mk, b) for b in sorted(mk["buckets"])}


def mk_only_book(book: dict, cfg, max_batch: int, max_seq_len: int, context: int) -> dict:
    """The book with every conventional bucket re-planned among the one-megakernel families (a TP group without a
    torch.distributed communicator cannot run conventional ops). The same on every rank: the planner is
    deterministic for one profile and its books are cached by content."""
    from ..planner.book import plan_book
    _, conv = split_tp_book(book, cfg, max_seq_len)
    if conv is None:
        return book
    log.warning("tp=%d without a torch.distributed communicator: buckets %s run one megakernel instead of the "
                "conventional plan the planner chose (the Ray executor and SPMDExecutor(comm_spec=TorchDistComm()) "
                "give the group one)", book.get("tp"), sorted(conv["buckets"]))
    mk = plan_book(cfg, book["tp"], sorted(conv["buckets"]), context=book.get("context", context),
                   families=MK_FAMILIES)
    out = dict(book, buckets=dict(book["buckets"]))
    for b in conv["buckets"]:
        out["buckets"][b] = mk["buckets"][b]
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


def tp_decoders(cfg, weights: dict, mk_book: dict | None, conv_book: dict | None, *, rank: int, world: int, heap,
                comm, num_pages: int, max_seq_len: int, page_size: int, num_sms: int, dtype: str,
                timeout_s: float | None, device):
    """A TP rank's decode under a split book (split_tp_book) over one new KV cache of this rank's KV heads: (the
    PlannedDecoder of the conventional buckets or None, the TPBuckets of the one-megakernel buckets or None, the
    largest bucket's kernel namespace: mk / mem / tg / pos / tables / width None where there is no megakernel)."""
    from types import SimpleNamespace

    from ..ir.shard import shard_for
    from ..models.weights import torch_dtype
    from .megakernel_plans import PlannedDecoder
    from .memory import KVStore
    kv = KVStore(cfg.num_layers, num_pages, page_size, shard_for(cfg, world, rank).n_kv, cfg.head_dim,
                 torch_dtype(dtype), device=device, poison=False)
    planned = buckets = None
    if conv_book is not None:
        planned = PlannedDecoder(cfg, weights, kv, conv_book, max_seq_len=max_seq_len, page_size=page_size,
                                 num_sms=num_sms, dtype=dtype, device=device, timeout_s=timeout_s, tp=world,
                                 rank=rank, comm=comm)
    if mk_book is None:
        return planned, None, SimpleNamespace(mk=None, mem=None, tg=None, kv=kv, tables=None, pos=None, width=None)
    buckets = TPBuckets(cfg, weights, mk_book, rank=rank, world=world, heap=heap, kv=kv, max_seq_len=max_seq_len,
                        page_size=page_size, num_sms=num_sms, dtype=dtype, timeout_s=timeout_s, device=device)
    return planned, buckets, buckets.largest()
