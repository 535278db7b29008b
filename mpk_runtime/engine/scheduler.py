"""Continuous batching: which requests run in the next step, and how many tokens each.

Every step: all running requests that have finished their prompt decode one token; requests still in prefill get
a chunk of their prompt within the step's token budget; then waiting requests are admitted in arrival order while
a batch slot and their pages are free (with prefix caching, the pages of a cached prefix of the prompt are taken
as they are and its prefill starts after them: prefix_cache.py). A request reserves the pages for its whole life
(prompt + max_tokens, capped by the context) at admission, so a running request never runs out of pages and nothing
is preempted; when the cache is full, new requests wait in the queue (never dropped) until finished ones free their
pages.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .block_allocator import BlockAllocator
from .request import Request, Status


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens of request.all_token_ids starting at request.num_computed


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_batch: int, max_num_batched_tokens: int):
        self.allocator = allocator
        self.max_batch = max_batch
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def pages_needed(self, req: Request) -> int:
        # The last generated token is never fed back, so the cache holds at most max_total_len - 1 positions.
        return self.allocator.pages_for(max(1, req.max_total_len - 1))

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledChunk] = []
        # decodes first: they are cheap and keep inter-token latency steady
        for r in self.running:
            if r.num_computed == r.num_tokens - 1 and r.output_token_ids:
                out.append(ScheduledChunk(r, 1))
                budget -= 1
        for r in self.running:
            if budget <= 0:
                break
            left = r.num_tokens - r.num_computed
            if not r.output_token_ids and left > 0:  # still prefilling
                n = min(left, budget)
                out.append(ScheduledChunk(r, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            r = self.waiting[0]
            got = self.allocator.admit(r, self.pages_needed(r))
            if got is None:
                break  # FIFO: the head waits for pages; later arrivals do not overtake it
            self.waiting.popleft()
            r.block_table, r.num_cached_tokens = got
            r.num_computed = r.num_cached_tokens   # a cached prefix (prefix_cache.py) is not computed again
            r.status = Status.RUNNING
            self.running.append(r)
            n = min(len(r.prompt_token_ids) - r.num_computed, budget)
            out.append(ScheduledChunk(r, n))
            budget -= n
        return out

    def release(self, req: Request) -> None:
        """Remove a finished (or aborted/failed) request and free its pages."""
        if req in self.running:
            self.running.remove(req)
            self.allocator.free(req.block_table)
            req.block_table = []
        elif req in self.waiting:
            self.waiting.remove(req)
