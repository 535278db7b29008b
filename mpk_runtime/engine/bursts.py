"""Bursts of decode steps (LLMEngine(decode_steps=k)), and with async_bursts the next burst queued on the device
before the engine reads the last one.

A burst: while every scheduled row decodes one token sampled on the device and no waiting request could be admitted
(none waits, or the batch is full: the head waits for a row to finish, which the burst's end shows), one executor
call runs up to k decode steps (ModelRunner.decode_steps: the drawn tokens fed back on the device); each row
takes its tokens in order up to its stop, and the rest were computed for nothing.

async_bursts: bursts are launched without waiting (Worker.execute(defer=True): ModelRunner.launch_steps returns once
its launches are queued) and read later (Worker.collect). Before the engine reads a burst it launches the next burst
of the same rows, resumed from the device (each row fed the token the last burst drew for it, which the engine has
not read yet: resume=True), so the device runs the two back to back and never waits for the host between them:
reading the tokens, turning them into outputs, scheduling, the next burst's inputs and launches all happen while
the device runs. Rows that stop in the burst being read are dropped from the one queued after it (its tokens for them
are not taken) and their pages are released only after it is read (it still writes K/V into them); a request aborted
meanwhile is treated the same way; an arrival that could be admitted ends the pipeline after the burst in flight.
The next engine step reads the burst in flight before it schedules anything.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..runtime.base import SeqChunk
from .request import Request, RequestOutput

# LLM(async_bursts=None), the default, pipelines every burst. Session 52's form (the next burst submitted from a
# helper thread after the last one returned) gained only from 64 rows (H100), so it ran only bursts of >= 32 rows.
# Session 54's (queued before the last one is read; one H200, k = 8, greedy, ms a decode step without the prefill
# steps, synchronous -> pipelined in one process): llama-3.2-1b 1 row 1.205 -> 1.092 and 1.184 -> 1.086, 8 rows
# 1.423 -> 1.306, 128 rows 2.278 -> 1.846; qwen3-8b 1 row 4.939 -> 4.789, 8 rows 5.810 -> 5.623: every size gains.


class _Now:
    """A call's result behind the reader's interface: a synchronous burst's tokens (without async_bursts)."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn = fn

    def result(self):
        return self._fn()


@dataclass
class Burst:
    future: Any                      # .result() -> the executor's per-rank results (rank 0's: drawn (n, k)), once
    reqs: list[Request]              # its rows, in chunk order
    chunks: list[SeqChunk]
    k: int
    dropped: set[str] = field(default_factory=set)        # request ids whose tokens in it are not taken
    deferred: list[Request] = field(default_factory=list)  # finished requests whose pages it still writes


