"""tasks/ops/common.rms_norm (written for few kernels: in-place eps/rsqrt, `out=` rounding) is bit for bit the
textbook formula the pyvm / megakernel contract was defined with: w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)."""
import pytest
import torch

from mpk_runtime.tasks.ops.common import rms_norm


def _textbook(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) if w is None else w * xf.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,wshape", [((1, 64), (64,)), ((8, 256), (256,)), ((3, 5, 32), (32,)),
                                          ((4, 6, 16), (6, 16)), ((2, 48), None)])
def test_rms_norm_bitwise_equals_textbook_formula(dtype, shape, wshape):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = None if wshape is None else (torch.randn(wshape, generator=g) * 0.5 + 1).to(dtype)
    got, want = rms_norm(x, w, 1e-6), _textbook(x, w, 1e-6)
    assert got.dtype == want.dtype and torch.equal(got, want)
    if w is not None:   # a weight of another dtype takes the broadcasting product (no in-place)
        w32 = w.float()
        assert torch.equal(rms_norm(x, w32, 1e-6), _textbook(x, w32, 1e-6))
