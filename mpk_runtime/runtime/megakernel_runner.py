"""ModelRunner backend "megakernel": one rank per process, decode through the GPU megakernel.

World size > 1 (tensor parallel): each process holds one rank's weight shard (`ir.shard.weight_slice`), the
symmetric buffers and event counters live on the NVSHMEM heap (runtime/nvshmem.py; the unique id arrives as
`nvshmem_uid` bytes, or through the communicator, or NVSHMEM was initialised already by the cluster layer), and
the partial sums travel inside the kernel (pushes + remote signals through nvshmem_ptr peer addresses).

Mirrors `_CPURunner` (pyvm_runner.py). Prefill: the prompt chunks of a step as a few left-padded prefill graphs
through the conventional executor on the GPU (conventional_prefill.ConventionalPrefill; at world size > 1 its
all-reduces run over the torch.distributed group the executor gave, e.g. NCCL under Ray). World size > 1 without
such a group (only an NVSHMEM heap): the prompt's tokens run as single-token decode steps through the megakernel
(one launch per token; correct, not fast). Batches are padded to the graph's batch with
inactive rows (pos = -1).

plan="auto" | a plan book (the default): at world size 1 decode runs the planner's plan for each batch bucket,
replayed as CUDA graphs (megakernel_plans.PlannedDecoder): one megakernel at small batches, conventional segments
where the planner predicts they win. At world size > 1 one whole-step megakernel per bucket (tp_buckets.TPBuckets:
the book's plans come from the one-megakernel families), launched per step. plan=None: one megakernel over
max_batch rows, launched per step.
torch.cuda / cuda-python are touched only when a runner is created.
"""
from __future__ import annotations

import logging
import time

import torch

from ..envflags import env_flag
from ..ir.build import build_graph
from ..ir.shard import shard_for, weight_slice
from ..models.config import load_config
from ..models.reference import rope_inv_freq
from ..models.weights import get_weights, torch_dtype
from ..planner.book import bucket_key
from ..tasks.build import build_task_graphs
from ..tasks.tiling import Tiling, attn_splits_for
from .base import KVSpec, ModelRunner, Pending, SeqChunk, check_decode_steps, check_sizes, register_runner
from .conventional_fused import prepare_weights
from .device_sampling import any_full, draw_full, host_logits_needed, step_output
from .decode_io import burst, device_pending, fill_step
from .conventional_prefill import ConventionalPrefill
from .megakernel_plans import PlannedDecoder
from .memory import DEFAULT_PAGE_SIZE, KVStore, RankMemory, fit_num_pages, kv_page_bytes

log = logging.getLogger(__name__)


