"""Triton, where it is installed (CUDA builds of torch bring it; CI's CPU torch does not), and whether a Triton
kernel can run on a tensor: a CUDA one, or a CPU one under the interpreter (TRITON_INTERPRET=1, the CPU tests)."""
from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:   # pragma: no cover - where Triton is absent (CI's CPU torch)
    triton, tl = None, None


def runs_on(t: torch.Tensor) -> bool:
    return triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
