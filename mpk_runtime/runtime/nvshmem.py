"""NVSHMEM for the TP megakernels: UID bootstrap, the symmetric heap (communication buffers and event
counters), peer pointers, finalize. Imported lazily: `import mpk_runtime` works without CUDA or NVSHMEM.

Fast path: the kernel stores partial sums and bumps event counters of other ranks through `nvshmem_ptr` peer
addresses (NVLink P2P): no -rdc, no device library. Where `nvshmem_ptr` returns NULL (no P2P between the GPUs)
this raises `NvshmemUnavailable` naming the missing transport (the put/signal fallback is not built).

Bootstrap from any launcher (torch.multiprocessing, Ray, torchrun):
    rank 0:  uid = unique_id_bytes()          # 128 bytes; send them to every rank by any RPC
    every rank, concurrently:  heap = SymmetricHeap.init(uid, rank, nranks, device_index)

NVLink multicast stays off: NVSHMEM_DISABLE_NVLS=1, NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are
set here before nvshmem is imported (setdefault would let a caller turn it on: we force them).
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

SAFE_ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


DEFAULT_HEAP = 1 << 30   # NVSHMEM_SYMMETRIC_SIZE's default (1 GiB)


def heap_size_env(need: int, rank: int = 0) -> str | None:
    """Before NVSHMEM starts in this process: NVSHMEM_SYMMETRIC_SIZE raised to hold `need` bytes with a margin (a
    quarter more, rounded up to 256 MiB) where they exceed the 1 GiB default and the variable is unset; a set value
    is kept (a warning where it looks too small). Returns the value in force, or None (the default)."""
    import logging
    have = os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "").strip()
    if have:
        if need > _size_bytes(have):
            logging.getLogger(__name__).warning(
                "rank %d: NVSHMEM_SYMMETRIC_SIZE=%s but the megakernels place ~%d MiB on the heap; raise it (or "
                "unset it: the runner then sizes the heap)", rank, have, need >> 20)
        return have
    step = 256 << 20
    want = -(-int(need * 1.25) // step) * step
    if want <= DEFAULT_HEAP:
        return None
    os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(want)
    return str(want)


def _size_bytes(v: str) -> int:
    """NVSHMEM's size syntax (a number with an optional k / m / g / t suffix) in bytes; unreadable: 0."""
    mult = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    v = v.strip().lower()
    try:
        if v and v[-1] in mult:
            return int(float(v[:-1] or 0) * mult[v[-1]])
        return int(float(v))
    except ValueError:
        return 0


class NvshmemUnavailable(RuntimeError):
    """NVSHMEM cannot be used here; the message says what is missing and what to do."""


def safe_env() -> None:
    """Force NVLink multicast off in this process (and in children that inherit the environment)."""
    os.environ.update(SAFE_ENV)


def _import():
    """(nvshmem.core, nvshmem.bindings, nvshmem.core.interop.torch, cuda.core) or NvshmemUnavailable."""
    safe_env()
    try:
        import nvshmem.core as nc
        from nvshmem import bindings as nb
        from nvshmem.core.interop import torch as nt
    except ImportError as e:
        raise NvshmemUnavailable(
            f"nvshmem4py is not importable ({e}). Install it with `pip install nvshmem4py-cu13==0.4.1 "
            "nvidia-nvshmem-cu13==3.4.5` (on the GPU machines: `source .gpubundle/install.sh`), or run TP=1 / the "
            "pyvm or torch backends.") from e
    try:
        import cuda.core as cc
    except ImportError as e:
        raise NvshmemUnavailable(f"cuda.core (cuda-python >= 13) is not importable ({e}): pip install cuda-python") from e
    return nc, nb, nt, cc


def available() -> tuple[bool, str]:
    """(True, '') when nvshmem4py and a CUDA device are present; else (False, why)."""
    try:
        _import()
    except NvshmemUnavailable as e:
        return False, str(e)
    if not torch.cuda.is_available():
        return False, "no CUDA device: NVSHMEM needs one GPU per rank"
    return True, ""


def unique_id_bytes() -> bytes:
    """Rank 0: a fresh NVSHMEM unique id as 128 bytes (send them to every rank)."""
    nc, _, _, _ = _import()
    u = nc.get_unique_id()
    return ctypes.string_at(u.ptr, u._data.itemsize)


def check_p2p(device_index: int, nranks: int) -> None:
    """Every rank of a single-node group must reach the others by CUDA P2P (NVLink or PCIe) for the
    nvshmem_ptr fast path; raise early with a clear message if this process sees a GPU it cannot reach."""
    n = torch.cuda.device_count()
    for j in range(n):
        if j != device_index and nranks > 1 and not torch.cuda.can_device_access_peer(device_index, j):
            raise NvshmemUnavailable(
                f"GPU {device_index} cannot access GPU {j} by CUDA P2P: the in-kernel all-reduce stores through "
                "nvshmem_ptr peer pointers and needs NVLink/P2P between the GPUs of one TP group (check "
                "`nvidia-smi topo -m`); run TP=1 per GPU instead")


