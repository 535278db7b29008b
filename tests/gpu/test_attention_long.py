"""GPU: decode attention over long cached contexts (several key passes per split, sequences of different lengths)
matches the CPU pyvm on the same K/V pages (skips without a CUDA GPU + nvcc)."""
import pytest
import torch

from mpk_runtime.codegen import nvcc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(nvcc.find_nvcc() is None, reason="needs nvcc to build the kernel")]


@pytest.mark.parametrize("model,batch,ctx,splits", [("tiny-llama", 1, 700, 1), ("tiny-llama", 3, 520, 2),
                                                    ("tiny-qwen3", 2, 600, 1), ("tiny-qwen3", 1, 300, 3)])
@pytest.mark.parametrize("stages", [2, 3])
def test_long_context_attention_matches_pyvm(model, batch, ctx, splits, stages, gpu_check):
    from mpk_runtime.tasks.tiling import Tiling
    res = []
    t = Tiling(num_sms=torch.cuda.get_device_properties(0).multi_processor_count, attn_stages=stages)
    r = gpu_check.check_long_context(model, batch, ctx, splits, res, tiling=t)
    assert r["ok"], {k: v for k, v in r.items() if k != "_logits"}


def test_three_kv_buffers_compute_what_two_do(gpu_check):
    """The number of K/V pass buffers changes when copies are issued, not the arithmetic: bit-identical logits."""
    from mpk_runtime.tasks.tiling import Tiling
    n = torch.cuda.get_device_properties(0).multi_processor_count
    out = [gpu_check.check_long_context("tiny-qwen3", 2, 900, 1, [], tiling=Tiling(num_sms=n, attn_stages=s))
           for s in (2, 3)]
    assert torch.equal(out[0]["_logits"], out[1]["_logits"])
