"""pyvm: the CPU twin of the megakernel. Executes the TaskGraphs of a TP group with torch, under exactly the
protocol the GPU kernel follows (tasks/graph.py): per-SM ordered lists, waits `counter >= triggers * (step -
lag)`, increments after each task, counters never reset between steps or launches.

Interleavings:
  "random"   one thread, a seeded random choice among the SMs (of all ranks) whose next task may run;
             explores a different legal order per seed; a state where nothing can run is a deadlock and
             raises at once, naming the waiting tasks.
  "threads"  one thread per (rank, SM), spinning on the counters with a bounded wait (KernelTimeout).
  "ordered"  SM lists round-robin, deterministic (fastest; used for the conventional path).
"""
from __future__ import annotations

import random
import threading
import time
from typing import Callable

from ..tasks.graph import TaskGraph
from ..tasks.ops import TASK_READY, get_task_kind
from .base import KernelTimeout
from .memory import RankMemory, StepCtx, Tickets


class PyVM:
    def __init__(self, graphs: list[TaskGraph], mems: list[RankMemory], *, mode: str = "random", seed: int = 0,
                 timeout_s: float = 30.0, poison: bool = True):
        if mode not in ("random", "threads", "ordered"):
            raise ValueError(f"pyvm mode must be random, threads or ordered, got {mode!r}")
        self.graphs, self.mems, self.mode = graphs, mems, mode
        self.rng = random.Random(seed)
        self.timeout_s, self.poison = timeout_s, poison
        self.counters = [[0] * len(g.events) for g in graphs]
        self.tickets = [Tickets() for _ in graphs]   # per rank, never reset (as the counters)
        self.steps_done = 0  # global step counter: the next launch starts at steps_done + 1
        self._kernels = {k: get_task_kind(k) for g in graphs for k in {t.kind for t in g.tasks}}
        self.trace: list[tuple[int, int, int, int]] | None = None  # (rank, sm, step, task id) if enabled

    def _ready(self, rank: int, task, step: int, ctx: StepCtx | None = None) -> bool:
        c = self.counters[rank]
        ev = self.graphs[rank].events
        if not all(c[e] >= ev[e].triggers * (step - lag) for e, lag in task.waits):
            return False
        hook = TASK_READY.get(task.kind)   # a condition on data (the LL all-reduce's flags)
        return hook is None or ctx is None or hook(task, self.mems[rank], ctx)

    def _run_task(self, rank: int, task, ctx: StepCtx) -> None:
        self._kernels[task.kind](task, self.mems[rank], ctx)
        for r, e in task.signals:
            self.counters[r][e] += 1

    def launch(self, ctx_for: Callable[[int, int], StepCtx], nsteps: int = 1) -> None:
        """Run `nsteps` steps in one launch. ctx_for(rank, local_step) gives each step's inputs."""
        if self.poison:
            for m in self.mems:
                m.poison()
        first = self.steps_done + 1
        ctxs = {(r, k): ctx_for(r, k) for r in range(len(self.graphs)) for k in range(nsteps)}
        for (r, k), c in ctxs.items():
            c.step = first + k
            c.tickets = self.tickets[r]
        getattr(self, "_launch_" + self.mode)(ctxs, first, nsteps)
        self.steps_done += nsteps

    # --- interleavings ---------------------------------------------------------------------------------------
    def _launch_random(self, ctxs, first, nsteps, choose=None):
        choose = choose or self.rng.choice
        state = [(r, sm) for r, g in enumerate(self.graphs) for sm in range(g.num_sms) if g.sm_lists[sm]]
        ptr = {key: 0 for key in state}
        k_of = {key: 0 for key in state}
        live = list(state)
        while live:
            runnable = []
            for key in live:
                r, sm = key
                g = self.graphs[r]
                t = g.tasks[g.sm_lists[sm][ptr[key]]]
                if self._ready(r, t, first + k_of[key], ctxs[(r, k_of[key])]):
                    runnable.append(key)
            if not runnable:
                raise KernelTimeout("pyvm deadlock: no SM can make progress:\n  " + "\n  ".join(
                    self._describe_wait(r, sm, ptr[(r, sm)], first + k_of[(r, sm)]) for r, sm in live[:8]))
            key = choose(runnable)
            r, sm = key
            g = self.graphs[r]
            t = g.tasks[g.sm_lists[sm][ptr[key]]]
            self._run_task(r, t, ctxs[(r, k_of[key])])
            if self.trace is not None:
                self.trace.append((r, sm, first + k_of[key], t.id))
            ptr[key] += 1
            if ptr[key] == len(g.sm_lists[sm]):
                ptr[key] = 0
                k_of[key] += 1
                if k_of[key] == nsteps:
                    live.remove(key)

    def _launch_ordered(self, ctxs, first, nsteps):
        # always the first runnable SM: deterministic; a blocked SM is skipped until its wait is satisfied
        self._launch_random(ctxs, first, nsteps, choose=lambda runnable: runnable[0])

    def _launch_threads(self, ctxs, first, nsteps):
        cond = threading.Condition()
        errors: list[BaseException] = []

        def sm_loop(r: int, sm: int) -> None:
            g = self.graphs[r]
            try:
                for k in range(nsteps):
                    for i, tid in enumerate(g.sm_lists[sm]):
                        t = g.tasks[tid]
                        deadline = time.monotonic() + self.timeout_s
                        with cond:
                            while not self._ready(r, t, first + k, ctxs[(r, k)]):
                                if errors:
                                    return
                                left = deadline - time.monotonic()
                                if left <= 0:
                                    raise KernelTimeout("pyvm wait timed out after %.1fs: %s" % (
                                        self.timeout_s, self._describe_wait(r, sm, i, first + k)))
                                cond.wait(min(left, 0.05))
                        self._kernels[t.kind](t, self.mems[r], ctxs[(r, k)])
                        with cond:
                            for rr, e in t.signals:
                                self.counters[rr][e] += 1
                            cond.notify_all()
            except BaseException as e:  # noqa: BLE001 - reported to the launcher
                with cond:
                    errors.append(e)
                    cond.notify_all()

        threads = [threading.Thread(target=sm_loop, args=(r, sm), daemon=True)
                   for r, g in enumerate(self.graphs) for sm in range(g.num_sms) if g.sm_lists[sm]]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]

    def _describe_wait(self, r: int, sm: int, i: int, step: int) -> str:
        g = self.graphs[r]
        t = g.tasks[g.sm_lists[sm][i]]
        need = [(e, self.counters[r][e], g.events[e].triggers * (step - lag)) for e, lag in t.waits
                if self.counters[r][e] < g.events[e].triggers * (step - lag)]
        return f"rank {r} SM {sm} step {step}: {t.label()} waits on (event, counter, needed) {need}"
