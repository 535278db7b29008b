"""A KV cache larger than the device is refused up front with what to change, not left to the allocator (a raw
`DefaultCPUAllocator: can't allocate memory` error, or the process killed while the pages are filled)."""
import pytest
import torch

from mpk_runtime import LLM
from mpk_runtime.engine.errors import InvalidRequestError
from mpk_runtime.runtime import memory
from mpk_runtime.runtime.memory import KVCacheTooLarge, KVStore


def test_kvstore_past_host_memory_is_refused_before_allocating():
    with pytest.raises(KVCacheTooLarge, match=r"max_batch or max_seq_len") as e:
        KVStore(2, 10 ** 9, 16, 2, 64, torch.bfloat16)
    assert "GiB" in str(e.value) and isinstance(e.value, ValueError)


def test_an_allocation_failure_is_reported_the_same_way(monkeypatch):
    """Below physical memory the allocator may still fail (others hold it): the same error, the cause kept."""
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: None)

    def fail(*a, **k):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes")
    monkeypatch.setattr(torch, "full", fail)
    with pytest.raises(KVCacheTooLarge, match="could not be allocated") as e:
        KVStore(2, 8, 16, 2, 64, torch.bfloat16)
    assert isinstance(e.value.__cause__, RuntimeError)


@pytest.mark.parametrize("backend", ["pyvm", "torch"])
def test_llm_with_a_max_batch_past_memory_says_so(backend):
    with pytest.raises(InvalidRequestError, match=r"KV cache .* max_batch"):
        LLM("tiny-llama", backend=backend, max_batch=10 ** 7)
