"""GPU: MPK_B1_PREWAIT (a -DMPK_B1_PREWAIT=1 build, gpu_pending.sh ab variants pw4 / pw7): the batch-1 CUDA-core
linear / qkv_rope tiles issue their first weight round before their waits and poll those waits inside the op. The
sums are the default kernel's, so logits and tokens must be bit-identical to the default build's; the tiles must
match pyvm; and a wait that is never met inside such an op must still end the launch with the task named."""
import re

import pytest
import torch

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


def _defines(un):
    return f"-DMPK_B1_PREWAIT=1 -DMPK_B1_PREWAIT_UN={un}"


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("un", [4, 7])
def test_prewait_builds_are_bitwise_the_default(model, un, gpu_check, monkeypatch):
    monkeypatch.setenv("MPK_NVCC_DEFINES", "")
    ref = gpu_check.Rig(model, 1, max_seq=64, cpu_ref=False)
    base = ref.greedy_run(6, seed=5)
    monkeypatch.setenv("MPK_NVCC_DEFINES", _defines(un))
    pw = gpu_check.Rig(model, 1, max_seq=64, cpu_ref=False)
    assert "-DMPK_B1_PREWAIT=1" in pw.mk.build.flags and pw.mk.build.cubin != ref.mk.build.cubin
    got = pw.greedy_run(6, seed=5)
    for s, ((lb, nb), (lg, ng)) in enumerate(zip(base, got)):
        assert torch.equal(nb, ng), (s, nb, ng)
        assert torch.equal(lb, lg), (s, (lb - lg).abs().max().item())


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_prewait_build_matches_pyvm(model, gpu_check, monkeypatch):
    monkeypatch.setenv("MPK_NVCC_DEFINES", _defines(4))
    res = []
    gpu_check.check_correct(model, 1, 8, res)
    assert res[-1]["ok"], res[-1]


def test_a_never_met_wait_polled_inside_a_prewait_op_names_the_task(gpu_check, monkeypatch):
    """The o_proj tiles' waits (on attention) are polled inside the op in this build: one made unmeetable must give
    up within the timeout and name a stalled task (it, or one that transitively waits for it)."""
    import time
    from mpk_runtime.codegen import layout as L
    from mpk_runtime.runtime.base import KernelTimeout
    monkeypatch.setenv("MPK_NVCC_DEFINES", _defines(4))
    rig = gpu_check.Rig("tiny-llama", 1, max_seq=64, cpu_ref=False)
    mk = rig.mk
    t = next(t for t in mk.tg.tasks if t.kind == "linear" and t.op.endswith("o_proj") and t.waits)
    rec = mk.tasks[t.id]
    # a prewait task (linear.cuh prewait_task): CUDA-core, one row, one K segment, nothing staged
    assert (rec[L.arg_index("linear", "tc_rows")], rec[L.arg_index("linear", "m")], rec[L.arg_index("linear", "kseg")],
            rec[L.TASK_HEADER.index("stage")]) == (0, 1, 1, 0)
    e, lag = t.waits[0]
    mk.tasks[t.id, L.T_INLINE_WAIT] = L.pack_wait(e, (1 << 24) - 1, lag, 0)
    mk.timeout_ns = int(0.5e9)
    mk._write_params()
    stuck, grew = {t.id}, True
    while grew:
        evs = {ev.id for ev in mk.tg.events if any(tid in stuck for _r, tid in ev.producers)}
        more = {u.id for u in mk.tg.tasks if any(e in evs and lg == 0 for e, lg in u.waits)}
        grew = not more <= stuck
        stuck |= more
    t0 = time.time()
    with pytest.raises(KernelTimeout, match=r"timed out after .* step 1: rank0/task(\d+)\[") as ei:
        rig.mk_step(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert time.time() - t0 < 10
    named = int(re.search(r"rank0/task(\d+)\[", str(ei.value)).group(1))
    assert named in stuck and len(stuck) < len(mk.tg.tasks), (named, len(stuck))
    # the kernel exited cleanly: the next launch (a fresh rig, same build) runs
    ok = gpu_check.Rig("tiny-llama", 1, max_seq=64, cpu_ref=False)
    assert len(ok.greedy_run(2, seed=1)) == 2
