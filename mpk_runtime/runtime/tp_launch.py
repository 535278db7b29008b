"""Launch one process per GPU (torch.multiprocessing, spawn) for TP tests and benchmarks.

    results = tp_launch.run(fn, nranks=2, args=(...), timeout_s=300)

`fn(ctx, *args)` runs in rank r's process with `ctx.rank`, `ctx.nranks`, `ctx.device` set (torch.cuda device r),
`ctx.heap()` (the NVSHMEM SymmetricHeap: the unique id made by rank 0 travels as bytes through a queue and all
ranks init concurrently) and `ctx.dist()` (torch.distributed NCCL over a local TCP store, for comparisons).
Each rank's return value (picklable) comes back in rank order; an exception in a rank comes back as its
traceback text and `run` raises TPLaunchError naming the rank. A rank that does not finish within timeout_s is
killed (its process only), so a hang turns into an error.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from .nvshmem import SAFE_ENV


class TPLaunchError(RuntimeError):
    pass


@dataclass
class RankCtx:
    rank: int
    nranks: int
    device: int
    _uidq: Any
    _port: int
    _heap: Any = None

    def heap(self):
        """NVSHMEM PE of this rank (collective on first call: every rank must call it)."""
        if self._heap is None:
            from .nvshmem import SymmetricHeap, unique_id_bytes
            if self.rank == 0:
                uid = unique_id_bytes()
                for _ in range(self.nranks - 1):
                    self._uidq.put(uid)
            else:
                uid = self._uidq.get(timeout=60)
            self._heap = SymmetricHeap.init(uid, self.rank, self.nranks, self.device)
        return self._heap

    def dist(self):
        import datetime

        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{self._port}", rank=self.rank,
                                    world_size=self.nranks, timeout=datetime.timedelta(seconds=120),
                                    device_id=__import__("torch").device("cuda", self.device))
        return dist


def _entry(rank, nranks, fn, args, uidq, resq, port):
    os.environ.update(SAFE_ENV)
    ctx = None
    try:
        import torch
        torch.cuda.set_device(rank)
        ctx = RankCtx(rank, nranks, rank, uidq, port)
        out = fn(ctx, *args)
        resq.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        resq.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if ctx is not None and ctx._heap is not None:
                ctx._heap.finalize()
        except Exception:  # noqa: BLE001
            pass
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(fn: Callable, nranks: int = 2, args: tuple = (), timeout_s: float = 600.0,
        raise_on_error: bool = True) -> list:
    """Run fn(ctx, *args) on ranks 0..nranks-1, one spawned process per GPU; results in rank order."""
    import torch
    import torch.multiprocessing as mp
    os.environ.update(SAFE_ENV)
    if torch.cuda.device_count() < nranks:
        raise TPLaunchError(f"{nranks} ranks need {nranks} GPUs; this machine shows {torch.cuda.device_count()}")
    mpc = mp.get_context("spawn")
    uidq, resq = mpc.Queue(), mpc.Queue()
    port = _free_port()
    procs = [mpc.Process(target=_entry, args=(r, nranks, fn, args, uidq, resq, port), daemon=False)
             for r in range(nranks)]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.time() + timeout_s
    while len(results) < nranks and time.time() < deadline:
        try:
            r, ok, out = resq.get(timeout=1.0)
            results[r] = (ok, out)
        except Exception:  # noqa: BLE001 - queue.Empty
            if all(not p.is_alive() for p in procs) and resq.empty():
                break
    for p in procs:
        p.join(timeout=max(1.0, min(30.0, deadline - time.time())))
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()   # this rank's own process only
            p.join(5)
            results.setdefault(r, (False, f"rank {r} did not finish within {timeout_s:.0f}s (killed)"))
        results.setdefault(r, (False, f"rank {r} exited with code {p.exitcode} without a result"))
    errs = [f"rank {r}: {results[r][1]}" for r in range(nranks) if not results[r][0]]
    if errs and raise_on_error:
        raise TPLaunchError("\n".join(errs))
    return [results[r][1] for r in range(nranks)]
