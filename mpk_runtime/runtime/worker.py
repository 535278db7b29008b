"""A `Worker`: one rank's `ModelRunner` behind methods an `Executor` calls by name (runtime/executor.py): a step,
a burst of decode steps (synchronous, or launched now and collected later: pipelined bursts), freeing sequences,
health; plus the communicator a rank builds from its spec. Must not import ray.
"""
from __future__ import annotations

import os
import socket
import time
from collections import deque
from typing import Any

from .base import KVSpec, RuntimeError_, SeqChunk, make_runner
from .comm import Communicator, SingleComm, ThreadGroup


class WorkerError(RuntimeError_):
    """A rank failed while running an executor call; the message names the rank and the method."""

    def __init__(self, message: str, rank: int | None = None, method: str | None = None):
        super().__init__(message)
        self.rank, self.method = rank, method


class WorkerTimeout(WorkerError):
    """A rank did not answer within the call's timeout (hung, or far slower than expected)."""


# --- communicator specs -------------------------------------------------------------------------------------

def build_comm(comm_spec: Any, rank: int, world_size: int) -> Communicator:
    """Turn what an executor ships to a worker into that rank's communicator.

    None (world_size 1), a `ThreadGroup` (ranks are threads of one process), a ready `Communicator`, or a dict
    {"kind": "torch.distributed", "init_method": "tcp://host:port", "backend": "gloo"|"nccl", "timeout_s": 60}
    for ranks in separate processes (the address comes from a rendezvous, e.g. through Ray).
    """
    if comm_spec is None:
        if world_size != 1:
            raise ValueError(f"world_size={world_size} needs a comm_spec (ThreadGroup or torch.distributed dict)")
        return SingleComm()
    if isinstance(comm_spec, ThreadGroup):
        return comm_spec.comm(rank)
    if isinstance(comm_spec, Communicator):
        return comm_spec
    if isinstance(comm_spec, dict) and comm_spec.get("kind") == "torch.distributed":
        import datetime

        import torch.distributed as dist

        from .comm import TorchDistComm
        if dist.is_initialized():  # a re-init after a peer died: the old group is unusable
            dist.destroy_process_group()
        dist.init_process_group(backend=comm_spec.get("backend", "gloo"), init_method=comm_spec["init_method"],
                                rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=float(comm_spec.get("timeout_s", 60))))
        return TorchDistComm()
    raise ValueError(f"unknown comm_spec {comm_spec!r}: pass None, a ThreadGroup, a Communicator or "
                     "{'kind': 'torch.distributed', 'init_method': 'tcp://host:port'}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for torch.distributed rendezvous on rank 0's host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --- worker -------------------------------------------------------------------------------------------------

def check_pages(chunks: list[SeqChunk], num_steps: int, page_size: int) -> None:
    """Every chunk's block table covers the positions the call writes (its tokens', and with num_steps > 1 the
    burst's): a runner pads a short table with page 0, so a missing page would write another sequence's K/V."""
    extra = num_steps - 1
    for c in chunks:
        if len(c.block_table) * page_size < c.start_pos + len(c.token_ids) + extra:
            raise ValueError(f"sequence {c.seq_id}'s block table has {len(c.block_table)} pages of {page_size} "
                             f"tokens, too few for positions up to {c.start_pos + len(c.token_ids) + extra - 1} "
                             "(engine page bookkeeping bug)")


class Worker:
    """One rank. Every public method is callable through `Executor.collective_rpc(name, ...)`."""

    def __init__(self, rank: int, world_size: int, logits_on_every_rank: bool = False):
        self.rank, self.world_size = rank, world_size
        self.logits_on_every_rank = logits_on_every_rank   # SPMD: every process runs an engine and needs them
        self.runner = None
        self.backend: str | None = None
        self._fault: tuple[str, float] | None = None
        self._steps = 0
        self._runner_s = 0.0   # total seconds inside runner.step (health() reports it)
        self.last_timing: tuple[float, float, float] | None = None  # last execute: (time.time() at entry,
        #                                                              seconds in runner.step, time.time() at exit)
        self._comm: Communicator | None = None
        self._pending: deque = deque()   # (wall, perf_counter, runtime.base.Pending) of execute(defer=True) bursts

    def init_model(self, backend: str, comm_spec: Any = None, **runner_kwargs: Any) -> dict:
        comm = build_comm(comm_spec, self.rank, self.world_size)
        self._comm = comm
        self.runner = make_runner(backend, rank=self.rank, world_size=self.world_size, comm=comm, **runner_kwargs)
        self.backend = backend
        return {"rank": self.rank, "model": self.runner.config.name, "kv_spec": self.runner.kv_spec()}

    def _need_runner(self):
        if self.runner is None:
            raise RuntimeError(f"rank {self.rank} has no model yet: call init_model first")
        return self.runner

    def kv_spec(self) -> KVSpec:
        return self._need_runner().kv_spec()

    def model_config(self):
        return self._need_runner().config

    def execute(self, chunks: list[SeqChunk], num_steps: int = 1, resume: bool = False, defer: bool = False):
        """Run one step. Every rank computes; only rank 0 returns the fp32 logits (n, vocab) - the others return
        None so that a remote executor does not ship world_size identical copies. num_steps > 1 (or resume): that
        many decode steps of the same rows (ModelRunner.decode_steps), returning the drawn tokens (n, num_steps);
        resume: the rows of the last decode_steps call, each fed its last drawn token (from the device).
        defer (decode steps only): return None once the burst is queued (ModelRunner.launch_steps); `collect`
        returns its tokens later, bursts in launch order (a step in between is refused: its caller would lose
        them)."""
        if self._fault is not None:
            kind, arg = self._fault
            self._fault = None
            if kind == "hang":
                time.sleep(arg)
            elif kind == "crash":
                os._exit(1)
            elif kind == "raise":
                raise RuntimeError(f"injected fault on rank {self.rank}")
        if defer:
            return self._launch(chunks, num_steps, resume)
        if self._pending:
            raise RuntimeError(f"rank {self.rank}: a step was sent while {len(self._pending)} deferred burst(s) were "
                               "not collected: collect() them first (their tokens would be lost)")
        runner = self._need_runner()
        check_pages(chunks, num_steps, runner.kv_spec().page_size)
        w0, t0 = time.time(), time.perf_counter()
        if num_steps == 1 and not resume:
            logits = runner.step(chunks)
        else:
            logits = runner.decode_steps(chunks, num_steps, resume=True) if resume else \
                runner.decode_steps(chunks, num_steps)
        self._account(w0, t0)
        return self._mine(logits)

    def _mine(self, out):
        return out if self.rank == 0 or self.logits_on_every_rank else None

    def _account(self, w0: float, t0: float) -> None:
        dt = time.perf_counter() - t0
        self._steps += 1
        self._runner_s += dt
        self.last_timing = (w0, dt, time.time())

    def _launch(self, chunks: list[SeqChunk], num_steps: int, resume: bool) -> None:
        runner = self._need_runner()
        check_pages(chunks, num_steps, runner.kv_spec().page_size)
        try:   # (the runner checks the decode_steps contract, as on the synchronous path)
            self._pending.append((time.time(), time.perf_counter(), runner.launch_steps(chunks, num_steps, resume)))
        except BaseException:
            self._pending.clear()   # (the bursts queued before it are read by nobody: the engine fails them)
            raise

    def collect(self):
        """The oldest deferred burst's drawn tokens (n, num_steps) (rank 0; None elsewhere), waited for. A failed
        burst drops the ones queued after it (they resumed from it) and raises."""
        if not self._pending:
            raise RuntimeError(f"rank {self.rank}: collect() without a burst launched by execute(defer=True)")
        w0, t0, p = self._pending.popleft()
        try:
            out = p.wait()
        except BaseException:
            self._pending.clear()
            raise
        self._account(w0, t0)
        return self._mine(out)

    def discard_bursts(self) -> int:
        """After a failed call: wait for the deferred bursts still queued and drop them, errors included (a rank
        whose peer failed to launch may hold one). Returns how many there were."""
        n = len(self._pending)
        while self._pending:
            try:
                self._pending.popleft()[2].wait()
            except Exception:   # noqa: BLE001 - the engine reports the failure that led here
                pass
        return n

    def collect_timed(self):
        """`collect`, plus this rank's `last_timing` (execute_timed's counterpart)."""
        return self.collect(), self.last_timing

    def execute_timed(self, chunks: list[SeqChunk], num_steps: int = 1, resume: bool = False):
        """`execute`, plus this rank's `last_timing`, for an executor in another process to account the call."""
        return self.execute(chunks, num_steps, resume), self.last_timing

    def samples_on_device(self) -> bool:
        """The runner draws tokens itself (needed for multi-step decode, LLM(decode_steps=...))."""
        return bool(getattr(self._need_runner(), "samples_on_device", False))

    def samples_full_on_device(self) -> bool:
        """The runner also draws full-vocabulary rows (DeviceSampling.full: top_k 0 or > 64, exactly)."""
        return bool(getattr(self._need_runner(), "samples_full_on_device", False))

    def shares_kv_pages(self) -> bool:
        """The runner keeps K/V only in the engine's pages, so sequences may share them (prefix caching)."""
        return bool(getattr(self._need_runner(), "shares_kv_pages", False))

    def free(self, seq_ids: list[int]) -> None:
        runner = self._need_runner()
        fn = getattr(runner, "free", None)
        if fn is not None:  # paged backends need nothing: the engine owns the pages
            for s in seq_ids:
                fn(s)

    def health(self) -> dict:
        used = getattr(self.runner, "plans_used", None)
        graphs = getattr(self.runner, "graph_counts", None)
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(), "host": socket.gethostname(),
                "backend": self.backend, "ready": self.runner is not None, "steps": self._steps,
                "runner_s": self._runner_s,
                # decode batches run through a plan (batch -> plan family), when the runner was given a plan book
                "plans_used": used() if used is not None else {},
                # CUDA graphs the runner captured (GPU megakernel runner; {} elsewhere)
                "graphs": graphs() if graphs is not None else {}}

    def check_comm(self) -> float:
        """All-reduce of 1.0 over the ranks: returns world_size when the communicator works."""
        import torch
        if self._comm is None:
            raise RuntimeError(f"rank {self.rank} has no communicator: call init_model or init_comm_only first")
        return float(self._comm.all_reduce(torch.ones(1))[0])

    def init_comm_only(self, comm_spec: Any) -> None:
        """Set up the communicator without a model (tests of the rendezvous, before a TP backend exists)."""
        self._comm = build_comm(comm_spec, self.rank, self.world_size)

    def inject_fault(self, kind: str, arg: float = 0.0) -> None:
        """Test hook: make the next `execute` "hang" (sleep arg s), "crash" (exit the process) or "raise"."""
        if kind not in ("hang", "crash", "raise"):
            raise ValueError(f"unknown fault {kind!r}; use 'hang', 'crash' or 'raise'")
        self._fault = (kind, float(arg))

    def shutdown(self) -> None:
        self.discard_bursts()   # (a pipelined burst still running reads and writes the runner's buffers)
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
