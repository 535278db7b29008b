"""Continuous batching: which requests run in the next step, and how many tokens each.

Every step: all running requests that have finished their prompt decode one token; requests still in prefill get
a chunk of their prompt within the step's token budget; then waiting requests are admitted in arrival order while
a batch slot and their pages are free (with prefix caching, the pages of a cached prefix of the prompt are taken
as they are and its prefill starts after them: prefix_cache.py). Nothing is ever dropped: a request that cannot be
admitted waits at the head of the queue (later arrivals do not overtake it).

Pages (kv_allocation):
- "lazy" (default): a request is admitted with the pages of the tokens it computes before its first decode step,
  and takes one more page when its next token would not fit. When none is free, the running request admitted last
  is *preempted*: its pages go back (with prefix caching its computed pages stay cached, so taking them back is
  cheap), it returns to the head of the queue with the tokens it generated, and when readmitted it computes prompt
  and output again in one prefill whose last position gives its next token (the device draws are keyed by seed and
  position, and so are the host sampler's: a preempted request continues as it would have,
  up to the rounding of K/V computed by a prefill instead of step by step). The oldest request never waits for
  pages (a request whose whole length does not fit the cache is refused at validation), so every request finishes.
  A step that preempted admits nobody, and admission leaves a small watermark of pages free for the running ones.
- "reserve": a request takes the pages of its whole length (prompt + max_tokens, capped by the context) at
  admission; nothing is preempted, and fewer requests run at once when max_tokens is large and outputs end early.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_allocator import BlockAllocator
from .errors import InvalidRequestError
from .request import Request, Status


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens of request.all_token_ids starting at request.num_computed


KV_ALLOCATION_MODES = ("lazy", "reserve")


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_batch: int, max_num_batched_tokens: int,
                 kv_allocation: str = "lazy"):
        if kv_allocation not in KV_ALLOCATION_MODES:
            raise InvalidRequestError(f"kv_allocation must be one of {KV_ALLOCATION_MODES}, got {kv_allocation!r}")
        self.allocator = allocator
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lazy = kv_allocation == "lazy"
        # pages admission leaves free while requests run (lazy): room for them to grow a few steps before the
        # newcomer would be preempted again
        self.watermark = max(1, allocator.num_pages // 100) if self.lazy else 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preempted: list[Request] = []   # preempted since the engine last took the list (it frees their workers)
        self.num_preemptions = 0
        self._out: list[ScheduledChunk] = []
        self._budget = 0

    def pages_needed(self, req: Request) -> int:
        """Pages a request takes at admission."""
        if self.lazy:   # the positions its prefill computes: all its tokens (a preempted one's output included)
            return self.allocator.pages_for(req.num_tokens)
        # The last generated token is never fed back, so the cache holds at most max_total_len - 1 positions.
        return self.allocator.pages_for(max(1, req.max_total_len - 1))

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def admission_waits(self) -> bool:
        """A waiting request could be admitted by the next schedule(): one waits and the batch has a free slot. (With
        the batch full, the head waits for a running request to finish whatever the engine does, so a burst of decode
        steps does not hold it back beyond the burst in which that request finishes.)"""
        return bool(self.waiting) and len(self.running) < self.max_batch

    def schedule(self) -> list[ScheduledChunk]:
        self._budget = self.max_num_batched_tokens
        self._out = out = []
        preempted = self.num_preemptions
        # decodes first: they are cheap and keep inter-token latency steady
        for r in [r for r in self.running if r.decoding]:
            if r.status is Status.RUNNING and self._grow(r, r.num_tokens):
                self._put(r, 1)
        for r in list(self.running):
            if self._budget <= 0:
                break
            if r.status is Status.RUNNING and not r.decoding:   # still computing its prompt (or, preempted, more)
                self._put(r, min(r.num_tokens - r.num_computed, self._budget))
        if self.num_preemptions != preempted:
            return out   # short of pages: admitting now would preempt the newcomer again
        held = []
        while self.waiting and self._budget > 0 and len(self.running) < self.max_batch:
            r = self.waiting[0]
            if self.allocator.waits_for_pending(r):   # (prefix caching) its next prompt page is being computed:
                held.append(self.waiting.popleft())   # taken from the cache in a step or two; those behind go on
                continue
            got = self.allocator.admit(r, self.pages_needed(r), self.watermark if self.running else 0)
            if got is None:
                break  # FIFO: the head waits for pages; later arrivals do not overtake it
            self.waiting.popleft()
            r.block_table, cached = got
            if not r.num_preemptions:
                r.num_cached_tokens = cached   # (the prompt's; a readmission's hits are its own pages again)
            r.num_computed = cached   # a cached prefix (prefix_cache.py) is not computed again
            r.status = Status.RUNNING
            self.running.append(r)
            self._put(r, min(r.num_tokens - r.num_computed, self._budget))
        self.waiting.extendleft(reversed(held))   # back at the head, in their order
        return out

    def _put(self, r: Request, n: int) -> None:
        self._out.append(ScheduledChunk(r, n))
        self._budget -= n

    def _grow(self, r: Request, upto: int) -> bool:
        """Give r the pages of positions [0, upto), preempting the running requests admitted last while too few are
        free; False when r itself was the one preempted."""
        need = self.allocator.pages_for(upto) - len(r.block_table)
        if need <= 0:
            return True
        while not self.allocator.can_allocate(need):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        r.block_table += self.allocator.allocate(need)
        return True

    def _preempt(self, r: Request) -> None:
        """Take r's pages back and queue it first, to compute its tokens again when readmitted. (r is not scheduled in
        this step yet: only decodes grow, in admission order, and victims are taken from the other end.)"""
        self.running.remove(r)
        self.allocator.forget_pending(r)
        self.allocator.free(r.block_table)
        r.block_table = []
        # its computed pages' keys (prefix caching): the readmission looks its tokens up without hashing them again
        r.prompt_keys = max(r.prompt_keys, r.block_keys, key=len)
        r.block_keys = []
        r.computed_high = max(r.computed_high, r.num_computed)
        r.num_computed = 0
        r.status = Status.WAITING
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)   # (victims go newest first: the oldest ends up at the head)
        self.preempted.append(r)

    def grow_burst(self, reqs: list[Request], starts: list[int], k: int) -> int:
        """The most decode steps <= k that the free pages let every row run, row i at positions starts[i] ..
        starts[i] + k - 1, after giving the rows those pages (nothing is preempted for a burst: 0 when not even one
        step fits)."""
        if not self.lazy:
            return k   # (reserved for their whole length)
        a = self.allocator
        free = a.num_free

        def extra(k):
            return sum(max(0, a.pages_for(s + k) - len(r.block_table)) for r, s in zip(reqs, starts))

        while k > 0 and extra(k) > free:
            k -= 1
        for r, s in zip(reqs, starts):
            n = a.pages_for(s + k) - len(r.block_table)
            if n > 0:
                r.block_table += a.allocate(n)
        return k

    def release(self, req: Request) -> None:
        """Remove a finished (or aborted/failed) request and free its pages."""
        if req in self.running:
            self.running.remove(req)
            self.allocator.forget_pending(req)
            self.allocator.free(req.block_table)
            req.block_table = []
        elif req in self.waiting:
            self.waiting.remove(req)