class SymmetricHeap:
    """This process's NVSHMEM PE: symmetric tensors and their peer addresses.

    Every allocation is collective: all ranks must call `tensor` with the same shapes in the same order."""

    _active: "SymmetricHeap | None" = None

    def __init__(self, rank: int, nranks: int, device_index: int, modules: tuple):
        self.rank, self.nranks, self.device_index = rank, nranks, device_index
        self._nc, self._nb, self._nt, self._cc = modules
        self._dev = self._cc.Device(device_index)
        self._stream = self._dev.create_stream()
        self._tensors: list[torch.Tensor] = []
        self.closed = False

    @classmethod
    def init(cls, uid: bytes, rank: int, nranks: int, device_index: int | None = None) -> "SymmetricHeap":
        """Collective: every rank calls this concurrently with the same uid bytes."""
        if cls._active is not None and not cls._active.closed:
            h = cls._active
            if (h.rank, h.nranks) != (rank, nranks):
                raise NvshmemUnavailable(f"NVSHMEM already initialised here as rank {h.rank}/{h.nranks}")
            return h
        mods = _import()
        nc, _, _, cc = mods
        if not torch.cuda.is_available():
            raise NvshmemUnavailable("no CUDA device in this process: NVSHMEM needs one GPU per rank")
        if not isinstance(uid, (bytes, bytearray)) or len(uid) == 0:
            raise NvshmemUnavailable(f"invalid NVSHMEM unique id ({type(uid).__name__}); rank 0 makes it with "
                                     "runtime.nvshmem.unique_id_bytes()")
        di = torch.cuda.current_device() if device_index is None else device_index
        torch.cuda.set_device(di)
        check_p2p(di, nranks)
        dev = cc.Device(di)
        dev.set_current()
        u = nc.get_unique_id(empty=True)
        if len(uid) > u._data.itemsize:
            raise NvshmemUnavailable(f"unique id of {len(uid)} bytes; this nvshmem4py expects {u._data.itemsize}")
        ctypes.memmove(u.ptr, bytes(uid), len(uid))
        try:
            nc.init(device=dev, uid=u, rank=rank, nranks=nranks, initializer_method="uid")
        except Exception as e:  # noqa: BLE001
            raise NvshmemUnavailable(
                f"nvshmem init failed on rank {rank}/{nranks} (GPU {di}): {type(e).__name__}: {e}. Every rank must "
                "call SymmetricHeap.init at the same time with rank 0's unique id bytes; check that the ranks see "
                "different GPUs and that NVSHMEM_* variables agree") from e
        h = cls(rank, nranks, di, mods)
        cls._active = h
        return h

    @classmethod
    def attach(cls, device_index: int | None = None) -> "SymmetricHeap":
        """Use an NVSHMEM PE that another component already initialised in this process (e.g.
        cluster.ray_utils.nvshmem_init_from_bytes through the Ray rendezvous)."""
        if cls._active is not None and not cls._active.closed:
            return cls._active
        mods = _import()
        nc = mods[0]
        if int(nc.init_status()) < 2:
            raise NvshmemUnavailable("NVSHMEM is not initialised in this process: pass the unique id bytes "
                                     "(rank 0: runtime.nvshmem.unique_id_bytes()) to SymmetricHeap.init")
        di = torch.cuda.current_device() if device_index is None else device_index
        h = cls(int(nc.my_pe()), int(nc.n_pes()), di, mods)
        cls._active = h
        return h

    # --- allocation ---------------------------------------------------------------------------------------------
    def tensor(self, shape, dtype: torch.dtype, zero: bool = True) -> torch.Tensor:
        """Collective symmetric allocation (same shape/dtype on every rank)."""
        t = self._nt.tensor(tuple(int(s) for s in shape), dtype=dtype)
        if zero:
            t.zero_()
        self._tensors.append(t)
        return t

    def peer_ptr(self, t: torch.Tensor, pe: int) -> int:
        """Address at which this GPU loads/stores rank `pe`'s copy of symmetric tensor t (nvshmem_ptr)."""
        if pe == self.rank:
            return t.data_ptr()
        p = int(self._nb.ptr(t.data_ptr(), pe))
        if p == 0:
            raise NvshmemUnavailable(
                f"nvshmem_ptr(rank {self.rank} -> rank {pe}) is NULL: no NVLink/P2P path between the two GPUs. The "
                "megakernel's cross-rank stores need P2P; the put/signal (IB / proxy) transport is not implemented")
        return p

    def peer_ptrs(self, t: torch.Tensor) -> list[int]:
        return [self.peer_ptr(t, r) for r in range(self.nranks)]

    def barrier(self) -> None:
        """Host barrier of all ranks (after the device work queued on torch's current stream)."""
        torch.cuda.synchronize(self.device_index)
        self._nc.barrier_all(stream=self._stream)
        self._stream.sync()

    def finalize(self) -> None:
        if self.closed:
            return
        torch.cuda.synchronize(self.device_index)
        for t in reversed(self._tensors):
            try:
                self._nt.free_tensor(t)
            except Exception:  # noqa: BLE001 - freeing is best effort at shutdown
                pass
        self._tensors.clear()
        self._nc.finalize()
        self.closed = True
        if SymmetricHeap._active is self:
            SymmetricHeap._active = None


def place_symmetric(mem, heap: SymmetricHeap) -> dict[str, list[int]]:
    """Move a RankMemory's symmetric buffers (the (2, W, ...) parity-doubled tensors) onto the NVSHMEM heap
    (collective: same names in sorted order on every rank). Returns name -> [peer address of rank r]."""
    out = {}
    for name in sorted(mem.syms):
        old = mem.syms[name]
        t = heap.tensor(old.shape, old.dtype)
        mem.syms[name] = t
        out[name] = heap.peer_ptrs(t)
    return out


def rank_setup(heap: SymmetricHeap, mem, num_counters: int) -> tuple[Any, torch.Tensor]:
    """Symmetric buffers + event counters of one rank on the heap -> (megakernel.PeerTable, counters).
    `num_counters` must be the same on every rank (the max over ranks of len(events) + 1)."""
    from .packer import PeerTable
    syms = place_symmetric(mem, heap)
    counters = heap.tensor((num_counters,), torch.int64)
    table = PeerTable(heap.rank, heap.nranks, heap.peer_ptrs(counters), syms)
    return table, counters
