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
