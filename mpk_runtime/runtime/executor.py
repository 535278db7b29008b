"""Workers and executors: how the engine reaches the ranks that hold the model.

A `Worker` (runtime/worker.py) owns one rank's `ModelRunner`. An `Executor` owns `world_size` workers and calls a method on all of
them by name (`collective_rpc`), returning one result per rank in rank order. The engine is handed an executor
and uses nothing else, so in-process threads (here) and Ray actors (`cluster.RayExecutor`) are interchangeable
(the vLLM v1 split). This module must not import ray: `cluster` registers the "ray" executor when imported.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from typing import Any, Callable

from .comm import ThreadGroup
from .worker import Worker, WorkerError, WorkerTimeout


# --- executors ----------------------------------------------------------------------------------------------

def call_timing(submit_wall: float, t_submit: float, t_submitted: float, t_done: float, done_wall: float,
                ranks: list) -> dict | None:
    """One collective "execute" call's phases (seconds) from the caller's clocks and each rank's
    `Worker.last_timing` (entry wall time, runner seconds, exit wall time): dispatch (submitting to every
    rank), wait (until every result was back), and along the critical rank (the last to return) to_worker
    (submit -> its entry), worker (its runner.step) and from_worker (its exit -> every result back). The wall
    clock spans processes; to_worker/from_worker mean something when the caller and the ranks share a host."""
    if not ranks or any(r is None for r in ranks):
        return None
    w0, dt, w1 = max(ranks, key=lambda r: r[2])
    return {"dispatch_s": t_submitted - t_submit, "wait_s": t_done - t_submitted,
            "to_worker_s": max(0.0, w0 - submit_wall), "worker_s": dt, "from_worker_s": max(0.0, done_wall - w1)}


class Executor:
    """Calls workers by method name. Subclasses: `InProcessExecutor` here, `cluster.RayExecutor`."""

    world_size: int = 1
    # where the latest "execute" / "collect" call's time went (`call_timing`), for the engine's step accounting;
    # executors that do not measure leave it None
    last_timing: dict | None = None

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        raise NotImplementedError

    def init_workers(self, backend: str, **runner_kwargs: Any) -> list[dict]:
        """Build each rank's communicator and runner (`Worker.init_model`)."""
        raise NotImplementedError

    def recover(self) -> bool:
        """After a failed call: rebuild the workers if this executor can (True), else False (the engine then
        stays failed). In-flight sequences are lost either way; the engine fails them."""
        return False

    def shutdown(self) -> None:
        pass


