"""GPU: the planner's plans in the megakernel runner. Every plan family of a tiny model, prefilled through the
conventional path and decoded through PlannedDecoder (CUDA-graph replays, a key-cap re-capture), stays within
bf16 tolerance of the pure-torch reference, teacher-forced (scripts/gpu_check_plans.py forced()); and
LLM(backend="megakernel", plan="auto") generates through its plans (skips without a CUDA GPU + nvcc)."""
import pytest

from tests.gpu.marks import KERNEL

pytestmark = KERNEL


def _script():
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location("gpu_check_plans",
                                                  pathlib.Path(__file__).parents[2] / "scripts/gpu_check_plans.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


@pytest.mark.parametrize("family", ["mono", "mega2", "attn-conv", "attn-mk", "conventional"])
def test_plan_families_match_reference(family):
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    book = plan_book(load_config("tiny-qwen3"), 1, (2, 4), context=256, families=(family,))
    r = _script().forced("tiny-qwen3", book, 3, 250, 10)
    assert r["plan"] == family and r["captures"] == 2 and r["ok"], r


def test_llm_plan_auto_generates_through_plans():
    from mpk_runtime import LLM, SamplingParams
    llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, plan="auto")
    try:
        outs = llm.generate([[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]],
                            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [6] * 4
        assert llm.executor.collective_rpc("health")[0]["plans_used"]
    finally:
        llm.shutdown()


def test_greedy_and_sampled_steps_replay_their_own_graphs():
    """A conventional plan keeps one decode graph per sampling variant (StepCtx.greedy: all-greedy steps skip the
    sampler's ~250 kernels): greedy rows draw the same tokens whether a sampled row shares their batch (sampled
    graph) or not (greedy graph), a seeded sampled row draws the same tokens twice, and both variants were
    captured for the bucket. (Added in session 13; first GPU run pending.)"""
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    book = plan_book(load_config("tiny-llama"), 1, (4,), context=128, families=("conventional",))
    llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, plan=book)
    try:
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
        g = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        s = SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
        greedy = [o.token_ids for o in llm.generate(prompts, g, use_tqdm=False)]
        mixed = [o.token_ids for o in llm.generate(prompts, [g, g, g, s], use_tqdm=False)]
        again = [o.token_ids for o in llm.generate(prompts, [g, g, g, s], use_tqdm=False)]
        assert mixed[:3] == greedy[:3] and again == mixed
        planned = llm.executor.workers[0].runner.planned
        keys = [k for bk in planned._buckets.values() for k in (bk.ex._captures or {})]
        assert {k[0][-1] for k in keys} == {True, False}, keys    # the greedy flag is the key's last field
    finally:
        llm.shutdown()


def test_one_megakernel_plan_serves_greedy_and_sampled_steps_from_one_capture():
    """A one-megakernel plan samples on device either way: a greedy step and a sampled one replay the same capture
    (session 14: the second variant's warm-up used to replay the first one's graph and failed)."""
    from mpk_runtime import LLM, SamplingParams
    from mpk_runtime.models.config import load_config
    from mpk_runtime.planner import plan_book
    book = plan_book(load_config("tiny-llama"), 1, (4,), context=128, families=("mono",))
    llm = LLM("tiny-llama", backend="megakernel", max_batch=4, max_seq_len=128, plan=book)
    try:
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
        g = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        s = SamplingParams(max_tokens=6, temperature=0.9, top_k=20, seed=7, ignore_eos=True)
        greedy = [o.token_ids for o in llm.generate(prompts, g, use_tqdm=False)]
        mixed = [o.token_ids for o in llm.generate(prompts, [g, g, g, s], use_tqdm=False)]
        assert mixed[:3] == greedy[:3]
        planned = llm.executor.workers[0].runner.planned
        assert [bk.captures for bk in planned._buckets.values()] == [1]
    finally:
        llm.shutdown()
