"""GPU: decode attention over long cached contexts (several key passes per split, sequences of different lengths)
matches the CPU pyvm on the same K/V pages (skips without a CUDA GPU + nvcc)."""
import pytest

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("model,batch,ctx,splits", [("tiny-llama", 1, 700, 1), ("tiny-llama", 3, 520, 2),
                                                    ("tiny-qwen3", 2, 600, 1), ("tiny-qwen3", 1, 300, 3)])
def test_long_context_attention_matches_pyvm(model, batch, ctx, splits, gpu_check):
    res = []
    r = gpu_check.check_long_context(model, batch, ctx, splits, res)
    assert r["ok"], r


@pytest.mark.parametrize("model,batch,ctx", [("tiny-llama", 3, 700), ("tiny-qwen3", 2, 450)])
def test_long_context_grouped_attention_matches_pyvm(model, batch, ctx, gpu_check, monkeypatch):
    """MPK_ATT_GROUPS=2: several passes per group, the second group's first rows in flight during the first
    group's last pass and merge (sequences of different lengths)."""
    monkeypatch.setenv("MPK_ATT_DIRECT", "1")
    monkeypatch.setenv("MPK_ATT_GROUPS", "2")
    res = []
    r = gpu_check.check_long_context(model, batch, ctx, 1, res)
    assert r["ok"], r


@pytest.mark.parametrize("model,batch,ctx,splits,wide", [("tiny-qwen3-d128", 2, 600, 1, "ring"),
                                                         ("tiny-qwen3-d128", 1, 300, 3, "ring"),
                                                         ("tiny-llama", 3, 700, 1, "ring"),
                                                         ("tiny-qwen3", 2, 450, 2, "ring"),
                                                         ("tiny-qwen3-d128", 2, 600, 1, "")])
def test_long_context_half_pass_ring_matches_pyvm(model, batch, ctx, splits, wide, gpu_check, monkeypatch):
    """Wide passes through the ring of 3 half-pass buffers (MPK_ATT_WIDE=ring, tasks/tiling.attn_wide = 3) on
    128-wide heads (tiny-qwen3-d128: qwen3-8b's head dim) and on small heads; the default narrow passes of 128-wide
    heads beside them. Several passes per split, sequences of different lengths."""
    monkeypatch.setenv("MPK_ATT_WIDE", wide)
    res = []
    r = gpu_check.check_long_context(model, batch, ctx, splits, res)
    assert r["ok"], r

