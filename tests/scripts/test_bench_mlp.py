"""scripts/bench_mlp.py's CPU side (the kernel itself: tests/gpu/test_mlp_block_bench.py): the reference block has the
kernel's rounding points (an intermediate row rounded to bf16 before down), the ulp check fails an output that is
off by more than four units (2^-8 of the value) anywhere while passing one that is off by one, the nofin mode's row
is formed on the host with the finisher's rounding and leaves the accumulator zero, and mode 3 (inplace, removed with
MPK_MLP_FUSE in session 38) is refused before a launch."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))

import bench_mlp  # noqa: E402


def _block(H=64, I=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    r = lambda *s: torch.randn(*s, generator=g)   # noqa: E731
    return r(H).to(bf), (r(I, H) * 0.1).to(bf), (r(I, H) * 0.1).to(bf), (r(H, I) * 0.1).to(bf), r(H).to(bf)


def test_reference_rounds_where_the_kernel_does():
    x, Wg, Wu, Wd, h = _block()
    out = bench_mlp.reference(x, Wg, Wu, Wd, h)
    assert out.dtype == torch.bfloat16 and out.shape == h.shape
    gate, up = (x.float() @ Wg.float().T).to(torch.bfloat16), (x.float() @ Wu.float().T).to(torch.bfloat16)
    inter = (torch.nn.functional.silu(gate.float()).to(torch.bfloat16).float() * up.float()).to(torch.bfloat16)
    assert torch.equal(out, (h.float() + (inter.float() @ Wd.float().T).to(torch.bfloat16).float()).to(torch.bfloat16))
    # the unrounded intermediate gives a different block somewhere (the check is not vacuous)
    loose = (h.float() + (torch.nn.functional.silu(gate.float()) * up.float()) @ Wd.float().T).to(torch.bfloat16)
    assert not torch.equal(out, loose)


def test_within_ulps_passes_one_unit_and_fails_five():
    x, Wg, Wu, Wd, h = _block(seed=1)
    ref = bench_mlp.reference(x, Wg, Wu, Wd, h)
    assert bench_mlp.within_ulps(ref, ref) == (True, 0.0)
    i = int(ref.float().abs().argmax())
    one, three = ref.clone().float(), ref.clone().float()
    one[i] += ref.float()[i].abs() * 2.0 ** -8
    three[i] += ref.float()[i].abs() * 5 * 2.0 ** -8
    ok, err = bench_mlp.within_ulps(one.to(torch.bfloat16), ref)
    assert ok and 0.5 < err <= 2.0
    ok, err = bench_mlp.within_ulps(three, ref)
    assert not ok and err > 4.0


def test_nofin_row_is_formed_on_the_host_as_the_finisher_would():
    blk = object.__new__(bench_mlp.Block)   # (no GPU: only the host side's tensors)
    g = torch.Generator().manual_seed(2)
    blk.h = torch.randn(64, generator=g).to(torch.bfloat16)
    blk.acc = torch.randn(64, generator=g) * 3
    blk.out = torch.zeros(64, dtype=torch.bfloat16)
    acc = blk.acc.clone()
    for mode in (bench_mlp.MODES["phases"], bench_mlp.MODES["fused"]):   # the kernel wrote out
        assert blk.result(mode) is blk.out and torch.equal(blk.acc, acc)
    row = blk.result(bench_mlp.MODES["nofin"])
    assert torch.equal(row, (blk.h.float() + acc.to(torch.bfloat16).float()).to(torch.bfloat16))
    assert not torch.equal(row, (blk.h.float() + acc).to(torch.bfloat16))   # acc is rounded first, as the finisher
    assert blk.acc.abs().max().item() == 0.0   # zeroed for the next launch


def test_the_kernels_modes_and_inplace_refused():
    assert bench_mlp.MODES == {"phases": 0, "fused": 1, "nofin": 2}
    with pytest.raises(ValueError, match="mode 3.*inplace.*MPK_MLP_FUSE in session 38"):
        bench_mlp.Block.launch(object.__new__(bench_mlp.Block), 3)
