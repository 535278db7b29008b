"""GPU: LLM(async_bursts=True) through the megakernel runner, one megakernel and planned: the bursts resumed from the
device (decode_steps(resume=True): next_tokens saved before a key-cap re-capture) draw exactly the tokens of
synchronous bursts, greedy and seeded, rows stopping at different steps (skips without a CUDA GPU + nvcc)."""
import pytest

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


@pytest.mark.parametrize("plan", [None, "auto"])
def test_async_bursts_equal_synchronous_ones(plan):
    from mpk_runtime import LLM, SamplingParams
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=27, temperature=0.8, top_k=20, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=300, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True),   # past a key cap
              SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)]
    got = {}
    for a in (False, True):
        llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=512, decode_steps=8, async_bursts=a,
                  plan=plan)
        try:
            got[a] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert (llm.engine.stats["async_bursts"] > 0) == a
        finally:
            llm.shutdown()
    assert got[True] == got[False]


@pytest.mark.parametrize("plan", [None, "auto"])
def test_a_resumed_burst_queues_without_synchronising(plan):
    """The pipeline's premise: a burst resumed from the last one (queued before the engine reads that one) is
    launched without any host synchronisation (torch's sync debug mode raises on a pageable copy, an .item(), a
    stream or device synchronisation), so the device runs the two back to back; and the pipelined tokens are the
    synchronous bursts'. (Positions stay under the first key cap, 256: no re-capture, which synchronises.)"""
    import torch

    from mpk_runtime import LLM, SamplingParams
    prompts = [[1, 2, 3], [4, 5]]
    params = [SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=120, temperature=1.0, top_p=0.9, seed=4, ignore_eos=True)]   # full draw
    got = {}
    for a in (False, True):
        llm = LLM("tiny-llama", backend="megakernel", max_batch=2, max_seq_len=512, decode_steps=8, async_bursts=a,
                  plan=plan)
        try:
            runner = llm.executor.workers[0].runner
            launch, resumed = runner.launch_steps, []

            def checked(chunks, num_steps, resume=False):
                if not resume:
                    return launch(chunks, num_steps, resume)
                torch.cuda.set_sync_debug_mode("error")
                try:
                    p = launch(chunks, num_steps, resume)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                resumed.append(p)
                return p
            runner.launch_steps = checked
            got[a] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert (len(resumed) > 5) == a, len(resumed)
        finally:
            llm.shutdown()
    assert got[True] == got[False]
