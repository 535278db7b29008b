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


def test_auto_sized_kv_cache_takes_what_fits_and_says_what_to_change():
    """runtime.memory.fit_num_pages (the megakernel runner's num_pages when none is given, world size 1): max_batch
    full sequences where they fit the free memory less the reserve, else as many pages as fit (the lazy allocator
    preempts), never less than one sequence: a clear error instead of a CUDA out-of-memory at allocation."""
    import pytest
    import torch
    from mpk_runtime.runtime.memory import KV_RESERVE_BYTES, KV_RESERVE_SHARE, fit_num_pages, kv_page_bytes
    pb = kv_page_bytes(16, 16, 8, 64, torch.bfloat16)          # llama-3.2-1b: 16 layers, 8 KV heads of 64
    assert pb == 2 * 16 * 16 * 8 * 64 * 2 == 524288            # 32 KiB a token
    total = 80 << 30
    reserve = KV_RESERVE_BYTES + int(KV_RESERVE_SHARE * total)
    assert fit_num_pages(8 * 32 + 1, 32, pb, 70 << 30, total) == 8 * 32 + 1          # the default sizes: as before
    want = ((70 << 30) - reserve) // pb - 1
    assert fit_num_pages(128 * 8192 + 1, 8192, pb, 70 << 30, total) == want          # 128 x 131072 tokens: what fits
    assert 8192 < want < 128 * 8192
    with pytest.raises(ValueError, match="smaller max_seq_len"):
        fit_num_pages(2 * 8192 + 1, 8192, pb, reserve + 8191 * pb, total)
    assert fit_num_pages(2 * 8192 + 1, 8192, pb, reserve + 8193 * pb, total) == 8192
