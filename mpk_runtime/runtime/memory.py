"""Device memory of one rank, as the task kernels see it: weights, the paged KV cache, and per-graph
workspaces (activations, io, and symmetric buffers that peers write into).

On the GPU the symmetric buffers live on the NVSHMEM heap; on the CPU (pyvm) the ranks are threads of one
process and `peers` are simply the other ranks' RankMemory objects: a push is a store into them.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import torch

from ..envflags import env_removed
from ..ir.graph import Graph
from ..models.reference import rope_inv_freq
from ..models.weights import torch_dtype

_DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int64": torch.int64,
       "int32": torch.int32}


DEFAULT_PAGE_SIZE = 16   # slots per KV page unless a runner is told otherwise (engine, runners)


def check_kv_layout_env() -> None:
    """MPK_KV_LAYOUT is gone: the KV pages are always (page, slot, head, D); set, it is an error."""
    env_removed("MPK_KV_LAYOUT", "the head-major KV layout measured no gain in sessions 19/20, -0.4..+1.2% at 8 "
                "points; the KV cache is always token-major: page, slot, head, D", allowed=("nhd",))


class KVStore:
    """Paged KV cache of one rank: per layer K and V pages, (num_pages + 1, page_size, n_kv_local, head_dim).

    Page `scratch` (= num_pages, past the allocator's range) absorbs the writes of padded batch rows, so the
    conventional path can write every row without a data-dependent (host-syncing) mask."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, n_kv: int, head_dim: int,
                 dtype: torch.dtype, device="cpu", poison: bool = True):
        check_kv_layout_env()
        self.num_pages, self.page_size = num_pages, page_size
        self.scratch = num_pages
        shape = (num_pages + 1, page_size, n_kv, head_dim)
        self.poisoned = bool(poison and dtype.is_floating_point)   # unwritten slots hold NaN (CPU twin's debug fill)
        fill = float("nan") if self.poisoned else 0
        nbytes = kv_page_bytes(num_layers, page_size, n_kv, head_dim, dtype) * (num_pages + 1)
        check_kv_fits(nbytes, num_pages, page_size, device)
        try:
            self.k = [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v = [torch.full(shape, fill, dtype=dtype, device=device) for _ in range(num_layers)]
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if "alloc" not in str(e).lower() and not isinstance(e, torch.OutOfMemoryError):
                raise
            self.k = self.v = []
            raise KVCacheTooLarge(_kv_too_large(nbytes, num_pages, page_size, device, "could not be allocated")) from e


class KVCacheTooLarge(ValueError):
    """The KV cache asked for (max_batch sequences of max_seq_len, or num_pages) does not fit the device: a caller's
    argument to change, so a ValueError (the engine reports ValueErrors as bad arguments)."""


def _kv_too_large(nbytes: int, num_pages: int, page_size: int, device, why: str) -> str:
    return (f"the KV cache of {num_pages} pages x {page_size} tokens ({nbytes / (1 << 30):.2f} GiB) {why} on "
            f"{torch.device(device)}: pass a smaller max_batch or max_seq_len (or num_pages)")


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_kv_fits(nbytes: int, num_pages: int, page_size: int, device) -> None:
    """Refuse up front a KV cache larger than the device's memory: on the host an allocation past physical memory
    may succeed lazily and then have the process killed while the pages are filled (max_batch=10**7 asked for
    1.3 TB and failed inside the allocator); on a GPU past its total memory. What fits beside the weights is
    fit_num_pages's business on a GPU (auto-sized caches); here only the impossible is refused."""
    dev = torch.device(device)
    if dev.type == "cpu":
        total = host_memory_bytes()
    elif dev.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(dev).total_memory
    else:
        total = None
    if total is not None and nbytes > total:
        raise KVCacheTooLarge(_kv_too_large(nbytes, num_pages, page_size, device,
                                            f"is more than the {total / (1 << 30):.2f} GiB of memory"))


KV_RESERVE_BYTES = 4 << 30   # device memory left beside an auto-sized KV cache: activations of the plan buckets and
#                              prefill graphs, CUDA graph pools, cuBLAS / Triton workspaces, the logits buffers
KV_RESERVE_SHARE = 0.08      # ... and this share of the device's total memory on top


def kv_page_bytes(num_layers: int, page_size: int, n_kv: int, head_dim: int, dtype: torch.dtype) -> int:
    """Device bytes of one KV page across the layers (K and V)."""
    return 2 * num_layers * page_size * n_kv * head_dim * torch.empty((), dtype=dtype).element_size()


def fit_num_pages(full: int, per_seq: int, page_bytes: int, free_bytes: int, total_bytes: int) -> int:
    """The KV pages a runner takes when num_pages is not given: `full` (max_batch sequences of max_seq_len, as before)
    where that fits the device's free memory less the reserve, else as many as fit (kv_allocation "lazy", the
    default, preempts a request when they run out), never fewer than one full sequence (per_seq pages): else an error
    saying what to change. One page more than the count is the scratch page."""
    budget = free_bytes - KV_RESERVE_BYTES - int(KV_RESERVE_SHARE * total_bytes)
    fit = budget // page_bytes - 1
    if fit >= full:
        return full
    if fit < per_seq:
        gib = 1 << 30
        raise ValueError(f"the KV cache for one sequence of max_seq_len ({per_seq} pages, {per_seq * page_bytes / gib:.2f} "
                         f"GiB) does not fit the {max(budget, 0) / gib:.2f} GiB this GPU has free beside the weights "
                         f"and a {(free_bytes - budget) / gib:.2f} GiB reserve: pass a smaller max_seq_len (or a "
                         f"smaller model / more GPUs with tp)")
    return int(fit)


class RankMemory:
    """What one rank's tasks address for one Graph: `t(name)` tensors, `kv(name)` pages, `sym(name, parity)`."""

    def __init__(self, graph: Graph, weights: dict[str, torch.Tensor], kv: KVStore, device="cpu",
                 share_activations: bool = False):
        """share_activations: activations and symmetric buffers whose live ranges (first to last op that names
        them) do not overlap share storage (`share_plan`). Only for executors that run the ops one after another
        (the conventional path); a megakernel overlaps ops, so its memory must not alias."""
        self.graph, self.rank, self.world = graph, graph.rank, graph.tp
        self.weights, self.kvstore = weights, kv
        self.tensors: dict[str, torch.Tensor] = {}
        self.syms: dict[str, torch.Tensor] = {}
        slot = share_plan(graph) if share_activations else {}
        bufs: dict[int, torch.Tensor] = {}

        def alloc(spec, shape):
            if spec.name not in slot:
                return torch.zeros(shape, dtype=_DT[spec.dtype], device=device)
            b = slot[spec.name]
            if b not in bufs:
                bufs[b] = torch.zeros(shape, dtype=_DT[spec.dtype], device=device)
            return bufs[b]
        for spec in graph.tensors.values():
            if spec.kind == "weight":
                if spec.name not in weights:
                    raise KeyError(f"weight {spec.name} missing for rank {self.rank}")
                have = tuple(weights[spec.name].shape)
                # the tied LM head reads rows of the (replicated) embedding table: shape may be larger
                if have != spec.shape and not spec.name.endswith("embed_tokens.weight"):
                    raise ValueError(f"weight {spec.name} has shape {have}, graph expects {spec.shape}")
                self.tensors[spec.name] = weights[spec.name]
            elif spec.kind in ("act", "io"):
                self.tensors[spec.name] = alloc(spec, spec.shape)
            elif spec.kind == "sym":
                self.syms[spec.name] = alloc(spec, (2, *spec.shape))
        self.peers: list[RankMemory] = [self]

    def t(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def kv(self, name: str) -> torch.Tensor:
        layer = self.graph.tensors[name].attrs["layer"]
        return self.kvstore.k[layer] if name.endswith("k_cache") else self.kvstore.v[layer]

    def sym(self, name: str, parity: int) -> torch.Tensor:
        return self.syms[name][parity]

    def poison(self) -> None:
        """NaN-fill activations and symmetric buffers: a task that reads before its producer wrote shows up."""
        for spec in self.graph.tensors.values():
            if spec.kind == "act" and spec.dtype not in ("int64", "int32"):
                self.tensors[spec.name].fill_(float("nan"))
        for s in self.syms.values():
            s.fill_(-1 if not s.dtype.is_floating_point else float("nan"))   # LL words: flag 0xffffffff, never a step


def share_plan(graph: Graph) -> dict[str, int]:
    """Storage slots for a graph whose ops run one after another: tensor name -> slot, for activations and
    symmetric buffers named by some op's inputs or outputs. A tensor is live from the first op that names it to the
    last; slots are reused by tensors of the same kind, shape and dtype once free, and an op's outputs take their
    slots before its inputs' slots are freed (so no op writes over what it reads). io tensors (what the runner
    fills and reads) and tensors no op names keep storage of their own. A prefill graph of qwen3-8b at 4096 rows:
    11.6 GiB of activations unshared (every layer its own), about three layers' worth shared."""
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for n in list(op.outputs) + list(op.inputs):
            first.setdefault(n, i)
            last[n] = i
    specs = [t for t in graph.tensors.values() if t.kind in ("act", "sym") and t.name in first]
    starts: dict[int, list] = {}
    ends: dict[int, list] = {}
    for t in specs:
        starts.setdefault(first[t.name], []).append(t)
        ends.setdefault(last[t.name], []).append(t)
    free: dict[tuple, list[int]] = {}
    slot: dict[str, int] = {}
    n_slots = 0
    for i in range(len(graph.ops)):
        for t in starts.get(i, []):
            key = (t.kind, t.shape, t.dtype)
            if free.get(key):
                slot[t.name] = free[key].pop()
            else:
                slot[t.name] = n_slots
                n_slots += 1
        for t in ends.get(i, []):
            free.setdefault((t.kind, t.shape, t.dtype), []).append(slot[t.name])
    return slot


def connect(mems: list[RankMemory]) -> None:
    """Make each rank's memory see its peers (the CPU stand-in for the symmetric heap)."""
    for m in mems:
        m.peers = mems


class Tickets:
    """Monotonic counters (never reset, like the event counters) that tasks take a number from: the folded
    attention merge's `last chunk of the group` test. Thread-safe (PyVM's threads mode)."""

    def __init__(self) -> None:
        self._n: dict = {}
        self._lock = threading.Lock()

    def take(self, key) -> int:
        with self._lock:
            v = self._n.get(key, 0)
            self._n[key] = v + 1
            return v


@dataclass
class StepCtx:
    """Per-step inputs every task may read: positions and page tables (host-written before a launch)."""

    config: object
    step: int                      # global step number (1, 2, ...), as in the counter protocol
    pos: torch.Tensor              # (B,) position of each sequence's first token this step; < 0 = inactive
    block_tables: torch.Tensor     # (B, max_pages) page ids
    page_size: int
    tokens_per_seq: int
    inv_freq: torch.Tensor
    kv_len_cap: int = 0            # conventional attention gathers this many keys (static shapes); 0 = as needed
    pad: torch.Tensor | None = None   # (B,) leading padding rows per sequence (batched prefill of unequal chunks,
    #                                   conventional path): rows t < pad[b] are inactive, row t is token t - pad[b]
    tickets: "Tickets | None" = None   # the executor's ticket counters (folded attention merge), set by PyVM
    greedy: bool = False           # the caller's promise that every row is greedy (temperature 0) this step: the
    #                                conventional argmax then skips the sampling candidates and draw (~250 small
    #                                kernels on a GPU), giving the same tokens; a static field (graphs key on it)
    rows: tuple | None = None      # (pad, start, n) of each sequence, host-known (an eager prefill step only): the
    #                                conventional attention then runs each sequence over exactly its start + n keys,
    #                                causal to the last key, with no mask (conventional_ops.attention_rows)
    packed: tuple | None = None    # (row_pos (M,), row_seq (M,), last_rows (B,)) device tensors: a packed prefill
    #                                step (conventional path): the chunks' rows back to back, each chunk starting its
    #                                sequence (no cached keys), padding rows after them (row_seq -1); sequence b's last
    #                                row is last_rows[b]; pos / pad keep each chunk's start and T - length (the
    #                                sampler's counter). conventional_ops reads the rows, slots and attention from it
    logits_unread: bool = False    # the caller's promise that nothing reads the step's fp32 logits afterwards (only
    #                                the drawn tokens): with greedy and MPK_CONV_BF16_ARGMAX=1 a conventional LM head
    #                                followed by its argmax in the same segment skips the fp32 logits write
    #                                (torch_exec); a static field (graphs key on it)

    def take_ticket(self, key) -> int:
        if self.tickets is None:
            raise RuntimeError("a folded attention merge needs ticket counters: run its tasks under PyVM (or the "
                               "megakernel), which own them")
        return self.tickets.take(key)

    @property
    def parity(self) -> int:
        return self.step % 2


def make_ctx(cfg, step: int, pos, block_tables, page_size: int, tokens_per_seq: int, inv_freq=None) -> StepCtx:
    return StepCtx(cfg, step, torch.as_tensor(pos, dtype=torch.long), torch.as_tensor(block_tables, dtype=torch.long),
                   page_size, tokens_per_seq, inv_freq if inv_freq is not None else rope_inv_freq(cfg))


__all__ = ["KVStore", "RankMemory", "StepCtx", "Tickets", "connect", "fit_num_pages", "kv_page_bytes", "make_ctx",
           "torch_dtype"]
