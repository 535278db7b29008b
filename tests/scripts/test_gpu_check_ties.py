"""CPU test of the near-tie rule the GPU correctness checks share (scripts/gpu_check.py): a greedy token that differs
from the reference's passes only when the reference ranks it within 2 bf16 ulps of its own top logit."""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_check  # noqa: E402


def test_tie_margins_measure_the_reference_gap_in_bf16_ulps():
    lr = torch.tensor([[0.50, 0.50, 0.10],      # exact tie: either token is a greedy answer
                       [1.00, 0.9921875, 0.0],  # 1.0 - 2^-7 = 1 ulp below (bf16 ulp at 1.0 is 2^-7)
                       [2.00, 1.00, 0.0],       # a clearly worse token: 64 ulps at 2.0
                       [0.25, 0.0, 0.1]])       # equal tokens: not reported
    nr = torch.tensor([0, 0, 0, 0])
    nm = torch.tensor([1, 1, 1, 0])
    m = gpu_check.tie_margins_ulps(lr, nr, nm)
    assert m == [0.0, 1.0, 64.0]
    assert gpu_check.tie_margins_ulps(lr, nr, nr) == []
    assert gpu_check.bf16_ulp(torch.tensor([1.0, 1.5, 0.25, -3.0])).tolist() == [2 ** -7, 2 ** -7, 2 ** -9, 2 ** -6]
