"""GPU: per-warp weight page rings (runtime/wring.py, build -DMPK_WRING=<KB>) give bit-identical logits and tokens
to the same build streaming every row from global memory (ring=False), over one-step launches and a multi-step launch
(the rings wrap across steps), with pages that end inside rows (small slots), tiles smaller than a page and segments
of many pages (each warp's next descriptor prefetched), and with the real shapes' slots and the rings inside
attention's shared memory (their copies gated on the attention tasks, session 31). Experimental, off by default;
docs/perf-notes.md sessions 28-31."""
import pytest
import torch

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("model,defines,ops,quiet", [
    ("tiny-llama", "-DMPK_WRING=16 -DMPK_RING_SLOT=96", "", ""),     # 96-byte slots: pages end inside rows
    ("tiny-qwen3", "-DMPK_WRING=56 -DMPK_RING_SLOT=1792", "", ""),
    ("tiny-qwen3", "-DMPK_WRING=56 -DMPK_RING_SLOT=1792", "o_proj,down,qkv_rope", ""),   # some ops' tiles (MPK_RING_OPS)
    # the real shapes with the rings inside attention's shared memory, so their pages wait for attention (gates):
    # gpu_pending.sh wring's g128s and g112 (llama) and g112s (qwen3-8b)
    ("llama-3.2-1b", "-DMPK_WRING=128", "o_proj,down,qkv_rope", ""),
    ("llama-3.2-1b", "-DMPK_WRING=112 -DMPK_RING_SLOT=3584", "", ""),
    ("qwen3-8b", "-DMPK_WRING=112 -DMPK_RING_SLOT=3584", "o_proj,down,qkv_rope", ""),
    ("llama-3.2-1b", "-DMPK_WRING=128", "down,qkv_rope", "1"),   # g128q: nothing in flight during attention
])
def test_ring_tiles_are_bitwise_the_global_memory_path(model, defines, ops, quiet, gpu_check, monkeypatch):
    monkeypatch.setenv("MPK_NVCC_DEFINES", defines)
    monkeypatch.setenv("MPK_RING_OPS", ops)
    monkeypatch.setenv("MPK_RING_QUIET", quiet)
    plain = gpu_check.Rig(model, 1, max_seq=64, cpu_ref=False, ring=False)
    assert not plain.mk.ring_tasks
    ring = gpu_check.Rig(model, 1, max_seq=64, cpu_ref=False, build=plain.mk.build)
    assert ring.mk.ring_tasks and ring.mk.smem >= plain.mk.smem
    assert ring.mk.ring_clobbers   # attention (at least) overlaps the rings: their copies wait for it
    base = plain.greedy_run(5, seed=3)
    got = ring.greedy_run(5, seed=3)
    for s, ((lb, nb), (lg, ng)) in enumerate(zip(base, got)):
        assert torch.equal(nb, ng), (s, nb, ng)
        assert torch.equal(lb, lg), (s, (lb - lg).abs().max().item())
