"""scripts/bench_mlp.py's CPU side (the kernel itself: tests/gpu/test_mlp_block_bench.py): the reference block has the
kernel's rounding points (an intermediate row rounded to bf16 before down), and the ulp check fails an output
that is off by more than four units (2^-8 of the value) anywhere while passing one that is off by one."""
from __future__ import annotations

import os
import sys

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


def test_inplace_mode_only_where_its_pieces_are_whole_vectors():
    from types import SimpleNamespace as NS
    assert "inplace" in bench_mlp.modes_for(NS(cols=64, I=8192))      # llama-3.2-1b on 132 SMs
    assert "inplace" in bench_mlp.modes_for(NS(cols=96, I=12288))     # qwen3-8b
    assert "inplace" in bench_mlp.modes_for(NS(cols=80, I=8192))      # another SM count's width
    assert "inplace" not in bench_mlp.modes_for(NS(cols=84, I=8192))  # 168-byte pieces: not 16-byte vectors
    assert "inplace" not in bench_mlp.modes_for(NS(cols=64, I=8196))  # rows not 16-byte aligned
    assert set(bench_mlp.modes_for(NS(cols=84, I=8192))) == {"phases", "fused", "nofin"}
