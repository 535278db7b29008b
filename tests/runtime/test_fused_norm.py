"""The conventional path's RMSNorm for torch.compile (MPK_CONV_FUSE_NORM=1 on a GPU) is the task kinds' RMSNorm:
the same ops and rounding points, so on the CPU (where both run as torch ops in the same order) bit for bit."""
import pytest
import torch

from mpk_runtime.runtime import conventional_ops
from mpk_runtime.tasks.ops.common import rms_norm


@pytest.mark.parametrize("shape,wshape", [((7, 64), (64,)), ((3, 5, 64), (64,)), ((1, 2048), (2048,)),
                                          ((4, 6, 128), None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_functional_norm_equals_the_task_norm(shape, wshape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = None if wshape is None else torch.randn(wshape, generator=g).to(dtype)
    assert torch.equal(conventional_ops._rms_norm_fn(x, w, 1e-6), rms_norm(x, w, 1e-6))


def test_fused_norm_is_gpu_only_and_checks_its_flag(monkeypatch):
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    monkeypatch.delenv("MPK_CONV_FUSE_NORM", raising=False)
    assert conventional_ops.fuse_norm()   # default on
    monkeypatch.setenv("MPK_CONV_FUSE_NORM", "0")
    assert not conventional_ops.fuse_norm()
    monkeypatch.setenv("MPK_CONV_FUSE_NORM", "1")
    assert torch.equal(conventional_ops.rms_norm(x, None, 1e-6), rms_norm(x, None, 1e-6))   # CPU: eager
    assert conventional_ops._fused_norm is None   # nothing compiled for a CPU tensor
    monkeypatch.setenv("MPK_CONV_FUSE_NORM", "yes")
    with pytest.raises(ValueError, match="MPK_CONV_FUSE_NORM"):
        conventional_ops.fuse_norm()
