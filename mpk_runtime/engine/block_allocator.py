"""Paged KV cache allocation: the engine decides which pages each sequence uses; the runner stores them."""
from __future__ import annotations

import math


class OutOfPages(RuntimeError):
    pass


class BlockAllocator:
    """A free list of page ids [0, num_pages). Pages are handed out lowest id first (deterministic tables)."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() gives the lowest id
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
        self._free.extend(sorted(pages, reverse=True))
        self._free.sort(reverse=True)

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
