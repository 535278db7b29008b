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
