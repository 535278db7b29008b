"""The paged KV cache's layout: (page, slot, head, D), one contiguous tensor per layer and K / V. MPK_KV_LAYOUT (a
head-major alternative, measured no gain in sessions 19/20) was removed: set, it is an error where the layout was
read (every KVStore), not silently ignored; `nhd`, the old name of the only layout, is accepted."""
import pytest
import torch

from mpk_runtime.planner.simulate import kv_piece_bytes
from mpk_runtime.runtime.memory import KVStore


def test_pages_are_token_major():
    kv = KVStore(2, 5, 4, 3, 8, torch.float32, poison=False)
    assert len(kv.k) == len(kv.v) == 2 and kv.scratch == 5
    for t in kv.k + kv.v:
        assert t.shape == (6, 4, 3, 8) and t.is_contiguous()


@pytest.mark.parametrize("value", ["hnd", "x"])
def test_removed_layout_switch_raises(monkeypatch, value):
    monkeypatch.setenv("MPK_KV_LAYOUT", value)
    with pytest.raises(ValueError, match=f"MPK_KV_LAYOUT='{value}': this option was removed .*sessions 19/20"):
        KVStore(1, 2, 4, 1, 8, torch.float32)
    for ok in (" ", "nhd"):   # empty, or the layout there is
        monkeypatch.setenv("MPK_KV_LAYOUT", ok)
        KVStore(1, 2, 4, 1, 8, torch.float32)
    assert kv_piece_bytes(64) == 128
