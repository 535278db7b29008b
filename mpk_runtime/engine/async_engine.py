"""`EngineLoop`: one background thread drives an `LLMEngine` so that callers on other threads (HTTP handlers,
a router) share its continuous batches. Callers submit requests and get each output through a callback.

The engine is not thread-safe; only the loop thread touches it. Submissions and aborts travel by a queue and
are applied between steps. When idle the loop checks the workers' health every `health_interval` seconds, so a
dead worker is noticed (and the executor rebuilt) before the next request arrives.
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import logging
import queue
import threading
import time
from typing import Callable

from .engine import LLMEngine
from .errors import InvalidRequestError, RequestFailedError
from .request import RequestOutput
from .sampling import SamplingParams
from .step_stats import new_loop_stats

log = logging.getLogger(__name__)
OutputCallback = Callable[[RequestOutput], None]


def _one_completion(params: SamplingParams) -> None:
    """A loop's request is one completion (LLMEngine.add_request's rule), refused in the caller like every other
    typed error (it came back as an error output from the loop)."""
    if isinstance(params, SamplingParams) and params.n != 1:
        raise InvalidRequestError(f"an engine request is one completion, and these params ask for n={params.n}: "
                                  "submit one for each of mpk_runtime.engine.sampling.completions(params)")


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "engine", health_interval: float | None = 5.0,
                 on_delivered: Callable[[], None] | None = None):
        """on_delivered: called on the loop thread after each round of outputs went to their callbacks (a step's,
        an abort's, a health check's, a failed step's before its rebuild): engine_process sends them on as one
        message there."""
        self.engine = engine
        self.name = name
        self.health_interval = health_interval
        self._on_delivered = on_delivered
        engine.on_failed_outputs = self._deliver_all   # before a slow rebuild
        self._cmds: queue.Queue = queue.Queue()
        self._callbacks: dict[str, OutputCallback] = {}
        self._outstanding = 0           # submitted and not finished (read by the router without a lock)
        self._lock = threading.Lock()
        self._ids = 0
        self._times = new_loop_stats()  # where the loop thread's time goes (step_stats.py: loop_*_s)
        # the loop's idle stretches (nothing to run) of 2 ms or more, newest last: (time.monotonic() at its start,
        # seconds); load_test places them in its measured window
        self.idle_log: collections.deque = collections.deque(maxlen=1024)
        self.progress = time.monotonic()  # when the loop thread last went round (at least every 0.5 s unless wedged)
        self._stop = threading.Event()
        self._closed: str | None = None   # why the loop takes no more commands (set, under _lock, as it ends)
        self._thread = threading.Thread(target=self._run, name=f"mpk-{name}", daemon=True)
        self._thread.start()

    # --- caller side (any thread) ---------------------------------------------------------------------------
    @property
    def load(self) -> int:
        return self._outstanding

    @property
    def alive(self) -> bool:
        """The loop thread runs and takes requests (it is the only thing that ever finishes a submitted request)."""
        return self._closed is None and self._thread.is_alive()

    @property
    def stalled_s(self) -> float:
        """Seconds since the loop thread last went round: under a second where it is idle or stepping, more only
        inside one long step (a kernel compiled on first use, a worker waiting out step_timeout) or where wedged."""
        return max(0.0, time.monotonic() - self.progress)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, on_output: OutputCallback,
               prompt: str | None = None, request_id: str | None = None, stream: bool = True,
               checked: bool = False) -> str:
        """Validate now (typed errors raise in the caller), queue, and return the request id. stream=False:
        on_output gets the finished output only (LLMEngine.add_request). checked: the caller validated it against
        this engine's spec already (an engine process's parent), so it is not walked again here."""
        if self.engine.dead or not self.alive:
            raise RequestFailedError(f"replica {self.name} is down: {self.engine.dead or 'its engine loop exited'}")
        if not checked:
            self.engine.validate(prompt_token_ids, params)
            _one_completion(params)
        with self._lock:   # (queued under the lock: the loop's last drain takes it, or it is refused here)
            if self._closed is not None:
                raise RequestFailedError(f"replica {self.name} is down: {self._closed}")
            self._ids += 1
            rid = request_id or f"{self.name}-{self._ids}"
            self._outstanding += 1
            self._cmds.put(("add", rid, list(prompt_token_ids), params, prompt, on_output, stream))
        return rid

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def call(self, fn: Callable[[LLMEngine], object]) -> "cf.Future":
        """Run fn(engine) on the loop thread between steps (the engine is not thread-safe); its result or error
        arrives in the returned future."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._closed is None:
                self._cmds.put(("call", fn, fut))
                return fut
        fut.set_exception(RequestFailedError(f"replica {self.name} is down: {self._closed}"))
        return fut

    def stats(self) -> dict:
        s = dict(self.engine.stats)
        s.update(self._times)
        dead = self.engine.dead
        if dead is None and not self.alive and not self._stop.is_set():
            dead = self._closed or f"the engine loop thread of {self.name} has exited"
        a = self.engine.allocator
        s.update(waiting=len(self.engine.scheduler.waiting), running=len(self.engine.scheduler.running),
                 outstanding=self._outstanding, dead=dead, stalled_s=round(self.stalled_s, 3),
                 kv_pages_total=a.num_pages,
                 kv_pages_used=a.num_pages - a.num_free)
        return s

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop after its current round. Requests it still holds (queued or running) end with an error
        output that says so, and pending calls with RequestFailedError: no caller is left waiting."""
        self._stop.set()
        self._cmds.put(("wake",))
        if threading.current_thread() is not self._thread:   # (from an output callback: the loop ends after it)
            self._thread.join(timeout)

    # --- loop thread --------------------------------------------------------------------------------------
    def _deliver_all(self, outs: list[RequestOutput]) -> None:
        for o in outs:
            self._deliver(o)
        if self._on_delivered is not None:
            self._on_delivered()

    def _deliver(self, out: RequestOutput, cb: OutputCallback | None = None) -> None:
        """out to its request's callback (cb: to that one instead, the map left alone: a refused duplicate id)."""
        if cb is None:
            cb = self._callbacks.get(out.request_id)
            if out.finished:
                self._callbacks.pop(out.request_id, None)
        if out.finished:
            with self._lock:
                self._outstanding -= 1
        if cb is not None:
            try:
                cb(out)
            except Exception:  # a consumer's bug must not stop the loop
                log.exception("output callback failed for %s", out.request_id)

    def _apply(self, cmd) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, prompt, cb, stream = cmd
            if rid in self._callbacks:   # an id in use: refuse this request alone (the running one keeps its callback)
                self._deliver(RequestOutput.failed(rid, prompt, ids, f"request id {rid!r} is already in use"), cb)
                return
            self._callbacks[rid] = cb
            try:
                self.engine.add_request(ids, params, request_id=rid, prompt=prompt, stream=stream)
            except Exception as e:  # e.g. the engine died after submit validated: finish it with the error
                self._deliver(RequestOutput.failed(rid, prompt, ids, str(e)))
        elif cmd[0] == "abort":
            out = self.engine.abort(cmd[1])
            if out is not None:
                self._deliver(out)
        elif cmd[0] == "call":
            _, fn, fut = cmd
            if not fut.set_running_or_notify_cancel():   # the caller cancelled it (a timeout): do not run it
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:   # the caller's to handle (a SystemExit too: it left the future unanswered
                fut.set_exception(e)     # for good and ended this loop, every request with it)

    def _end_all(self, reason: str) -> None:
        """On the loop thread, after its last round (shutdown): every request still queued or running ends with an
        error output naming reason (a running one keeps the tokens it has), every queued call with the error."""
        ends: list[RequestOutput] = []
        refused: list[tuple[RequestOutput, OutputCallback]] = []
        try:
            while True:
                cmd = self._cmds.get_nowait()
                if cmd[0] == "add":
                    _, rid, ids, _params, prompt, cb, _stream = cmd
                    out = RequestOutput.failed(rid, prompt, ids, reason)
                    if rid in self._callbacks:   # (an id in use: its own callback, as _apply refuses it; it took
                        refused.append((out, cb))   # the running one's, which then never heard its end)
                        continue
                    self._callbacks[rid] = cb
                    ends.append(out)
                elif cmd[0] == "call" and cmd[2].set_running_or_notify_cancel():
                    cmd[2].set_exception(RequestFailedError(reason))
        except queue.Empty:
            pass
        queued = {o.request_id for o in ends}
        for rid in [r for r in self._callbacks if r not in queued]:
            snap = None
            try:
                snap = self.engine.abort(rid)   # (its pages back; a burst in flight finishes on the device)
            except Exception:   # noqa: BLE001 - shutting down: the caller's error output matters more
                log.exception("abort of %s at shutdown failed", rid)
            ends.append(RequestOutput.failed(rid, None, [], reason) if snap is None else
                        dataclasses.replace(snap, finished=True, finish_reason="error", error=reason))
        for out, cb in refused:
            self._deliver(out, cb)
        if ends:
            self._deliver_all(ends)

    def _run(self) -> None:
        reason = f"the engine loop of {self.name} exited unexpectedly"
        try:
            self._loop()
            reason = f"replica {self.name} was shut down"
        except Exception as e:   # (a bug outside a step's own handling: its callers must not wait for good)
            log.exception("engine loop of %s failed", self.name)
            reason = f"the engine loop of {self.name} failed ({type(e).__name__}: {e})"
        finally:
            with self._lock:   # no command queued after this; _end_all drains the rest
                self._closed = reason
            self._end_all(reason)

    def _loop(self) -> None:
        last_health = time.monotonic()
        tm = self._times
        pc = time.perf_counter
        idle_from = None   # time.monotonic() when the current idle stretch began
        while not self._stop.is_set():
            self.progress = time.monotonic()
            busy = self.engine.has_unfinished()
            if not busy and idle_from is None:
                idle_from = time.monotonic()
            t0 = pc()
            try:
                cmd = self._cmds.get_nowait() if busy else self._cmds.get(timeout=0.5)
            except queue.Empty:
                cmd = None
            t1 = pc()
            if not busy:
                tm["loop_idle_s"] += t1 - t0
            if cmd is not None and idle_from is not None:   # the idle stretch ends with this command
                now = time.monotonic()
                if now - idle_from >= 0.002:
                    self.idle_log.append((idle_from, now - idle_from))
                idle_from = None
            if cmd is not None:
                self._apply(cmd)
                try:
                    while True:  # drain everything that arrived: they join this step
                        self._apply(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                t2 = pc()
                tm["loop_apply_s"] += t2 - t1
                t1 = t2
            if self.engine.has_unfinished():
                try:
                    outs = self.engine.step()
                except Exception as e:  # a bug in a step must fail its requests, not kill this thread (and
                    log.exception("engine step failed on %s", self.name)   # leave every caller waiting forever)
                    outs = self.engine._on_failure(e)
                t2 = pc()
                tm["loop_step_s"] += t2 - t1
                self._deliver_all(outs)
                tm["loop_deliver_s"] += pc() - t2
                last_health = time.monotonic()
            elif self.health_interval and time.monotonic() - last_health > self.health_interval:
                last_health = time.monotonic()
                self._deliver_all(self.engine.check_health())
                tm["loop_health_s"] += pc() - t1
            elif cmd is not None and self._on_delivered is not None:   # (an abort's output, or an add refused)
                self._on_delivered()
