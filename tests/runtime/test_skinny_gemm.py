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


@pytest.mark.skipif(sg.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
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
    if sg.triton is None:
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
        ran = 0
        for cfg in sg.CONFIGS:
            if K % (cfg[1] * cfg[2]) == 0:
                try:
                    _check(x, w, cfg, 1e-2)
                    ran += 1
                except Exception as e:   # a config whose pipeline does not fit shared memory at this BM
                    if "OutOfResources" not in type(e).__name__:
                        raise
        assert ran, (M, N, K)


def _lm_head_step(monkeypatch, on: str, dev: str, dtype: str):
    """One conventional decode step of tiny-llama with a 32768-word vocabulary (the LM head's Triton path needs
    N >= 32768): its fp32 logits and tokens, with MPK_CONV_TRITON_LMHEAD=on."""
    from tests.runtime.test_conventional_op_count import build
    monkeypatch.setenv("MPK_CONV_TRITON_LMHEAD", on)
    cfg, g, mem, ex, ctx = build("tiny-llama", 3, dtype=dtype, dev=dev, greedy=True, vocab=32768)
    ex.run([ctx])
    return mem.t("logits").float().clone(), mem.t("next_tokens").clone()


@pytest.mark.skipif(sg.triton is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs Triton's interpreter (pip install triton; TRITON_INTERPRET=1)")
def test_conventional_lm_head_through_triton_interpreter(monkeypatch):
    """The conventional LM head through skinny_mm gives torch's logits and tokens (fp32: the interpreter has no
    bf16), and it is the path taken (the switch off computes the same with cuBLAS's / CPU torch's matmul)."""
    calls = []
    real = sg.skinny_mm
    monkeypatch.setattr(sg, "skinny_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    l_on, t_on = _lm_head_step(monkeypatch, "1", "cpu", "float32")
    assert calls, "MPK_CONV_TRITON_LMHEAD=1 did not route the LM head to skinny_mm"
    l_off, t_off = _lm_head_step(monkeypatch, "0", "cpu", "float32")
    assert len(calls) == 1
    torch.testing.assert_close(l_on, l_off, rtol=1e-5, atol=1e-5)
    assert torch.equal(t_on, t_off)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_conventional_lm_head_triton_gpu(monkeypatch):
    """bf16 on a GPU: the logits within a bf16 rounding of cuBLAS's (both round the product to bf16, in different
    summation orders), and each token's logit within that rounding of the row's best."""
    l_on, t_on = _lm_head_step(monkeypatch, "1", "cuda", "bfloat16")
    l_off, t_off = _lm_head_step(monkeypatch, "0", "cuda", "bfloat16")
    scale = l_off.abs().amax(-1, keepdim=True)
    assert ((l_on - l_off).abs() <= 2 ** -7 * scale).all()
    assert (l_off.gather(1, t_on[:, None].to(torch.int64).cpu().to(l_off.device)) >=
            l_off.amax(-1, keepdim=True) - 2 ** -7 * scale).all()
