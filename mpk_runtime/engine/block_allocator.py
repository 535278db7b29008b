"""Paged KV cache allocation: the engine decides which pages each sequence uses; the runner stores them."""
from __future__ import annotations

import heapq
import math


class OutOfPages(RuntimeError):
    pass


class FreePages:
    """The free ids of pages [0, num_pages), handed out lowest first, in memory of the pages freed so far rather than
    of the cache's size: ids from `_next` up were never handed out (all free), freed ids below it wait in a min-heap
    (all below `_next`, so the heap's top, when there is one, is the lowest free id). The list of every id it replaces
    took num_pages Python ints up front (max_batch=10**7 on the host: tens of GB, the process killed while the engine
    started) and sorted itself whole on every free."""

    def __init__(self, num_pages: int):
        self.num_pages, self._next, self._heap = num_pages, 0, []

    def __len__(self) -> int:
        return self.num_pages - self._next + len(self._heap)

    def pop(self) -> int:
        """The lowest free id, taken."""
        if self._heap:
            return heapq.heappop(self._heap)
        if self._next >= self.num_pages:
            raise IndexError("no free page")
        self._next += 1
        return self._next - 1

    def push(self, page: int) -> None:
        heapq.heappush(self._heap, page)

    def extend(self, pages) -> None:
        for p in pages:
            heapq.heappush(self._heap, p)


class BlockAllocator:
    """A free list of page ids [0, num_pages). Pages are handed out lowest id first (deterministic tables)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = FreePages(num_pages)   # pop() gives the lowest free id
        self._used: set[int] = set()

    def pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"page {p} freed twice or never allocated (engine bookkeeping bug)")
            self._used.remove(p)
        self._free.extend(pages)

    def admit(self, req, num_pages: int, keep_free: int = 0) -> tuple[list[int], int] | None:
        """Pages for a request being admitted (num_pages: the positions it computes before it decodes, or its whole
        life; scheduler.py) and how many of its tokens they already hold (0 here: no cache), or None when they are
        not free with keep_free pages left over."""
        return (self.allocate(num_pages), 0) if self.can_allocate(num_pages + keep_free) else None

    def commit(self, req) -> None:
        """Called after req.num_computed grew (its K/V for those tokens are in its pages). Nothing here."""

    def waits_for_pending(self, req) -> bool:
        """Admitting req later would spare computing pages another request computes now (prefix caching only)."""
        return False

    def forget_pending(self, req) -> None:
        """req ended or was preempted (prefix caching: it no longer computes its pending pages)."""

    def reset(self) -> None:
        self.__init__(self.num_pages, self.page_size)
