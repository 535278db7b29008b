"""A weight-streaming matmul for decode's skinny shapes, y = x @ W.T (x (M, K) with M = batch rows <= 128, W (N, K)
row-major as the checkpoints store it, fp32 accumulate, y in out's dtype), written in Triton.

Each program owns BN output columns and streams their W rows once over K (or over one of SK K-slices, whose fp32
partials are then added in slice order), with the x rows re-read from L2. Measured against cuBLAS by
scripts/bench_skinny_gemm.py (1x H200, session 26): within -3..+4% of cuBLAS on a layer's matmuls at B=8/32 and
slower at B=128, but on the LM head (N = the vocabulary) at B <= 32 it streams at 88-96% of 4.55 TB/s against
cuBLAS's 80-83% (qwen3-8b B=8 341 -> 285 us). So the conventional path may use it there only
(`lm_head_config`, opt-in MPK_CONV_TRITON_LMHEAD=1 until its A/B). Triton ships with CUDA builds of torch; the
CPU test runs the same kernel under the Triton interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch

from ..envflags import env_flag

from .triton_support import runs_on, tl, triton

# (BN columns a program, BK k per step, SK k-slices, pipeline stages, warps)
CONFIGS = [(16, 256, 1, 4, 4), (32, 256, 1, 4, 4), (64, 128, 1, 4, 4), (32, 128, 1, 6, 4),
           (16, 256, 2, 4, 4), (16, 128, 4, 5, 4)]


LM_HEAD_CFG = (64, 128, 1, 4, 4)   # the best measured config at every LM head shape (bench/results/s26)


def lm_head_config(x: torch.Tensor, N: int):
    """The config for a vocabulary-sized matmul (x (M, K) @ W.T, N columns) the conventional path may hand to
    skinny_mm, else None (cuBLAS): opt-in (MPK_CONV_TRITON_LMHEAD=1), a tensor Triton runs on, <= 32 rows (slower
    than cuBLAS at 128), N >= 32768 columns, K a multiple of 128, x contiguous (W's rows are)."""
    if not env_flag("MPK_CONV_TRITON_LMHEAD") or not runs_on(x):
        return None
    M, K = x.shape
    if M > 32 or N < 32768 or K % LM_HEAD_CFG[1] or not x.is_contiguous():
        return None
    return LM_HEAD_CFG


if triton is not None:
    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, ks_len, stride_xm, stride_wn, stride_ym, stride_ys,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NK: tl.constexpr,
                       ROUND: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)                 # k-slice: columns [pid_s * ks_len, (pid_s + 1) * ks_len)
        rn = pid_n * BN + tl.arange(0, BN)
        rm = tl.arange(0, BM)
        rk = tl.arange(0, BK)
        k0 = pid_s * ks_len
        x_ptrs = x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :]
        w_ptrs = w_ptr + rn[None, :] * stride_wn + (k0 + rk)[:, None]
        mmask = rm[:, None] < M
        nmask = rn[None, :] < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for _ in range(0, NK):                   # NK = ks_len // BK steps of BK (a constant: one build per K)
            xk = tl.load(x_ptrs, mask=mmask, other=0.0)
            wk = tl.load(w_ptrs, mask=nmask, other=0.0)
            acc = tl.dot(xk, wk, acc)
            x_ptrs += BK
            w_ptrs += BK
        y_ptrs = y_ptr + pid_s * stride_ys + rm[:, None] * stride_ym + rn[None, :]
        if ROUND:   # the product in x's dtype first, then out's (what `(x @ W.T).to(out.dtype)` computes)
            acc = acc.to(x_ptr.dtype.element_ty)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mmask & nmask)


def block_m(M: int) -> int:
    """Rows a program holds: the batch rounded up to a power of two, at least 16 (tl.dot's smallest)."""
    if not 1 <= M <= 128:
        raise ValueError(f"skinny_mm: {M} rows; it serves decode batches of 1 to 128 rows")
    return max(16, 1 << (M - 1).bit_length())


def skinny_mm(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg=CONFIGS[0],
              round_to_x: bool = False) -> torch.Tensor:
    """out (M, N) = x (M, K) @ w (N, K).T, fp32 accumulate; with SK > 1 the K-slices' fp32 partials are added in
    slice order (deterministic). x, w contiguous; K a multiple of SK * BK. round_to_x (SK = 1): the product is
    rounded to x's dtype before out's (an fp32 out then holds what a matmul in x's dtype gives, cast)."""
    if triton is None:
        raise RuntimeError("skinny_mm needs Triton (it comes with CUDA builds of torch; CPU tests use the "
                           "interpreter: pip install triton, TRITON_INTERPRET=1)")
    BN, BK, SK, stages, warps = cfg
    M, K = x.shape
    N, K2 = w.shape
    if K2 != K or tuple(out.shape) != (M, N):
        raise ValueError(f"skinny_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}: "
                         f"expected x (M, K), w (N, K), out (M, N)")
    if K % (SK * BK):
        raise ValueError(f"skinny_mm: K={K} is not a multiple of SK * BK = {SK * BK}")
    if round_to_x and SK != 1:
        raise ValueError("skinny_mm: round_to_x needs SK = 1")
    if not (x.is_contiguous() and w.is_contiguous()):
        raise ValueError("skinny_mm: x and w must be contiguous (row-major)")
    BM = block_m(M)
    grid = (triton.cdiv(N, BN), SK)
    if SK == 1:
        dst, s_stride = out, 0
    else:
        dst = torch.empty(SK, M, N, dtype=torch.float32, device=x.device)
        s_stride = dst.stride(0)
    _skinny_kernel[grid](x, w, dst, M, N, K // SK, x.stride(0), w.stride(0), dst.stride(-2), s_stride,
                         BM=BM, BN=BN, BK=BK, NK=K // SK // BK, ROUND=round_to_x, num_stages=stages, num_warps=warps)
    if SK > 1:
        acc = dst[0]
        for s in range(1, SK):   # slice order, as the megakernel's k-slices
            acc = acc + dst[s]
        out.copy_(acc)
    return out
