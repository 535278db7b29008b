"""GPU: the megakernel matches the CPU pyvm on the same bf16 weights (skips without a CUDA GPU + nvcc)."""
import pytest
import torch

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-qwen2"])
@pytest.mark.parametrize("batch", [1, 8])
def test_megakernel_matches_pyvm(model, batch, gpu_check):
    res = []
    gpu_check.check_correct(model, batch, 8, res)
    assert res[-1]["ok"], res[-1]


@pytest.mark.parametrize("batch", [3, 8])
def test_long_input_rows_in_chunks_match_pyvm(batch, gpu_check):
    """tiny-llama-k16k's down projection (K = 16384): from batch 3 its Tensor Core tiles hold the input rows in two
    chunks (codegen/layout.py linear_tile, op_linear_tc), each chunk's products added into the fp32 result."""
    from mpk_runtime.codegen import layout as L
    assert L.linear_tile(batch, 16384, 16, 1, 1)[2] == 2
    res = []
    gpu_check.check_correct("tiny-llama-k16k", batch, 8, res)
    assert res[-1]["ok"], res[-1]


def test_megakernel_with_waits_and_signals_past_the_inlined_words(gpu_check, monkeypatch):
    """One inlined wait / signal word per record (a separate build): tasks with two waits or two signals take the
    rest from the wait / signal tables (the path TP all-reduces with many producers take), and still match pyvm."""
    from mpk_runtime.codegen import layout as L
    monkeypatch.setattr(L, "INLINE_WAITS", 1)
    monkeypatch.setattr(L, "INLINE_SIGNALS", 1)
    monkeypatch.setattr(L, "T_INLINE_SIG", L.ARG_END + 1)
    res = []
    gpu_check.check_correct("tiny-llama", 8, 8, res)
    assert res[-1]["ok"], res[-1]


@pytest.mark.parametrize("inlined", [True, False])
def test_a_wait_that_is_never_met_raises_naming_the_task(gpu_check, inlined):
    """A task whose event can never fire (its inlined wait word, or its table entry, asks for more triggers than
    the event has): the kernel's bounded spin gives up, the status block names the task and check() raises,
    within seconds, instead of hanging."""
    import re
    import time
    from mpk_runtime.codegen import layout as L
    from mpk_runtime.runtime.base import KernelTimeout
    rig = gpu_check.Rig("tiny-llama", 1, max_seq=64, cpu_ref=False)
    mk = rig.mk
    t = next(t for t in mk.tg.tasks if t.kind == "attn_partial" and t.waits)   # (no attn_merge tasks when folded)
    e, lag = t.waits[0]
    if inlined:
        mk.tasks[t.id, L.T_INLINE_WAIT] = L.pack_wait(e, (1 << 24) - 1, lag, 0)
    else:
        mk.tasks[t.id, L.T_INLINE_WAIT:L.T_INLINE_WAIT + L.INLINE_WAITS] = 0   # the kernel reads the table entry
        mk.waits[int(mk.tasks[t.id, L.TASK_HEADER.index("wait_begin")]), L.WAIT_FIELDS.index("triggers")] = 1 << 40
    mk.timeout_ns = int(0.5e9)
    mk._write_params()
    # the first SM to give up names its task: the stalled one, or one that (transitively) waits for it and began
    # spinning earlier
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


@pytest.mark.parametrize("direct", ["0", "1"])
def test_one_split_attention_with_and_without_the_direct_write(gpu_check, monkeypatch, direct):
    """One attention split per group (what every batch from ~17 sequences gets): the folded merge of one chunk, and
    with MPK_ATT_DIRECT=1 the chunk written straight as the group's output (tiling.attn_direct); both match pyvm.
    Tasks of one KV group: 8 x 2 (sequence, group) units on the GPU's SMs are too few for the auto grouping
    (Tiling.attn_g; test_grouped_attention_tasks asks for groups)."""
    monkeypatch.setenv("MPK_ATT_DIRECT", direct)
    monkeypatch.delenv("MPK_ATT_GROUPS", raising=False)
    res = []
    rig = gpu_check.check_correct("tiny-qwen3", 8, 8, res, splits=1)
    assert {t.params.get("ng", 1) for t in rig.tg.tasks if t.kind == "attn_partial"} == {1}
    assert res[-1]["ok"], res[-1]


@pytest.mark.parametrize("model,groups", [("tiny-qwen3", 2), ("tiny-llama", 2), ("tiny-llama", 1), ("tiny-qwen3", 4)])
def test_grouped_attention_tasks(gpu_check, monkeypatch, model, groups):
    """MPK_ATT_GROUPS=n (Tiling.attn_groups): one task per n KV groups of a sequence, their passes one pipeline,
    the page table and q fetched once, all but the last group merged in a region of its own (n = 1: one group per
    task, the direct write alone; 4 on a model of 2 KV heads: clamped to 2): matches pyvm."""
    monkeypatch.setenv("MPK_ATT_DIRECT", "1")
    monkeypatch.setenv("MPK_ATT_GROUPS", str(groups))
    res = []
    rig = gpu_check.check_correct(model, 8, 8, res, splits=1)
    # both tiny models have 2 KV heads: 4 asked for is clamped to the 2 that divide them
    assert {t.params.get("ng", 1) for t in rig.tg.tasks if t.kind == "attn_partial"} == {min(groups, 2)}
    assert res[-1]["ok"], res[-1]


@pytest.mark.parametrize("flat,qknorm,batch,defines", [("1", "0", 1, ""), ("0", "0", 1, ""), ("1", "1", 1, ""),
                                                      ("0", "1", 1, ""), ("0", "1", 3, "")])
def test_flat_qkv_matches_pyvm(gpu_check, monkeypatch, flat, qknorm, batch, defines):
    """MPK_QKV_FLAT (Tiling.qkv_flat, batch 1; on by default): the q / k rows as linear tiles into qk_raw across
    heads (weight pointers offset back by the q rows for the k tiles), v heads in pair parts, qk_norm_rope as
    before; and with =0 the head parts. MPK_ATTN_QKNORM=1 (a -DMPK_ATT_QKNORM=1 build): no qk_norm_rope tasks, the
    attention partials norm and rotate their own q heads and the last chunk's k row. All match pyvm on the GPU's
    SM count."""
    monkeypatch.setenv("MPK_QKV_FLAT", flat)
    monkeypatch.setenv("MPK_ATTN_QKNORM", qknorm)
    monkeypatch.setenv("MPK_NVCC_DEFINES", defines)
    res = []
    rig = gpu_check.check_correct("tiny-qwen3", batch, 8, res)
    assert any(t.kind == "linear" and t.op.endswith("qkv_rope") for t in rig.tg.tasks) == (flat == "1" and batch < 3)
    assert any(t.kind == "qk_norm_rope" for t in rig.tg.tasks) == (qknorm == "0")
    assert res[-1]["ok"], res[-1]
