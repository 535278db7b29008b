"""GPU: long prompts through LLM.generate on the planned megakernel (session 55): prompts longer than the step budget
prefill in chunks, a chunk over many keys attends to exactly its keys (MPK_PREFILL_EXACT_KEYS, lowered here so a test
model reaches it), the batch-1 bucket is rebuilt with more attention splits as the key cap grows; every generated
token is the reference's (or a near tie). scripts/gpu_check_long.py runs the real models to 131k keys."""
import pytest

from tests.gpu.marks import KERNEL
from tests.gpu.test_engine_plans import assert_follows_reference

pytestmark = KERNEL


@pytest.mark.parametrize("exact_keys", ["1024", "0"])
def test_long_prompts_chunked_exact_keys_and_growing_splits_follow_reference(exact_keys, monkeypatch):
    import torch

    from mpk_runtime import LLM, SamplingParams
    monkeypatch.setenv("MPK_PREFILL_EXACT_KEYS", exact_keys)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (3000, 1700)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # tiny-llama-g8: llama-3.2-1b's 32 q heads over 8 KV heads (batch 1: 8 splits at 512 keys, 16 from 1024)
    llm = LLM("tiny-llama-g8", backend="megakernel", max_batch=2, max_seq_len=4096, plan="auto",
              max_num_batched_tokens=1024, enable_prefix_caching=False)
    try:
        alone = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]     # batch 1: splits grow with the cap
        together = llm.generate(prompts, sp, use_tqdm=False)                   # batch 2
        assert llm.engine.stats["prompt_chunks"] >= 2 * (3 + 2)               # 1024-token chunks
    finally:
        llm.shutdown()
    assert_follows_reference("tiny-llama-g8", prompts, alone)
    assert_follows_reference("tiny-llama-g8", prompts, together)
