"""A TP group's ranks on one device: the symmetric heap's interface (runtime/nvshmem.SymmetricHeap: `tensor`,
`peer_ptr(s)`, `barrier`, `finalize`) over plain tensors of one process, so that every rank's TP megakernel can be
built and run side by side on a single GPU, each on its own share of the SMs.

What it checks there is the TP megakernels' device protocol: the partial sums pushed into the other ranks' slots,
the remote signals (release at system scope) and the cross-rank waits, the packer's peer addresses, and the
shards' numerics against the one-rank kernel. What it cannot check is the transport between two GPUs (NVLink P2P
stores through nvshmem_ptr addresses) and any TP timing: the ranks share one GPU's SMs and HBM.

Allocation is collective as on the real heap: the i-th `tensor` call of every rank must ask for the same shape
and dtype. The group allocates all ranks' copies at the first rank's i-th call, so ranks may be built one after
the other in one thread (rank 0's peer addresses exist before rank 1 is built)."""
from __future__ import annotations

import torch


class LoopbackGroup:
    """`nranks` ranks whose symmetric tensors all live on `device`. `heap(r)` is rank r's SymmetricHeap stand-in."""

    def __init__(self, nranks: int, device: torch.device | str = "cuda"):
        if int(nranks) < 1:
            raise ValueError(f"nranks must be >= 1, got {nranks}")
        self.nranks = int(nranks)
        self.device = torch.device(device)
        self._slots: list[tuple[tuple[int, ...], torch.dtype, list[torch.Tensor]]] = []
        self._count = [0] * self.nranks
        self._heaps = [LoopbackHeap(self, r) for r in range(self.nranks)]

    def heap(self, rank: int) -> "LoopbackHeap":
        if not 0 <= rank < self.nranks:
            raise ValueError(f"rank {rank} is not in this group of {self.nranks}")
        return self._heaps[rank]

    def _alloc(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype, zero: bool) -> torch.Tensor:
        i = self._count[rank]
        if i == len(self._slots):
            alloc = torch.zeros if zero else torch.empty
            self._slots.append((shape, dtype, [alloc(shape, dtype=dtype, device=self.device)
                                               for _ in range(self.nranks)]))
        s_shape, s_dtype, ts = self._slots[i]
        if (s_shape, s_dtype) != (shape, dtype):
            raise ValueError(f"symmetric allocation {i}: rank {rank} asks for {tuple(shape)} {dtype}, another rank "
                             f"for {tuple(s_shape)} {s_dtype}; every rank must allocate the same shapes in the same "
                             "order (collective)")
        self._count[rank] = i + 1
        return ts[rank]

    def _peer(self, t: torch.Tensor, pe: int) -> torch.Tensor:
        for _, _, ts in self._slots:
            for q in ts:
                if q.data_ptr() == t.data_ptr() and q.shape == t.shape:
                    return ts[pe]
        raise ValueError("tensor is not on this group's symmetric heap (allocate it with heap.tensor)")


class LoopbackHeap:
    """One rank of a LoopbackGroup, with the SymmetricHeap methods the TP kernel builders call."""

    def __init__(self, group: LoopbackGroup, rank: int):
        self.group, self.rank, self.nranks = group, rank, group.nranks
        self.device_index = group.device.index or 0
        self.closed = False

    def tensor(self, shape, dtype: torch.dtype, zero: bool = True) -> torch.Tensor:
        return self.group._alloc(self.rank, tuple(int(s) for s in shape), dtype, zero)

    def peer_ptr(self, t: torch.Tensor, pe: int) -> int:
        if not 0 <= pe < self.nranks:
            raise ValueError(f"rank {pe} is not in this group of {self.nranks}")
        return self.group._peer(t, pe).data_ptr()

    def peer_ptrs(self, t: torch.Tensor) -> list[int]:
        return [self.peer_ptr(t, r) for r in range(self.nranks)]

    def peer_tensor(self, t: torch.Tensor, pe: int) -> torch.Tensor:
        """Rank pe's copy of t (nvshmem's get_peer_tensor)."""
        return self.group._peer(t, pe)

    def barrier(self) -> None:
        """The ranks share this process: a barrier is the device's work done."""
        if self.group.device.type == "cuda":
            torch.cuda.synchronize(self.group.device)

    def finalize(self) -> None:
        self.closed = True
