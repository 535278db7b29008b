"""GPU: weight_prefetch tasks (Tiling.l2_prefetch_mb, tasks/ops/prefetch.py) change no value - logits and tokens
of a prefetching build equal those of the build without prefetch bit for bit, over several steps."""
import pytest
import torch

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("model,mb", [("tiny-qwen3", 0.05), ("llama-3.2-1b", 16.0)])
def test_prefetch_is_bitwise_neutral(model, mb, gpu_check):
    from mpk_runtime.tasks.tiling import Tiling
    gc = gpu_check
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = {}
    for budget in (0.0, mb):
        rig = gc.Rig(model, 1, cpu_ref=False, max_seq=128, tiling=Tiling(num_sms=sms, l2_prefetch_mb=budget))
        kinds = [t.kind for t in rig.tg.tasks]
        assert ("weight_prefetch" in kinds) == (budget > 0), (budget, set(kinds))
        tok, pos, steps = [3], [0], []
        for _ in range(6):
            logits, nxt = rig.mk_step(tok, pos)
            steps.append((logits, nxt))
            tok, pos = nxt.tolist(), [pos[0] + 1]
        out[budget] = steps
        del rig
        torch.cuda.empty_cache()
    for (la, ta), (lb, tb) in zip(out[0.0], out[mb]):
        assert torch.equal(ta, tb)
        assert torch.equal(la, lb)
