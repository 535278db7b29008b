"""GPU: prefix caching (engine/prefix_cache.py) through the megakernel runner. Requests sharing a system prompt take
its cached pages (the conventional prefill then runs a chunk that starts past them, reading them through the page
table) and their greedy tokens follow the pure-torch reference, teacher-forced, within bf16 tolerance; with and
without a plan, in bursts of decode steps (skips without a CUDA GPU + nvcc)."""
import pytest

from tests.gpu.marks import KERNEL
from tests.gpu.test_engine_plans import assert_follows_reference

pytestmark = KERNEL


@pytest.mark.parametrize("plan", [None, "auto"])
def test_shared_system_prompt_through_the_megakernel(plan):
    from mpk_runtime import LLM, SamplingParams
    system = list(range(5, 75))   # 70 tokens: four full pages of 16
    prompts = [system + [100 + i, 120 + i] for i in range(6)]
    llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, enable_prefix_caching=True,
              plan=plan)
    try:
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(prompts[:1], sp, use_tqdm=False) + llm.generate(prompts[1:], sp, use_tqdm=False)
        assert [o.num_cached_tokens for o in outs] == [0] + [64] * 5
        assert llm.engine.stats["multi_steps"] > 0
    finally:
        llm.shutdown()
    assert_follows_reference("tiny-llama", prompts, outs)
