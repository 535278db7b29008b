"""GPU: the megakernel matches the CPU pyvm on the same bf16 weights (skips without a CUDA GPU + nvcc)."""
import pytest
import torch

from mpk_runtime.codegen import nvcc

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(nvcc.find_nvcc() is None, reason="needs nvcc to build the kernel")]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("batch", [1, 8])
def test_megakernel_matches_pyvm(model, batch, gpu_check):
    res = []
    gpu_check.check_correct(model, batch, 8, res)
    assert res[-1]["ok"], res[-1]
