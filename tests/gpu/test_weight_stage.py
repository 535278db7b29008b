"""GPU: weight staging (rows copied into shared memory by TMA while a task waits, read from there by the batch-1
linear / qkv_rope tiles) gives bit-identical logits and tokens to the same kernel streaming every row from global
memory, with all rows staged and with an even prefix only (mixed global / shared passes in one tile), and with the
automatic choice (the tiles that wait on attention, within the graph's own shared memory). Off by default
(docs/perf-notes.md v22: neutral to slower); this keeps the path correct for experiments."""
import pytest
import torch

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_staged_weights_are_bitwise_neutral(model, batch, gpu_check, monkeypatch):
    monkeypatch.setenv("MPK_STAGE_OPS", ".")   # every CUDA-core tile (one- and two-weight passes, qkv_rope parts)
    ref = gpu_check.Rig(model, batch, max_seq=64, cpu_ref=False, stage_smem=0)
    assert ref.mk.staged_bytes == 0
    base = ref.greedy_run(6, seed=5)
    full = gpu_check.Rig(model, batch, max_seq=64, cpu_ref=False, stage_smem=224 * 1024, build=ref.mk.build)
    # a budget that leaves the widest staged tile only part of its rows
    info = full.mk.stage_info
    tid = max(info, key=lambda t: info[t][3])
    need, off, rows, nbytes = info[tid]
    part_budget = off + nbytes // 2
    part = gpu_check.Rig(model, batch, max_seq=64, cpu_ref=False, stage_smem=part_budget, build=ref.mk.build)
    assert full.mk.staged_bytes > part.mk.staged_bytes > 0
    monkeypatch.delenv("MPK_STAGE_OPS")
    from mpk_runtime.codegen import layout as L
    dflt = gpu_check.Rig(model, batch, max_seq=64, cpu_ref=False, stage_smem=L.STAGE_AUTO, build=ref.mk.build)
    assert dflt.mk.staged_bytes > 0 and dflt.mk.smem == ref.mk.smem
    for rig in (full, part, dflt):
        got = rig.greedy_run(6, seed=5)
        for s, ((lb, nb), (lg, ng)) in enumerate(zip(base, got)):
            assert torch.equal(nb, ng), (s, nb, ng)
            assert torch.equal(lb, lg), (s, (lb - lg).abs().max().item())