class BurstsMixin:
    """LLMEngine's burst steps (engine.py holds the rest; this class only uses its state)."""

    def _steps_for(self, sched, chunks: list[SeqChunk]) -> int:
        """Decode steps this engine step runs: decode_steps when every row decodes one token sampled on the device
        and no waiting request could be admitted (one that could would wait the extra steps for its prefill; with
        the batch full the head waits for a row to finish anyway, found at the burst's end), capped so that no row
        goes past its length, and (lazy pages) so that the free pages cover every row's positions of the burst
        (the rows' tables grown to them, the chunks given the grown tables); else 1."""
        if self.decode_steps == 1 or self.scheduler.admission_waits():
            return 1
        k = self.decode_steps
        for s, c in zip(sched, chunks):
            r = s.request
            if c.sampling is None or len(c.token_ids) != 1 or not r.output_token_ids:
                return 1
            k = min(k, r.max_total_len - r.num_tokens)
        if k <= 1:
            return 1
        reqs = [s.request for s in sched]
        k = max(self.scheduler.grow_burst(reqs, [r.num_computed for r in reqs], k), 1)
        for r, c in zip(reqs, chunks):
            if len(c.block_table) != len(r.block_table):
                c.block_table = list(r.block_table)
        return k

    def _submit_burst(self, reqs: list[Request], chunks: list[SeqChunk], k: int, resume: bool = False) -> Burst:
        """The burst as a Burst to read: launched now without waiting (async_bursts: Worker.execute(defer=True),
        read by Worker.collect), else run when it is read."""
        timeout = None if self.step_timeout is None else self.step_timeout * k
        if self.async_bursts:
            self.executor.collective_rpc("execute", (chunks, k, resume), {"defer": True}, timeout=self.step_timeout)
            fut = _Now(lambda: self.executor.collective_rpc("collect", timeout=timeout))
        else:
            args = (chunks, k, True) if resume else (chunks, k)
            fut = _Now(lambda: self.executor.collective_rpc("execute", args, timeout=timeout))
        return Burst(fut, reqs, chunks, k)

    def _step_many(self, sched, chunks: list[SeqChunk], k: int, want_all: bool, t0: float, t1: float,
                   c0: float) -> list[RequestOutput]:
        """k decode steps of the scheduled rows in one executor call; each row takes its k tokens in order up to
        its stop (the rest were computed for nothing and are dropped)."""
        try:   # (async_bursts: the launch calls the workers now; a failure there fails what ran, as a step's does)
            b = self._submit_burst([s.request for s in sched], chunks, k)
        except Exception as e:
            return self._on_failure(e)
        return self._read_burst(b, want_all, t0, t1, c0)

    def _next_burst(self, b: Burst) -> Burst | None:
        """The burst after b, launched now, before b is read (async_bursts), or None: some row of b is gone, a
        waiting request could be admitted, or a row has no position left after b."""
        if not self.async_bursts or b.dropped or self.scheduler.admission_waits():
            return None
        k = min([self.decode_steps] + [r.max_total_len - (r.num_tokens + b.k) for r in b.reqs])
        if k >= 1:   # (lazy pages: as many steps as the free pages cover; never a preemption for a burst)
            k = self.scheduler.grow_burst(b.reqs, [c.start_pos + b.k for c in b.chunks], k)
        if k < 1:
            return None
        chunks = [SeqChunk(c.seq_id, [0], c.start_pos + b.k, list(r.block_table) if len(r.block_table) !=
                           len(c.block_table) else c.block_table, c.sampling, False) for c, r in zip(b.chunks, b.reqs)]
        self.stats["async_bursts"] += 1
        return self._submit_burst(b.reqs, chunks, k, resume=True)

    def _read_burst(self, b: Burst, want_all: bool, t0: float, t1: float, c0: float) -> list[RequestOutput]:
        try:
            nxt = self._inflight = self._next_burst(b)   # queued behind b before b is read: the device runs both
            drawn = b.future.result()[0]
        except Exception as e:
            for r in b.deferred:   # (finished and reported already: not failed again)
                self.scheduler.release(r)
            return self._on_failure(e)   # (the burst queued after b, if any, is discarded there)
        if b.deferred:
            for r in b.deferred:
                self.scheduler.release(r)
            self._forget_many(b.deferred)
        t2 = time.perf_counter()
        timing = getattr(self.executor, "last_timing", None)
        rows = drawn.tolist()
        self._count_step(len(b.chunks))
        self.stats["multi_steps"] += 1
        self.stats["device_steps_in_multi"] += b.k
        now = time.monotonic()
        outputs, done = [], []
        for r, toks in zip(b.reqs, rows):
            if r.request_id in b.dropped:
                continue
            reason = None
            for tok in toks:
                r.num_computed += 1
                if not 0 <= tok < self.vocab_size:
                    reason = "error"
                    r.finish("error", error=f"sampling failed for this request ({self._bad_token(tok)})")
                    self.stats["requests_failed"] += 1
                    break
                reason = self._accept(r, tok, now)
                if reason:
                    break
            self.allocator.commit(r)
            if reason:
                done.append(r)
            if reason or (want_all and r.stream):
                outputs.append(r.snapshot())
        if nxt is not None:
            nxt.dropped.update(r.request_id for r in done)
        self._finish_step(done, 0, len(b.chunks), t0, t1, t2, c0, timing, defer_to=nxt)
        return outputs

    def _read_inflight(self, want_all: bool) -> list[RequestOutput]:
        """The next engine step when a burst is in flight: read it (and maybe submit the one after)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        b, self._inflight = self._inflight, None
        return self._read_burst(b, want_all, t0, t0, c0)

    def _abort_inflight(self, req: Request) -> bool:
        """Abort a row of the burst in flight: its tokens there are dropped and its pages released after it. False
        when req is not in it."""
        b = self._inflight
        if b is None or req not in b.reqs or req.request_id in b.dropped:
            return False
        b.dropped.add(req.request_id)
        b.deferred.append(req)
        req.finish("abort")
        self._requests.pop(req.request_id, None)
        return True
