"""GPU: the folded attention merge (the partial that takes its group's last ticket merges the group; no attn_merge
tasks) gives bit-identical logits and tokens to the separate merge tasks, over steps whose early chunks are empty
(positions below the split count) and several steps per launch (tickets of consecutive steps). Session 11 ran
it (7f7d2ef) with sequences at different positions: batch 1 passed for both models; at batch 3 rows 1-2 were
NaN in both kernels (unwritten, poisoned KV), the test's fault: fixed, not yet re-run on a GPU."""
import pytest
import torch

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("batch", [1, 3])
def test_folded_merge_is_bitwise_the_separate_merge(model, batch, gpu_check):
    from mpk_runtime.tasks.tiling import Tiling
    n = torch.cuda.get_device_properties(0).multi_processor_count
    ref = gpu_check.Rig(model, batch, max_seq=64, cpu_ref=False, splits=4,
                        tiling=Tiling(num_sms=n, attn_fold_merge=False))
    fold = gpu_check.Rig(model, batch, max_seq=64, cpu_ref=False, splits=4,
                         tiling=Tiling(num_sms=n, attn_fold_merge=True), build=ref.mk.build)
    assert not any(t.kind == "attn_merge" for t in fold.tg.tasks)
    assert any(t.kind == "attn_merge" for t in ref.tg.tasks)
    for s, ((la, na), (lb, nb)) in enumerate(zip(ref.greedy_run(8, seed=9), fold.greedy_run(8, seed=9))):
        assert torch.equal(na, nb), (s, na, nb)
        assert torch.equal(la, lb), (s, (la - lb).abs().max().item())


@pytest.mark.parametrize("model,splits", [("tiny-llama", 4), ("tiny-qwen3", 8), ("tiny-qwen3-d128", 8),
                                          ("tiny-llama", 16)])
@pytest.mark.parametrize("batch", [1, 3])
def test_one_round_trip_merge_and_reduce_are_bitwise_the_default(model, splits, batch, gpu_check, monkeypatch):
    """-DMPK_ATT_MERGE1=1 -DMPK_ARGMAX_RED1=1 (session 34, opt-in): the folded merge issues all of a thread's lse and
    part loads at once (S <= 8, at most two outputs a thread: tiny-qwen3-d128's 4 heads x 128 take two), and the
    greedy argmax reduce loads its slots' entries together; the logits and the greedy tokens are bitwise the
    default build's. 16 splits take the default merge loop in both builds."""
    monkeypatch.delenv("MPK_NVCC_DEFINES", raising=False)
    ref = gpu_check.Rig(model, batch, max_seq=64, cpu_ref=False, splits=splits)
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_MERGE1=1 -DMPK_ARGMAX_RED1=1")
    one = gpu_check.Rig(model, batch, max_seq=64, cpu_ref=False, splits=splits)
    assert {"-DMPK_ATT_MERGE1=1", "-DMPK_ARGMAX_RED1=1"} <= set(one.mk.build.flags)
    assert "-DMPK_ATT_MERGE1=1" not in ref.mk.build.flags
    assert any(t.kind == "attn_partial" and t.params.get("fold") for t in one.tg.tasks)
    for s, ((la, na), (lb, nb)) in enumerate(zip(ref.greedy_run(8, seed=9), one.greedy_run(8, seed=9))):
        assert torch.equal(na, nb), (s, na, nb)
        assert torch.equal(la, lb), (s, (la - lb).abs().max().item())
