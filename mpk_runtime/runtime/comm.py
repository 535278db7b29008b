"""Host-side communicators for tensor-parallel ranks (conventional segments, prefill, logits gather).

The megakernel does its all-reduces inside the kernel (NVSHMEM); these are for the torch paths. `ThreadGroup`
connects ranks that run as threads of one process (pyvm, tests); `TorchDistComm` wraps torch.distributed
(gloo on CPU, NCCL on GPU) for ranks in separate processes (Ray actors, torchrun).
"""
from __future__ import annotations

import threading

import torch


class Communicator:
    rank: int = 0
    world_size: int = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks (returns a new tensor; every rank gets the same values in the same order)."""
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return t

    def barrier(self) -> None:
        pass


class SingleComm(Communicator):
    pass


class ThreadGroup:
    """Shared state of `world_size` thread ranks. `group.comm(r)` is rank r's communicator."""

    def __init__(self, world_size: int, timeout: float = 60.0):
        self.world_size = world_size
        self.timeout = timeout
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[torch.Tensor | None] = [None] * world_size
        self.shared: dict = {}  # anything ranks must share (the pyvm symmetric heap lives here)
        self._lock = threading.Lock()
        self._waiting: set[int] = set()   # ranks blocked in a barrier now (a hang's diagnosis names the others)

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)

    def wait(self, rank: int) -> None:
        with self._lock:
            self._waiting.add(rank)
        try:
            self._barrier.wait()
        finally:
            with self._lock:
                self._waiting.discard(rank)

    def waiting_ranks(self) -> set[int]:
        with self._lock:
            return set(self._waiting)

    def abort(self) -> None:
        """A rank failed: release every rank blocked on it now (they raise BrokenBarrierError) instead of after
        `timeout` seconds."""
        self._barrier.abort()

    def reset(self) -> None:
        """Make the group usable again after `abort` (call only when no rank is inside a collective)."""
        self._barrier.reset()
        self._slots = [None] * self.world_size


class ThreadComm(Communicator):
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank, self.world_size = group, rank, group.world_size

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        g = self.group
        g._slots[self.rank] = t
        g.wait(self.rank)
        # copy the contents now: a slot is often a view of the rank's own buffer (a symmetric slot), which that
        # rank may overwrite as soon as it passes the next barrier (its next task) - reading it after the barrier
        # raced (a flaky TP=2 prefill test)
        parts = [p.clone() for p in g._slots]  # type: ignore[union-attr]
        g.wait(self.rank)  # nobody overwrites a slot before all have copied it
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(t)
        out = parts[0].clone()
        for p in parts[1:]:  # fixed rank order: identical sums on every rank
            out += p
        return out

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(t), dim=dim)

    def barrier(self) -> None:
        self.group.wait(self.rank)


class TorchDistComm(Communicator):
    """torch.distributed must already be initialised (gloo on CPU, nccl on GPU)."""

    def __init__(self, group=None):
        import torch.distributed as dist
        self.dist, self.group = dist, group
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        out = t.clone()
        self.dist.all_reduce(out, group=self.group)
        return out

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self.dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)
