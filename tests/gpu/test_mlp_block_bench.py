"""GPU: device_kernels/bench_mlp.cu, the micro-benchmark of a batch-1 MLP block (scripts/bench_mlp.py), computes the
block in every mode: today's two phases (gate_up tiles, a counter barrier, down tiles) and the down projection fused
into the gate_up tile (fp32 partials, vector atomics, the last ticket writes the row; or, without that finisher,
the row formed from the accumulator on the host). All within 4 units (2^-8 of the value) of torch at llama-3.2-1b's
and qwen3-8b's shapes (random weights), the accumulator left zero for the next launch, and every launch the same
output in the phases mode (its sums have one order)."""
import os
import sys

import pytest
import torch

from tests.gpu.marks import KERNEL

pytestmark = KERNEL
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))


@pytest.mark.parametrize("H,I", [(2048, 8192), (4096, 12288)])
def test_every_mode_computes_the_block(H, I):
    import bench_mlp
    cu, fn = bench_mlp.load()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    blk = bench_mlp.Block(cu, fn, H, I, sms, seed=3)
    ref = bench_mlp.reference(blk.x, blk.Wg, blk.Wu, blk.Wd, blk.h)
    outs = {}
    modes = list(bench_mlp.MODES.values())
    for mode in modes + modes:
        st = blk.launch(mode, flush=False)
        ok, err = bench_mlp.within_ulps(blk.result(mode), ref)
        assert ok, (mode, err)
        assert blk.acc.abs().max().item() == 0.0
        assert (st[:, 2] >= st[:, 1]).all() and (st[:, 1] >= 0).all()
        outs.setdefault(mode, []).append(blk.out.clone())
    assert torch.equal(outs[0][0], outs[0][1])
