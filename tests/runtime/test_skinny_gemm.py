"""runtime/skinny_gemm.py (the Triton weight-streaming matmul of session 26's experiment) against the fp32 product.
On a CPU it runs under the Triton interpreter where Triton is installed (`pip install triton`; the CPU torch of CI
does not bring it, so there these tests skip); the interpreter has no bf16, so fp16 and fp32 stand in for it. On a
GPU (tests marked gpu) the compiled kernel runs in bf16 at decode shapes."""
from __future__ import annotations

import os

import pytest
import torch

from mpk_runtime.runtime import skinny_gemm as sg

SHAPES = [(1, 48, 512), (3, 40, 1024), (32, 64, 512), (128, 33, 512)]


def _check(x, w, cfg, tol):
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    sg.skinny_mm(x, w, y, cfg)
    ref = x.float() @ w.float().T
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, (tuple(x.shape), tuple(w.shape), cfg, err)


@pytest.mark.skipif(not sg.available() or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton's interpreter (pip install triton; TRITON_INTERPRET=1)")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_skinny_mm_interpreter(dtype, tol):
    g = torch.Generator().manual_seed(0)
    for M, N, K in SHAPES:
        x, w = torch.randn(M, K, generator=g).to(dtype), torch.randn(N, K, generator=g).to(dtype)
        for cfg in sg.CONFIGS:
            if K % (cfg[1] * cfg[2]) == 0:
                _check(x, w, cfg, tol)


def test_skinny_mm_refuses_bad_input():
    x, w = torch.zeros(4, 64), torch.zeros(8, 64)
    if not sg.available():
        with pytest.raises(RuntimeError, match="Triton"):
            sg.skinny_mm(x, w, torch.zeros(4, 8))
        return
    with pytest.raises(ValueError, match="expected x"):
        sg.skinny_mm(x, w, torch.zeros(4, 9))
    with pytest.raises(ValueError, match="multiple"):
        sg.skinny_mm(x, w, torch.zeros(4, 8), (16, 256, 1, 4, 4))
    with pytest.raises(ValueError, match="rows"):
        sg.skinny_mm(torch.zeros(129, 256), torch.zeros(8, 256), torch.zeros(129, 8), (16, 256, 1, 4, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_skinny_mm_gpu_bf16():
    g = torch.Generator(device="cuda").manual_seed(0)
    for M, N, K in SHAPES + [(8, 3072, 2048), (32, 2048, 8192), (128, 4096, 12288)]:
        x = torch.randn(M, K, generator=g, device="cuda").bfloat16()
        w = (torch.randn(N, K, generator=g, device="cuda") * 0.02).bfloat16()
        for cfg in sg.CONFIGS:
            if K % (cfg[1] * cfg[2]) == 0:
                _check(x, w, cfg, 1e-2)
