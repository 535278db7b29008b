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


def test_merge_stamps_follow_the_ticket_order(gpu_check, monkeypatch):
    """-DMPK_STAGE_WORDS=12 (session 35: stamp 6 is the group ticket; scripts/trace_phases.py --merge reads it): in
    a traced step every folded partial stamps its ticket after its own rows (4, where its chunk had keys) and before
    its op is done (K-2) and its signals (K-1), and every group has all its splits stamped. (Session 35 also asserted
    that the last ticket's partial has the group's longest ticket-to-done time; session 36's GPU run refuted it: a
    partial that does not merge took 1.82 us from ticket to done where the merger took 0.26 at tiny-qwen3; the
    likely cause is the task loop reading the task record between the op and the done stamp. Session 36 also found
    the ticket stamps out of the atomic's order, so trace_phases.py --merge finds the merger by the merge's own
    stamps 10-12 in K >= 16 builds.)"""
    import collections
    import re
    from mpk_runtime.tasks.tiling import Tiling
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_STAGE_WORDS=12")
    n = torch.cuda.get_device_properties(0).multi_processor_count
    rig = gpu_check.Rig("tiny-qwen3", 1, max_seq=64, cpu_ref=False, splits=4, trace_steps=1,
                        tiling=Tiling(num_sms=n, attn_fold_merge=True))
    rig.greedy_run(20, seed=3, last_launch=1)
    K = rig.mk.stage_words
    st = rig.mk.stage_stamps()[0].tolist()
    groups = collections.defaultdict(list)
    for t in rig.tg.tasks:
        if t.kind != "attn_partial" or not t.params.get("fold"):
            continue
        s = st[t.id]
        assert s[6] and s[K - 2] and s[K - 1], (t.label(), s)
        assert s[6] <= s[K - 2] <= s[K - 1] and (s[4] == 0 or s[4] <= s[6]), (t.label(), s)
        m = re.search(r"\bb=(\d+) g=(\d+) split=(\d+)", t.label())
        groups[(t.op, m.group(1), m.group(2))].append(s)
    assert groups and all(len(v) == 4 for v in groups.values())
