"""Automatic prefix caching: pages whose tokens were computed stay findable by their content after their sequence
ends, and a new request whose prompt starts with the same tokens takes those pages instead of computing them again
(a shared system prompt, the turns before this one of a chat, few-shot examples).

A page is cached once it is full and all its tokens' K/V are in it (req.num_computed passed its end). Its key is a
chained digest, sha256(key of the page before | its page_size token ids), so a key names the whole prefix up to the
page's end: K/V at a position depend on every token before it, and on nothing else for a given model. Sharing is
read-only by construction: a sequence writes K/V only at positions >= its num_computed, and a request that takes
cached pages starts computing at their end, in pages of its own. At least the prompt's last token is computed, so
its logits exist to sample from.

A cached page nobody holds is not free but *evictable*: allocation takes free pages first, then evicts the least
recently released cached page (a sequence's pages are released tail first, so a shared head outlives its tails).
Reference counts let several running requests hold one page. The engine resets the allocator (and so the cache)
whenever the workers fail: their K/V may be gone.

A prompt page being computed by a running request is *pending*: a request whose prompt's next uncached page is
pending (the same prompt sent n times, many requests with one system prompt arriving together) is held back from
admission until that page is cached, then takes it, instead of computing the same tokens beside it (the scheduler
admits the requests behind it meanwhile). If the computing request ends or is preempted first, its pending pages are
forgotten and the held request is admitted as usual.

Outputs with a cached prefix equal the uncached ones up to the rounding of a prompt computed in two parts (the
cached pages, then the rest) instead of one, as with chunked prefill.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict

from .block_allocator import BlockAllocator, OutOfPages


def block_key(prev: bytes, tokens) -> bytes:
    """The key of a full page of tokens after the prefix whose last page's key is prev (b"" for the first page)."""
    return hashlib.sha256(prev + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


class PrefixCachingAllocator(BlockAllocator):
    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages, page_size)
        self._ref: dict[int, int] = {}              # page -> sequences holding it (pages in use)
        self._page_of: dict[bytes, int] = {}        # key -> cached page
        self._key_of: dict[int, bytes] = {}         # cached page -> key
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached pages nobody holds, oldest release first
        self._pending: dict[bytes, object] = {}     # key -> the running request computing that prompt page
        self.query_tokens = 0     # prompt tokens looked up at admission
        self.hit_tokens = 0       # of those, found cached (not computed again)
        self.evictions = 0        # cached pages reused for other content
        self.held = 0             # admissions held back for a pending prompt page (counted once per request)

    def reset(self) -> None:
        """Forget every page and the cache (the workers' K/V may be gone); the counters stay."""
        counts = self.query_tokens, self.hit_tokens, self.evictions, self.held
        super().reset()
        self.query_tokens, self.hit_tokens, self.evictions, self.held = counts

    def drop_cache(self) -> int:
        """Forget every cached block (pages nobody holds become free; held ones stay held, uncached). Returns the
        number of pages that were cached."""
        n = len(self._key_of)
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._page_of.clear()
        self._key_of.clear()
        return n   # (pending pages stay pending: their requests cache them when computed)

    # --- capacity --------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages holding a cached block (held by a sequence or evictable)."""
        return len(self._key_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfPages(f"asked for {n} pages, {self.num_free} free or evictable of {self.num_pages}")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:   # the least recently released cached page: forget its content
                p, _ = self._evictable.popitem(last=False)
                del self._page_of[self._key_of.pop(p)]
                self.evictions += 1
            self._ref[p] = 1
            pages.append(p)
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in reversed(pages):   # tail first: evicted before the head other prompts share
            if p not in self._ref:
                raise ValueError(f"page {p} freed twice or never allocated (engine bookkeeping bug)")
            self._ref[p] -= 1
            if self._ref[p]:
                continue
            del self._ref[p]
            self._used.discard(p)
            if p in self._key_of:
                self._evictable[p] = None
            else:
                self._free.push(p)

    # --- lookup and registration ---------------------------------------------------------------------------
    def match(self, tokens, known: list[bytes] | None = None) -> tuple[list[int], list[bytes]]:
        """The cached pages of the longest run of full pages that starts `tokens` (leaving the last token out:
        it must be computed), and their keys. known: the keys of tokens' first pages computed by an earlier call
        (extended here; a queued request's admission is retried every step)."""
        ps = self.page_size
        known = [] if known is None else known
        pages = []
        for i in range((len(tokens) - 1) // ps):
            if i == len(known):
                known.append(block_key(known[-1] if known else b"", tokens[i * ps:(i + 1) * ps]))
            p = self._page_of.get(known[i])
            if p is None:
                break
            pages.append(p)
        return pages, known[:len(pages)]

    def waits_for_pending(self, req) -> bool:
        """The request's prompt goes on, after its cached pages, with a page a running request is computing now:
        admitting it later takes that page from the cache instead of computing it again."""
        hits, _ = self.match(self._tokens(req), req.prompt_keys)
        wait = len(req.prompt_keys) > len(hits) and req.prompt_keys[len(hits)] in self._pending
        if wait and not req.was_held:
            req.was_held = True
            self.held += 1
        return wait

    def forget_pending(self, req) -> None:
        """req no longer computes its pending pages (it ended or was preempted)."""
        for k in req.pending_keys:
            if self._pending.get(k) is req:
                del self._pending[k]
        req.pending_keys = []

    @staticmethod
    def _tokens(req):
        # (a preempted request is looked up by all its tokens, prompt and output: its own computed pages may still
        # be cached)
        return req.all_token_ids if req.output_token_ids else req.prompt_token_ids

    def admit(self, req, num_pages: int, keep_free: int = 0) -> tuple[list[int], int] | None:
        tokens = self._tokens(req)
        hits, keys = self.match(tokens, req.prompt_keys)
        idle = sum(p in self._evictable for p in hits)   # evictable now, held once claimed
        if num_pages - len(hits) + keep_free > self.num_free - idle:
            return None
        for p in hits:
            if p in self._evictable:
                del self._evictable[p]
                self._ref[p] = 1
                self._used.add(p)
            else:
                self._ref[p] += 1
        pages = hits + self.allocate(num_pages - len(hits))
        req.block_keys = keys
        self._mark_pending(req, tokens, len(hits))
        cached = len(hits) * self.page_size
        if not req.num_preemptions:   # (a readmission's hits are its own pages: not a prompt's hit rate)
            self.query_tokens += len(tokens)
            self.hit_tokens += cached
        return pages, cached

    def _mark_pending(self, req, tokens, start: int) -> None:
        """Its prompt's full pages from `start` (the first uncached one) are pending until it computes them."""
        ps, known = self.page_size, req.prompt_keys
        for i in range(start, (len(tokens) - 1) // ps):
            if i == len(known):
                known.append(block_key(known[-1] if known else b"", tokens[i * ps:(i + 1) * ps]))
            k = known[i]
            if k in self._page_of or k in self._pending:
                continue
            self._pending[k] = req
            req.pending_keys.append(k)

    def commit(self, req) -> None:
        """Cache the request's pages that became full and computed since the last call."""
        ps, keys, known = self.page_size, req.block_keys, req.prompt_keys
        while len(keys) < req.num_computed // ps:
            i = len(keys)
            k = known[i] if i < len(known) else block_key(keys[-1] if keys else b"",
                                                            req.token_slice(i * ps, (i + 1) * ps))
            keys.append(k)
            if self._pending.get(k) is req:
                del self._pending[k]
            p = req.block_table[i]
            if k not in self._page_of and p not in self._key_of:   # (else another sequence cached it first: ours
                self._page_of[k] = p                               # stays private)
                self._key_of[p] = k