def build_rank_kernel(cfg, weights: dict, *, rank: int, world: int, heap=None, batch: int, max_seq_len: int,
                      page_size: int, num_pages: int, num_sms: int, attn_splits: int = 2, dtype: str = "bfloat16",
                      timeout_s: float | None = None, trace_steps: int = 0, device="cuda", tiling: Tiling | None = None,
                      tp_invariant: int = 1, kv: KVStore | None = None):
    """One rank's Megakernel for decode at `batch` (world > 1 needs a SymmetricHeap; collective then: every
    rank calls this with the same arguments but its own rank). `kv`: a KVStore to share (kernels of several batch
    sizes over one cache); None: a new one of num_pages. Returns a namespace: mk, mem, tg, pos, tables, kv, width."""
    from types import SimpleNamespace

    from .megakernel import Megakernel
    dev = torch.device(device)
    if kv is None:
        n_kv = cfg.num_kv_heads if world == 1 else shard_for(cfg, world, rank).n_kv
        kv = KVStore(cfg.num_layers, num_pages, page_size, n_kv, cfg.head_dim, torch_dtype(dtype), device=dev)
    gs = [build_graph(cfg, mode="decode", batch=batch, context_len=0, max_seq_len=max_seq_len, tp=world, rank=r,
                      attn_splits=attn_splits, dtype=dtype, tp_invariant=tp_invariant) for r in range(world)]
    tgs = build_task_graphs(gs, tiling or Tiling(num_sms=num_sms))   # events of a rank come from every rank
    tg = tgs[rank]
    mem = RankMemory(gs[rank], weights, kv, device=dev)
    width = -(-max_seq_len // page_size)
    tables = torch.zeros((batch, width), dtype=torch.int64, device=dev)
    pos = torch.full((batch,), -1, dtype=torch.int64, device=dev)
    peers = counters = None
    if world > 1:
        if heap is None:
            raise ValueError("world size > 1 needs an NVSHMEM SymmetricHeap (runtime.nvshmem)")
        from .nvshmem import rank_setup
        peers, counters = rank_setup(heap, mem, max(len(t.events) for t in tgs) + 1)
        heap.barrier()   # every rank's counters are zero before any rank's kernel can signal them
    mk = Megakernel(tg, mem, page_size=page_size, block_tables=tables, pos=pos, inv_freq=rope_inv_freq(cfg),
                    head_dim=cfg.head_dim, timeout_s=timeout_s, trace_steps=trace_steps, peers=peers,
                    counters=counters)
    return SimpleNamespace(mk=mk, mem=mem, tg=tg, pos=pos, tables=tables, kv=kv, width=width)


@register_runner("megakernel")
class MegakernelRunner(ModelRunner):
    backend = "megakernel"
    samples_on_device = True
    shares_kv_pages = True

    @property
    def samples_full_on_device(self) -> bool:
        """Full-vocabulary rows (DeviceSampling.full) need the whole vocabulary's logits on this device: at world size
        1 the step's own; at world size > 1 every rank gathers the vocabulary shards through the heap (peer reads)
        and draws the same tokens from them (_gathered_logits); the prefill's and the conventional buckets' shards
        through the group's communicator (PlannedDecoder at tp > 1)."""
        return self.world_size == 1 or self._gather is not None or self.planned is not None

    def __init__(self, model: str = "tiny-llama", *, world_size: int | None = None, tp: int = 1, rank: int = 0,
                 seed: int = 0, dtype: str | None = "bfloat16", max_batch: int = 8, max_seq_len: int | None = None,
                 page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None, num_sms: int | None = None,
                 attn_splits: int | None = None, timeout_s: float | None = None, device: str = "cuda", comm=None,
                 nvshmem_uid: bytes | None = None, tp_invariant: int = 1, plan=None, plan_buckets=None,
                 plan_context: int = 512, prefill_warmup_tokens: int = 64, decode_warmup: bool | None = None,
                 **_: object):
        world = world_size or tp
        if dtype not in (None, "bfloat16", "bf16", torch.bfloat16):   # the device code reads bf16 weights only
            raise ValueError(f"backend 'megakernel' runs bf16 weights and activations; dtype={dtype!r} is not one it "
                             "can run: leave dtype out (or 'bfloat16'), or use backend 'torch' / 'pyvm' / 'reference' "
                             "for float32")
        require_gpu(device)
        from .comm import ThreadComm
        if world > 1 and isinstance(comm, ThreadComm):   # (rank 1's thread attached to rank 0's heap, or hung)
            raise ValueError(f"backend 'megakernel' at tp={world} runs one process per rank (NVSHMEM: one PE per "
                             "process, on a GPU of its own), not ranks as threads of one process (the 'inprocess' "
                             "executor): use executor='ray' (after `import cluster`), one SPMDExecutor per process "
                             "(torchrun, runtime/tp_launch.py), or tp=1")
        self.config = cfg = load_config(model)
        from .packer import megakernel_shape_problems
        bad = megakernel_shape_problems(cfg, world)
        if bad:
            raise ValueError(f"backend 'megakernel' cannot run this model's shape: {'; '.join(bad)}; use backend "
                             f"'torch' (or 'pyvm' / 'reference' on the CPU)")
        self.rank, self.world_size = rank, world
        self._comm = comm
        dtype = dtype or "bfloat16"
        max_seq_len = check_sizes(cfg, max_batch, max_seq_len or min(cfg.max_position_embeddings, 512), page_size,
                                  num_pages)   # None (LLM's and the CLIs' default): 512, as before
        if world > 1:
            torch.cuda.set_device(torch.device(device).index if torch.device(device).index is not None
                                  else _local_device(rank))
            dev = torch.device("cuda", torch.cuda.current_device())
        else:
            dev = torch.device(device)
        from .comm import TorchDistComm
        from .pyvm_runner import resolve_plan
        from .tp_buckets import heap_bytes, mk_only_book, plan_families, split_tp_book, tp_decoders
        book = resolve_plan(plan, cfg, world, max_batch, max_seq_len, plan_buckets, plan_context,
                            families=plan_families("megakernel", world))
        if book is not None and rank == 0:
            from ..planner.profile import card_mismatch
            msg = card_mismatch(str(book.get("profile", "")), torch.cuda.get_device_name(dev))
            if msg:
                log.warning(msg)
        if book is not None and tp_invariant != 1:
            raise ValueError("plan=... and tp_invariant > 1 do not go together: the bit-identical TP check runs one "
                             "megakernel for max_batch rows (plan=None)")
        group = isinstance(comm, TorchDistComm) and comm.world_size == world   # NCCL (or gloo) across the ranks
        mk_book = conv_book = None
        if book is not None and world > 1:   # per bucket one megakernel or the conventional plan (tp_buckets.py)
            if max(int(b) for b in book["buckets"]) < max_batch:
                raise ValueError(f"the plan book's largest bucket ({max(int(b) for b in book['buckets'])}) is below "
                                 f"max_batch={max_batch}: make the book with a bucket >= max_batch")
            if not group:
                book = mk_only_book(book, cfg, max_batch, max_seq_len, plan_context)
            mk_book, conv_book = split_tp_book(book, cfg, max_seq_len)
        self.tp_book = book if world > 1 else None
        if world > 1 and (book is None or mk_book is not None):   # the heap holds every kernel's symmetric buffers
            batches = sorted(mk_book["buckets"]) if mk_book is not None else [max_batch]
            self.heap = _heap(rank, world, comm, nvshmem_uid, dev,
                              heap_bytes(cfg, world, batches, max_seq_len, max_batch))
        else:
            self.heap = None
        slicer = None
        if world > 1:
            sh = shard_for(cfg, world, rank)
            slicer = lambda n, shape: weight_slice(cfg, sh, n, shape)  # noqa: E731
        # drawn (preset) or loaded (directory) on the GPU: an 8B model's random init on the host took minutes
        w = prepare_weights(get_weights(model, cfg, seed=seed, dtype=dtype, device=dev, slicer=slicer), cfg)
        per_seq = -(-max_seq_len // page_size)
        full = max_batch * per_seq + 1
        if num_pages is None and world == 1:   # as many of max_batch full sequences as this GPU has room for
            # (TP ranks keep the full count: their free memory may differ and their page counts must not)
            num_pages = fit_num_pages(full, per_seq, kv_page_bytes(cfg.num_layers, page_size, cfg.num_kv_heads,
                                                                   cfg.head_dim, torch_dtype(dtype)),
                                      *torch.cuda.mem_get_info(dev))
            if num_pages < full:
                log.warning("KV cache: %d pages (%d tokens) fit this GPU's free memory, not the %d of max_batch=%d "
                            "sequences of max_seq_len=%d; requests are preempted and recomputed when pages run out "
                            "(pass num_pages to choose)", num_pages, num_pages * page_size, full, max_batch,
                            max_seq_len)
        num_pages = num_pages or full
        self._spec = KVSpec(page_size, num_pages, max_batch, max_seq_len)
        num_sms = num_sms or torch.cuda.get_device_properties(dev).multi_processor_count
        self.planned = self.prefiller = self.tp_buckets = None
        # `step` calls' phases (graph_counts): "mixed" steps carry prompt chunks (and maybe decode rows), "single"
        # ones only decode rows (the engine's bursts go through launch_steps, not counted here)
        self.step_phases = {"mixed_steps": 0, "mixed_prompt_chunks": 0, "mixed_decode_rows": 0, "mixed_prefill_s": 0.0,
                            "mixed_decode_s": 0.0, "single_steps": 0, "single_decode_s": 0.0}
        self._gather = None
        if book is not None and world == 1:
            n_kv = cfg.num_kv_heads
            self.kv = KVStore(cfg.num_layers, num_pages, page_size, n_kv, cfg.head_dim, torch_dtype(dtype),
                              device=dev, poison=False)
            self.planned = PlannedDecoder(cfg, w, self.kv, book, max_seq_len=max_seq_len, page_size=page_size,
                                          num_sms=num_sms, dtype=dtype, device=dev, timeout_s=timeout_s,
                                          attn_splits=attn_splits or 2)   # plans carry their own
            self.prefiller = ConventionalPrefill(cfg, w, self.kv, max_seq_len=max_seq_len, page_size=page_size,
                                                 dtype=dtype, device=dev)
            self.prefiller.warm(max_batch, prefill_warmup_tokens)
            if decode_warmup is None:
                decode_warmup = env_flag("MPK_DECODE_WARMUP", True)
            if decode_warmup:   # every bucket's first capture (and its kernels' compilation) now, not in a request
                t0 = time.perf_counter()
                n = self.planned.warm(max_batch)
                log.info("decode graphs: %d captured at start-up in %.1f s", n, time.perf_counter() - t0)
            self.mk = None
            return
        if attn_splits is None:   # fill the SMs at a full batch: 2 at 8 rows x 8 KV heads, 16 for one sequence
            # (tp_invariant=R: the KV heads of a TP=R rank at every degree, so TP=1 and TP=R runs split alike and
            # stay bit-identical; a count from this degree's heads differed: 2 at TP=1, 4 at TP=2, B=8 ctx 512)
            heads_of = max(world, tp_invariant) if tp_invariant > 1 else world
            attn_splits = attn_splits_for(max_batch, shard_for(cfg, heads_of, 0).n_kv, max_seq_len, num_sms)
        if book is not None:   # world > 1: the two kinds of bucket over one cache (tp_buckets.py)
            self.planned, self.tp_buckets, r = tp_decoders(
                cfg, w, mk_book, conv_book, rank=rank, world=world, heap=self.heap, comm=comm, num_pages=num_pages,
                max_seq_len=max_seq_len, page_size=page_size, num_sms=num_sms, dtype=dtype, timeout_s=timeout_s,
                device=dev)
        else:
            r = build_rank_kernel(cfg, w, rank=rank, world=world, heap=self.heap, batch=max_batch,
                                  max_seq_len=max_seq_len, page_size=page_size, num_pages=num_pages, num_sms=num_sms,
                                  attn_splits=attn_splits, dtype=dtype, timeout_s=timeout_s, device=dev,
                                  tp_invariant=tp_invariant)
        self._k = r   # the kernel a step runs when no bucket is chosen (plan=None: the only one)
        self.mk, self.mem, self.tg, self.kv = r.mk, r.mem, r.tg, r.kv
        self.tables, self.pos, self.width = r.tables, r.pos, r.width
        if world == 1 or group:
            self.prefiller = ConventionalPrefill(cfg, w, self.kv, max_seq_len=max_seq_len, page_size=page_size,
                                                 dtype=dtype, device=dev, tp=world, rank=rank, comm=comm)
            self.prefiller.warm(max_batch, prefill_warmup_tokens)   # the same on every rank (NCCL in the graphs)
        if self.planned is not None:   # world > 1, conventional buckets: their graphs now, on every rank alike
            if decode_warmup is None:
                decode_warmup = env_flag("MPK_DECODE_WARMUP", True)
            if decode_warmup:
                t0 = time.perf_counter()
                n = self.planned.warm(max_batch)
                log.info("decode graphs: %d captured at start-up in %.1f s", n, time.perf_counter() - t0)
        if world > 1 and self.heap is not None:   # vocab-parallel logits gathered through the heap (peer reads)
            vmax = max(shard_for(cfg, world, q).n_vocab for q in range(world))
            buf = self.heap.tensor((max_batch, vmax), torch.float32)
            from nvshmem.core.interop import torch as nt
            self._gather = (buf, [nt.get_peer_tensor(buf, q) if q != rank else buf for q in range(world)],
                            [shard_for(cfg, world, q).n_vocab for q in range(world)])
            self._full_logits = torch.empty((max_batch, sum(self._gather[2])), dtype=torch.float32, device=dev)

    def kv_spec(self) -> KVSpec:
        return self._spec

    def _decode(self, toks: list[int], pos: list[int], tables: list[list[int]], sampling=None,
                want_logits: bool = True) -> torch.Tensor | None:
        """One launch of one step; returns the logits (n, V) (None when not wanted: no host copy). The tokens the
        kernel drew (greedy, or with `sampling`: one DeviceSampling or None per row) are in
        `self.last_next_tokens` afterwards."""
        n = len(toks)
        k = self.tp_buckets.kernel_for(n) if self.tp_buckets is not None else self._k
        mem = k.mem
        fill_step(mem, k.pos, k.tables, toks, pos, tables, k.width, sampling)
        if self.heap is not None:
            self.heap.barrier()   # no rank overwrites tokens/pos while a peer still reads the last step
        k.mk.launch(1)
        gathered = None
        if self.heap is None:
            draw_full(mem, mem.t("logits")[:n], k.pos[:n], graph=True)
        elif getattr(mem, "_full_rows", None) is not None:   # (every rank has the same rows: all gather)
            gathered = self._gathered_logits(n, mem)
            draw_full(mem, gathered, k.pos[:n], graph=True)   # the same tokens on every rank
        torch.cuda.synchronize(k.pos.device)
        k.mk.check()
        self.last_next_tokens = mem.t("next_tokens")[:n].cpu()
        if not want_logits:   # the same on every rank (same chunks): no rank enters the gather's barriers
            return None
        if self._gather is None:
            return mem.t("logits")[:n].float().cpu()
        return (gathered if gathered is not None else self._gathered_logits(n, mem)).cpu()

    def _gathered_logits(self, n: int, mem=None) -> torch.Tensor:
        """(n, V) fp32 on this device: the step's logits of every rank's vocabulary shard, in vocabulary order, read
        from the peers' heap buffers between two barriers (every rank calls it for the same steps). A view of one
        buffer that stays put (the draw's graph keys on its address), valid until the next call. `mem`: the
        memory of the kernel that ran the step (a bucket's; default the runner's one kernel)."""
        buf, views, nv = self._gather
        lg = (mem or self.mem).t("logits")
        buf[:lg.shape[0], :lg.shape[1]].copy_(lg)
        self.heap.barrier()
        out = self._full_logits[:n]
        torch.cat([views[q][:n, :nv[q]] for q in range(len(views))], dim=-1, out=out)
        self.heap.barrier()   # (synchronises first: out is complete) peers have read this rank's logits
        return out

    def _count_step_phases(self, n_prompt: int, n_decode: int, t0: float, t1: float, t2: float) -> None:
        """Add a `step` call's two phases (each ends in a synchronisation: host seconds are device-complete) to
        the totals graph_counts reports: the prompt chunks' prefill and the decode rows beside them."""
        st = self.step_phases
        if n_prompt:
            st["mixed_steps"] += 1
            st["mixed_prompt_chunks"] += n_prompt
            st["mixed_decode_rows"] += n_decode
            st["mixed_prefill_s"] += t1 - t0
            st["mixed_decode_s"] += t2 - t1
        else:
            st["single_steps"] += 1
            st["single_decode_s"] += t2 - t1

    def plans_used(self) -> dict:
        used = dict(self.planned.used) if self.planned is not None else {}
        if self.tp_buckets is not None:
            used.update(self.tp_buckets.used)
        return used

    def graph_counts(self) -> dict:
        """CUDA graphs captured so far and the seconds they took: prompt-chunk graphs (ConventionalPrefill) and the
        planned decode buckets' (a warm-up step and a capture each: ~0.1-0.3 s, up to 3.7 s where the plan's kernels
        compile on first use; session 56, 1x H100), the seconds spent building decode buckets, and where `step`
        calls' seconds went (step_phases)."""
        pf = self.prefiller
        dec = sum(b.captures for b in self.planned._buckets.values()) if self.planned is not None else 0
        pl = self.planned
        return {"prefill_captures": pf.captures if pf is not None else 0,
                "prefill_capture_s": round(pf.capture_s, 3) if pf is not None else 0.0,
                "prefill_replays": pf.replays if pf is not None else 0,
                "prefill_exact_runs": pf.exact_runs if pf is not None else 0, "decode_captures": dec,
                "decode_capture_s": round(pl.capture_s, 3) if pl is not None else 0.0,
                "decode_build_s": round(pl.build_s, 3) if pl is not None else 0.0,
                "prefill_graph_runs": pf.graph_runs if pf is not None else 0,
                "prefill_packed_runs": pf.packed_runs if pf is not None else 0,
                "prefill_late_captures": " ".join(pf.late_captures) if pf is not None else "",
                **{f"prefill_{k}": round(v, 4) for k, v in (pf.timing.items() if pf is not None else ())},
                **{k: round(v, 4) if isinstance(v, float) else v for k, v in self.step_phases.items()}}

    def _planned_rows(self, n: int) -> bool:
        """A step of n rows runs through PlannedDecoder: every step under a book at world size 1; at world size > 1
        those whose bucket's plan is conventional (the others launch their bucket's megakernel)."""
        if self.planned is None:
            return False
        return self.tp_buckets is None or bucket_key(self.tp_book, n) in self.planned.book["buckets"]

    def _decode_rows(self, toks, pos, tables, sampling, want_logits: bool = True):
        """(logits (n, V) or None, drawn tokens) of one decode step of n <= max_batch rows."""
        if self._planned_rows(len(toks)):
            return self.planned.decode(toks, pos, tables, sampling, want_logits)
        lg = self._decode(toks, pos, tables, sampling, want_logits)
        return lg, self.last_next_tokens

    def decode_steps(self, chunks: list[SeqChunk], num_steps: int, resume: bool = False) -> torch.Tensor:
        """num_steps steps with the drawn tokens fed back on the device (a plan's graphs replayed back to back, or
        the one megakernel launched once a step), one synchronisation at the end; at world size > 1 the base
        class's step-by-step loop (the heap barriers between steps). resume: the last call's rows, each fed the
        token drawn last for it, read on the device (ModelRunner.decode_steps)."""
        return self.launch_steps(chunks, num_steps, resume).wait()

    def launch_steps(self, chunks: list[SeqChunk], num_steps: int, resume: bool = False) -> Pending:
        """decode_steps queued, not waited for (ModelRunner.launch_steps): the tokens' and the status words' copies
        are queued behind the steps, and Pending.wait synchronises on them."""
        check_decode_steps(chunks, num_steps)
        fits = len(chunks) <= self._spec.max_batch
        planned = fits and self._planned_rows(len(chunks))
        # tp > 1, a one-megakernel bucket: the burst's launches back to back on the device (MPK_TP_BURSTS=1), or
        # step by step with a heap barrier and the tokens through the host (default until run on two GPUs)
        tp_burst = (fits and not planned and self.tp_buckets is not None and env_flag("MPK_TP_BURSTS")
                    and not any_full([c.sampling for c in chunks]))
        if not fits or (not planned and self.world_size > 1 and not tp_burst):
            return Pending(value=ModelRunner.decode_steps(self, chunks, num_steps, resume))
        rows = [c.seq_id for c in chunks]
        if resume and rows != getattr(self, "_burst_rows", None):
            raise ValueError("decode_steps(resume=True) continues the last call's rows, in its order")
        self._burst_rows = None
        args = ([c.token_ids[0] for c in chunks], [c.start_pos for c in chunks], [c.block_table for c in chunks],
                [c.sampling for c in chunks])
        if planned:
            out = self.planned.launch_steps(*args, num_steps, resume=resume)
        elif tp_burst:   # the kernels only push into the peers' parity buffers and signal their counters, and every
            # rank launches the same steps (docs/tp-nvshmem.md): one barrier a burst, none between its steps
            k = self.tp_buckets.kernel_for(len(chunks))
            n = len(chunks)
            last = k.mem.t("next_tokens")[:n].clone() if resume else None
            fill_step(k.mem, k.pos, k.tables, *args[:3], k.width, args[3], tokens_from=last)
            self.heap.barrier()
            out = device_pending(burst(k.mem, k.pos, n, num_steps, lambda: k.mk.launch(1)), [k.mk])
        else:
            n = len(chunks)
            last = self.mem.t("next_tokens")[:n].clone() if resume else None
            fill_step(self.mem, self.pos, self.tables, *args[:3], self.width, args[3], tokens_from=last)
            out = device_pending(burst(self.mem, self.pos, n, num_steps, lambda: self.mk.launch(1)), [self.mk])
        self._burst_rows = rows
        return out

    def step(self, chunks: list[SeqChunk]):
        self._burst_rows = None   # (a step between two bursts: the device's last tokens are not theirs any more)
        B = self._spec.max_batch
        out: list[torch.Tensor | None] = [None] * len(chunks)
        toks: list[int | None] = [None] * len(chunks)
        dec = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        host = host_logits_needed(chunks)   # else the engine reads only the drawn tokens: no logits copy
        pre = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        t0 = time.perf_counter()
        if pre and self.prefiller is not None:   # a few left-padded prefill graphs, conventional ops
            lg, drawn = self.prefiller.run_many([(chunks[i].token_ids, chunks[i].start_pos, chunks[i].block_table,
                                                  chunks[i].sampling) for i in pre], host)
            for j, i in enumerate(pre):
                out[i], toks[i] = (lg[j] if lg is not None else None), drawn[j]
            pre = []
        for i in pre:   # world size > 1: prefill as a run of single-token steps (the last one samples)
            c = chunks[i]
            n = len(c.token_ids)
            for j, tok in enumerate(c.token_ids):
                lg = self._decode([tok], [c.start_pos + j], [c.block_table], [c.sampling] if j == n - 1 else None)
            out[i] = lg[0]
            toks[i] = int(self.last_next_tokens[0])
        t1 = time.perf_counter()
        for s in range(0, len(dec), B):
            part = dec[s:s + B]
            lg, nxt = self._decode_rows([chunks[i].token_ids[0] for i in part], [chunks[i].start_pos for i in part],
                                        [chunks[i].block_table for i in part], [chunks[i].sampling for i in part],
                                        host)
            for j, i in enumerate(part):
                out[i] = lg[j] if lg is not None else None
                toks[i] = int(nxt[j])
        self._count_step_phases(len(chunks) - len(dec), len(dec), t0, t1, time.perf_counter())
        return step_output(chunks, torch.stack(out) if host else None, toks)  # type: ignore[arg-type]


class NoGPUError(ValueError):
    """The megakernel backend was asked for where no usable GPU is: the caller's to fix (another backend or
    machine), so a ValueError (LLM reports it as InvalidRequestError)."""


def require_gpu(device: str = "cuda") -> None:
    """Raise NoGPUError, saying what to do, unless `device` names a visible GPU that runs sm_90a code."""
    other = "use backend='pyvm' (the megakernel's CPU twin), 'torch' or 'reference' on this machine"
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "no GPU is visible (driver missing, or CUDA_VISIBLE_DEVICES empty)")
        raise NoGPUError(f"backend 'megakernel' needs an NVIDIA GPU, but {why}: {other}, or run on an H100 / H200")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:   # ('cuda:-1', 'gpu': torch's bare RuntimeError)
        raise NoGPUError(f"backend 'megakernel': device={device!r} is not a device ({e}); pass 'cuda' or 'cuda:N'") from None
    n = torch.cuda.device_count()
    if dev.type != "cuda" or (dev.index is not None and dev.index >= n):
        raise NoGPUError(f"backend 'megakernel' runs on a CUDA device; device={device!r} is not one of the {n} "
                         f"visible (cuda:0 .. cuda:{n - 1})")
    major, minor = torch.cuda.get_device_capability(dev.index if dev.index is not None else torch.cuda.current_device())
    if major != 9:
        raise NoGPUError(f"backend 'megakernel' is compiled for sm_90a (Hopper: H100 / H200); this GPU is "
                         f"sm_{major}{minor}: {other}")


def _local_device(rank: int) -> int:
    n = torch.cuda.device_count()
    return rank % n if n else 0


def _heap(rank: int, world: int, comm, uid: bytes | None, dev: torch.device, need: int = 0):
    """This rank's NVSHMEM PE: from uid bytes; else already initialised (cluster layer); else the uid goes from
    rank 0 to the others through the communicator (all_gather of 128 bytes). need: the bytes the runner will
    place on the heap (tp_buckets.heap_bytes); where NVSHMEM starts here, NVSHMEM_SYMMETRIC_SIZE is raised to hold
    them unless the caller set it (nvshmem.heap_size_env)."""
    from .nvshmem import NvshmemUnavailable, SymmetricHeap, heap_size_env, unique_id_bytes
    heap_size_env(need, rank)
    if uid is not None:
        return SymmetricHeap.init(uid, rank, world, dev.index)
    try:
        return SymmetricHeap.attach(dev.index)
    except NvshmemUnavailable:
        if comm is None or getattr(comm, "world_size", 1) != world:
            raise NvshmemUnavailable(
                f"rank {rank}/{world}: the megakernel backend needs the NVSHMEM unique id: pass nvshmem_uid=<bytes "
                "from runtime.nvshmem.unique_id_bytes() on rank 0>, or a communicator of the group, or initialise "
                "NVSHMEM first (cluster.ray_utils.nvshmem_uid_rendezvous)") from None
    raw = unique_id_bytes() if rank == 0 else bytes(128)
    t = torch.frombuffer(bytearray(raw.ljust(128, b"\0")), dtype=torch.uint8).clone()
    if getattr(comm, "dist", None) is not None and comm.dist.get_backend(comm.group) == "nccl":
        t = t.to(dev)
    uid = bytes(comm.all_gather(t, dim=0)[:128].cpu().tolist())
    return SymmetricHeap.init(uid, rank, world, dev.index)


def _shutdown(self) -> None:
    if getattr(self, "heap", None) is not None:
        self.heap.finalize()
        self.heap = None


MegakernelRunner.shutdown = _shutdown  # type: ignore[method-assign]
