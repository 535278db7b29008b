"""runtime/loopback.py: the symmetric heap's interface for a TP group on one device (CPU tensors here)."""
import pytest
import torch

from mpk_runtime.runtime.loopback import LoopbackGroup


def test_collective_allocations_give_each_rank_its_copy_and_the_others_addresses():
    g = LoopbackGroup(3, "cpu")
    a0 = g.heap(0).tensor((2, 4), torch.float32)
    b0 = g.heap(0).tensor((5,), torch.int64)
    a1, a2 = g.heap(1).tensor((2, 4), torch.float32), g.heap(2).tensor([2, 4], torch.float32)
    assert len({a0.data_ptr(), a1.data_ptr(), a2.data_ptr()}) == 3
    assert not a0.any() and not b0.any()
    for r, a in enumerate((a0, a1, a2)):
        assert g.heap(r).peer_ptrs(a) == [a0.data_ptr(), a1.data_ptr(), a2.data_ptr()]
    assert g.heap(1).peer_ptr(b0, 0) == b0.data_ptr()
    # a store through rank 1's view of rank 2's copy lands in rank 2's tensor, as a peer store would
    g.heap(1).peer_tensor(a1, 2)[1, 3] = 7.0
    assert a2[1, 3] == 7.0 and a1[1, 3] == 0.0


def test_mismatched_collective_allocations_and_foreign_tensors_are_refused():
    g = LoopbackGroup(2, "cpu")
    g.heap(0).tensor((4,), torch.float32)
    with pytest.raises(ValueError, match="same shapes in the same order"):
        g.heap(1).tensor((4,), torch.int64)
    with pytest.raises(ValueError, match="not on this group's symmetric heap"):
        g.heap(0).peer_ptr(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="not in this group"):
        g.heap(2)
    with pytest.raises(ValueError, match="nranks"):
        LoopbackGroup(0, "cpu")