class InProcessExecutor(Executor):
    """`world_size` workers as threads of this process, connected by a `ThreadGroup`.

    Each rank keeps one dedicated thread (a device context or thread-local state stays with its rank); a call
    runs on all ranks concurrently, and an exception on any rank is re-raised naming that rank.
    """
    def __init__(self, world_size: int = 1, comm_timeout: float = 60.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.group = ThreadGroup(world_size, timeout=comm_timeout) if world_size > 1 else None
        self.workers = [Worker(r, world_size) for r in range(world_size)]
        self._pools = [cf.ThreadPoolExecutor(1, thread_name_prefix=f"mpk-rank{r}") for r in range(world_size)]
        self._closed = False

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        if self._closed:
            raise WorkerError("executor is shut down; create a new LLM / executor")
        kwargs = kwargs or {}
        submit_wall, t_submit = time.time(), time.perf_counter()
        futs = [pool.submit(getattr(w, method), *args, **kwargs) for w, pool in zip(self.workers, self._pools)]
        t_submitted = time.perf_counter()
        # wait on every rank at once: a rank that raises is reported now, not after its peers' barrier timeout
        done, pending = cf.wait(futs, timeout=timeout, return_when=cf.FIRST_EXCEPTION)
        failed = [r for r, f in enumerate(futs) if f in done and f.exception() is not None]
        if failed:
            if pending and self.group is not None:
                self.group.abort()              # peers blocked on the failed rank: release them at once
                cf.wait(pending, timeout=5.0)   # (they end with BrokenBarrierError)
            errs = {r: f.exception() for r, f in enumerate(futs) if f.done() and f.exception() is not None}
            # the root cause: a rank whose error is not a peer's broken barrier
            rank = min((r for r, e in errs.items() if not isinstance(e, threading.BrokenBarrierError)),
                       default=min(errs))
            e = errs[rank]
            raise WorkerError(f"rank {rank} failed in {method!r}: {type(e).__name__}: {e}", rank, method) from e
        if pending:
            stuck = [r for r, f in enumerate(futs) if not f.done()]
            waiting = self.group.waiting_ranks() if self.group is not None else set()
            culprits = [r for r in stuck if r not in waiting] or stuck
            note = (f" (rank(s) {sorted(waiting & set(stuck))} are waiting for it at the group barrier)"
                    if waiting & set(stuck) else "")
            if self.group is not None:
                self.group.abort()
            raise WorkerTimeout(f"rank {culprits[0]} did not finish {method!r} within {timeout} s{note}",
                                culprits[0], method)
        results = [f.result() for f in futs]
        if method in ("execute", "collect"):
            self.last_timing = call_timing(submit_wall, t_submit, t_submitted, time.perf_counter(), time.time(),
                                           [w.last_timing for w in self.workers])
        return results

    def init_workers(self, backend: str, **runner_kwargs: Any) -> list[dict]:
        return self.collective_rpc("init_model", (backend, self.group), plan_once(backend, self.world_size,
                                                                                   runner_kwargs))

    def recover(self, timeout: float = 10.0) -> bool:
        """After a failed call: the workers keep their models; wait until every rank's thread is idle again and
        re-arm the group's barrier (a failed rank broke it). False when a rank is still busy (hung)."""
        if self._closed:
            return False
        if self.group is not None:
            self.group.abort()
        idle = [pool.submit(lambda: None) for pool in self._pools]
        _, pending = cf.wait(idle, timeout=timeout)
        if pending:
            return False
        if self.group is not None:
            self.group.reset()
        return True

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            self.collective_rpc("shutdown", timeout=10)
        except WorkerError:
            pass
        for p in self._pools:
            p.shutdown(wait=False)
        self._closed = True


class SPMDExecutor(Executor):
    """One rank per process, every process running the same engine in lockstep (torchrun / tp_launch style).

    The engine is deterministic given its inputs (same requests, same order, greedy or seeded sampling), so
    each process makes the same scheduling decisions and calls its own rank's runner with the same chunks; the
    runners synchronise among themselves (NVSHMEM heap barriers, torch.distributed). `collective_rpc` runs the
    local worker and returns its result in every rank's slot. Submit the same requests on every rank.
    comm_spec: what the runner needs to find its group (a torch.distributed dict, a Communicator, or None
    when NVSHMEM is initialised already in this process).
    """

    def __init__(self, rank: int, world_size: int, comm_spec: Any = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.rank, self.world_size, self.comm_spec = rank, world_size, comm_spec
        self.worker = Worker(rank, world_size, logits_on_every_rank=True)
        self._closed = False

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        if self._closed:
            raise WorkerError("executor is shut down; create a new LLM / executor")
        submit_wall, t_submit = time.time(), time.perf_counter()
        try:
            out = getattr(self.worker, method)(*args, **(kwargs or {}))
        except Exception as e:
            raise WorkerError(f"rank {self.rank} failed in {method!r}: {type(e).__name__}: {e}", self.rank, method) from e
        if method in ("execute", "collect"):
            self.last_timing = call_timing(submit_wall, t_submit, t_submit, time.perf_counter(), time.time(),
                                           [self.worker.last_timing])
        return [out] * self.world_size

    def init_workers(self, backend: str, **runner_kwargs: Any) -> list[dict]:
        if self.world_size > 1 and self.comm_spec is None:
            from .comm import SingleComm
            comm: Any = SingleComm()   # the runner finds its peers itself (an initialised NVSHMEM heap)
            comm.world_size = self.world_size
        else:
            comm = self.comm_spec
        return self.collective_rpc("init_model", (backend, comm), plan_once(backend, self.world_size, runner_kwargs))

    def shutdown(self) -> None:
        if not self._closed:
            try:
                self.worker.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
            self._closed = True


def default_plan(backend: str, world_size: int, runner_kwargs: dict):
    """The plan when the caller names none: "auto" for the megakernel backend (the planner's plan per batch bucket:
    at world size 1 the one megakernel built for that bucket's rows at small batches, conventional segments where
    it predicts they win, what every benchmark measures; at world size > 1 one whole-step megakernel per bucket,
    runtime/tp_buckets.py, since session 57, not yet run on two GPUs), else None. plan=None builds one megakernel for
    max_batch rows and every step streams that many rows' tiles, however few are live: at llama-3.2-1b the kernel
    built for 8 rows took 1.476 ms a step and the one built for 1 row 1.064, the one for 128 rows 12.9 ms against
    the planned 2.1 (1x H200, session 41's bench cells). Not where the caller asked for the one megakernel's knobs
    (attn_splits, tp_invariant): those keep plan=None."""
    if backend != "megakernel":
        return None
    if runner_kwargs.get("attn_splits") is not None or runner_kwargs.get("tp_invariant", 1) != 1:
        return None
    return "auto"


def plan_once(backend: str, world_size: int, runner_kwargs: dict) -> dict:
    """runner_kwargs with plan="auto" replaced by a plan book made here, once for every rank (the executor is the
    controller: ranks only look plans up). Plans run on the "pyvm" backend (CPU) and the "megakernel" backend
    (GPU; at world size > 1 the book holds one-megakernel plans only: tp_buckets.plan_families). No plan named:
    default_plan's."""
    plan = runner_kwargs["plan"] if "plan" in runner_kwargs else default_plan(backend, world_size, runner_kwargs)
    if plan is None:
        return runner_kwargs
    if backend not in ("pyvm", "megakernel"):
        raise ValueError(f"plan={plan!r}: plans run on the 'pyvm' (CPU) and 'megakernel' (GPU) backends; the "
                         f"{backend!r} backend is conventional already")
    if isinstance(plan, dict):
        return runner_kwargs
    from ..models.config import load_config
    from .pyvm_runner import resolve_plan
    from .tp_buckets import plan_families
    tp = runner_kwargs.get("tp") or world_size
    book = resolve_plan(plan, load_config(runner_kwargs.get("model", "tiny-llama")), tp,
                        runner_kwargs.get("max_batch", 8), runner_kwargs.get("max_seq_len"),
                        runner_kwargs.get("plan_buckets"), runner_kwargs.get("plan_context", 512),
                        families=plan_families(backend, tp))
    return dict(runner_kwargs, plan=book)


# --- registry -----------------------------------------------------------------------------------------------
ExecutorFactory = Callable[..., Executor]
_EXECUTORS: dict[str, ExecutorFactory] = {}


def register_executor(name: str):
    def deco(fn: ExecutorFactory) -> ExecutorFactory:
        _EXECUTORS[name] = fn
        return fn
    return deco


def make_executor(name: str, world_size: int, /, **kwargs: Any) -> Executor:
    """By name: "inprocess" (always), "ray" (registered by `import cluster`; needs ray installed). kwargs go to
    the executor (a RayExecutor's own `name` among them: hence the positional-only name here)."""
    if name not in _EXECUTORS:
        hint = (" The 'ray' executor lives in the cluster package: `import cluster` first (pip install ray), "
                "or pass executor=cluster.RayExecutor(...)." if name == "ray" else "")
        raise ValueError(f"unknown executor {name!r}; known executors: {', '.join(sorted(_EXECUTORS))}.{hint}")
    return _EXECUTORS[name](world_size=world_size, **kwargs)


@register_executor("inprocess")
def _make_inprocess(world_size: int, **kwargs: Any) -> InProcessExecutor:
    return InProcessExecutor(world_size, **kwargs)
