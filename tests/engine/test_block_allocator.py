"""The KV page allocator: lowest free id first (the tables are deterministic), and memory that follows the pages in
use, not the cache's size."""
import random
import tracemalloc

import pytest

from mpk_runtime.engine.block_allocator import BlockAllocator, FreePages, OutOfPages
from mpk_runtime.engine.prefix_cache import PrefixCachingAllocator


def test_free_pages_hand_out_the_lowest_free_id_as_a_sorted_list_would():
    rng = random.Random(0)
    n = 257
    fp, ref = FreePages(n), list(range(n))     # ref: the free ids, sorted
    held = []
    for _ in range(5000):
        if ref and (not held or rng.random() < 0.55):
            p = fp.pop()
            assert p == ref.pop(0)
            held.append(p)
        else:
            p = held.pop(rng.randrange(len(held)))
            fp.push(p)
            ref.append(p)
            ref.sort()
        assert len(fp) == len(ref)
    while ref:
        assert fp.pop() == ref.pop(0)
    with pytest.raises(IndexError):
        fp.pop()


def test_a_huge_cache_costs_no_memory_up_front():
    """max_batch=10**7 made the host engine build a list of 640M page ids (killed for memory before any step)."""
    tracemalloc.start()
    try:
        a = BlockAllocator(10 ** 7, 16)
        size, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert size < 1 << 20
    assert a.num_free == 10 ** 7
    assert a.allocate(3) == [0, 1, 2]
    a.free([1])
    assert a.allocate(2) == [1, 3]
    assert a.num_free == 10 ** 7 - 4


@pytest.mark.parametrize("cls", [BlockAllocator, PrefixCachingAllocator])
def test_allocate_free_and_running_out(cls):
    a = cls(6, 4)
    x = a.allocate(4)
    assert x == [0, 1, 2, 3]
    with pytest.raises(OutOfPages):
        a.allocate(3)
    a.free([2, 0])
    assert a.num_free == 4
    assert a.allocate(3) == [0, 2, 4]
    with pytest.raises(ValueError, match="freed twice"):
        a.free([5])
    a.reset()
    assert a.num_free == 6 and a.allocate(1) == [0]
