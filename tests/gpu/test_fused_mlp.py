"""GPU: MPK_MLP_FUSE=1 (tasks/ops/mlp.py, device_kernels/ops/mlp.cuh, a -DMPK_MLP=1 build): the down projection inside
the gate_up tiles at batch 1-2. The megakernel's steps match pyvm (the same fused graph, run on the CPU) within the
usual bf16 tolerance, token flips only at near-ties, single- and multi-step launches agreeing within rounding, and
every accumulator left zero. Not bitwise: the tiles' fp32 partials are added in the hardware's order (so
gpu_check's own `ok`, which asks a k-step launch to equal k single steps bit for bit, is not the criterion here)."""
import pytest
import torch

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("model,batch", [("tiny-llama", 1), ("tiny-qwen3", 2), ("tiny-llama-g8", 1)])
def test_fused_mlp_matches_pyvm(gpu_check, monkeypatch, model, batch):
    monkeypatch.setenv("MPK_MLP_FUSE", "1")
    res = []
    rig = gpu_check.check_correct(model, batch, 8, res)
    assert any(t.kind == "mlp" for t in rig.tg.tasks) and "-DMPK_MLP=1" in rig.mk.build.flags
    r = res[-1]
    assert r["worst_rel_logit_err"] < 2e-2, r
    assert all(t <= 2.0 for t in r["mismatch_margins_ulps"] + r["chain_mismatch_margins_ulps"]), r
    assert r["multi_chain_rel"] < 2e-2, r
    for name, spec in rig.mem.graph.tensors.items():
        if spec.attrs.get("accum"):
            assert rig.mem.t(name).abs().max().item() == 0.0, name
