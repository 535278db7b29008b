"""GPU: lazy KV pages (engine/scheduler.py) through the megakernel runner with a cache too small for the batch.
Requests are preempted (their pages taken back) and computed again by the conventional prefill over prompt + output,
and every request's greedy tokens follow the pure-torch reference, teacher-forced, within bf16 tolerance; with and
without a plan, in bursts of decode steps (skips without a CUDA GPU + nvcc)."""
import pytest

from tests.gpu.marks import KERNEL
from tests.gpu.test_engine_plans import assert_follows_reference

pytestmark = KERNEL


@pytest.mark.parametrize("plan", [None, "auto"])
def test_preemption_through_the_megakernel(plan):
    from mpk_runtime import LLM, SamplingParams
    prompts = [[5 + 3 * i + j for j in range(10 + 4 * i)] for i in range(6)]
    # 12 pages of 16 tokens: six requests of up to 30 + 40 tokens need ~3-4 pages each at their end
    llm = LLM("tiny-llama", backend="megakernel", max_batch=6, max_seq_len=128, num_pages=12,
              plan=plan)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
        st = llm.engine.stats
        assert st["preemptions"] > 0 and st["recomputed_tokens"] > 0 and st["multi_steps"] > 0
        assert all(len(o.token_ids) == 40 for o in outs)
        assert llm.engine.allocator.num_free == 12
    finally:
        llm.shutdown()
    assert_follows_reference("tiny-llama", prompts, outs)


def test_kv_cache_sized_to_the_free_memory(monkeypatch):
    """No num_pages: the runner takes the pages that fit the GPU's free memory less the reserve (runtime.memory.
    fit_num_pages; the free memory reported small here: 12 pages), the engine preempts within them and the tokens follow
    the reference; with room for less than one sequence the runner refuses with an error naming max_seq_len."""
    import torch
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.models import load_config
    from mpk_runtime.runtime.memory import KV_RESERVE_BYTES, KV_RESERVE_SHARE, kv_page_bytes
    cfg = load_config("tiny-llama")
    pb = kv_page_bytes(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    total = torch.cuda.mem_get_info()[1]
    reserve = KV_RESERVE_BYTES + int(KV_RESERVE_SHARE * total)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (reserve + 13 * pb, total))   # 12 pages + scratch
    prompts = [[5 + 3 * i + j for j in range(10 + 4 * i)] for i in range(6)]
    llm = LLM("tiny-llama", backend="megakernel", max_batch=6, max_seq_len=128)
    try:
        assert llm.engine.kv_spec.num_pages == 12
        outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert llm.engine.stats["preemptions"] > 0 and all(len(o.token_ids) == 40 for o in outs)
    finally:
        llm.shutdown()
    assert_follows_reference("tiny-llama", prompts, outs)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (reserve + 4 * pb, total))
    with pytest.raises(Exception, match="smaller max_seq_len"):
        LLM("tiny-llama", backend="megakernel", max_batch=6, max_seq_len=128)
