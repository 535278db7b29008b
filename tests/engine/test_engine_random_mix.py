"""Random mixes of the engine's options against an independent answer: random batches of requests (shared prefixes,
random lengths and max_tokens) through a random engine configuration (max_batch, page size, a KV cache from just
one request's pages up, decode bursts, prefix caching) on the CPU. Greedy requests must give the reference
backend's tokens for the request run alone (float32 on the CPU is batch-invariant in practice); seeded sampled
requests (temperature, top-k, top-p, a stop token) the tokens of the same engine configuration with one request
at a time. Preemption, prefix-cache hits and bursts then happen in combinations no hand-written test lists."""
from __future__ import annotations

import random

import pytest

from mpk_runtime import LLM, SamplingParams

MAX_SEQ = 96


def _engine_kwargs(rng: random.Random) -> dict:
    ps = rng.choice([4, 8, 16])
    return dict(dtype="float32", max_seq_len=MAX_SEQ, page_size=ps,
                num_pages=-(-MAX_SEQ // ps) + rng.choice([0, 1, 4, 16, 64]),   # from one full request's pages up
                decode_steps=rng.choice([1, 2, 4]), enable_prefix_caching=rng.choice([True, False]))


# seeds 0-5, then seeds whose mix preempts with prefix-cache hits and bursts of 2 / 4 (7, 13, 15, 19: 1-8
# preemptions, 40-132 cached prompt tokens) and preempts with bursts and no cache (12)
GREEDY_SEEDS = [0, 1, 2, 3, 4, 5, 7, 12, 13, 15, 19]


@pytest.mark.parametrize("seed", GREEDY_SEEDS)
def test_random_greedy_mix_matches_the_reference_alone(seed):
    rng = random.Random(seed)
    kw = _engine_kwargs(rng)
    eng = LLM("tiny-llama", backend="torch", max_batch=rng.choice([2, 3, 4, 8]), **kw)
    ref = LLM("tiny-llama", backend="reference", dtype="float32", max_seq_len=MAX_SEQ, max_batch=1)
    base = [rng.randrange(512) for _ in range(40)]
    prompts = [(base[:rng.randint(0, 30)] + [rng.randrange(512) for _ in range(rng.randint(1, 40))])[:60]
               for _ in range(rng.randint(4, 12))]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True) for _ in prompts]
    outs = eng.generate(prompts, params)
    if seed in (7, 13, 15, 19):   # the mix this seed was picked for still happens
        assert eng.engine.stats["preemptions"] > 0 and eng.engine.stats["prefix_cache_hit_tokens"] > 0
    for p, sp, o in zip(prompts, params, outs):
        assert o.token_ids == ref.generate([p], sp)[0].token_ids, (kw, len(p), sp.max_tokens)
        assert len(o.token_ids) == sp.max_tokens and o.finish_reason == "length"


@pytest.mark.parametrize("seed", range(4))
def test_random_sampled_mix_does_not_depend_on_the_batch(seed):
    rng = random.Random(100 + seed)
    kw = _engine_kwargs(rng)
    eng = LLM("tiny-qwen3", backend="torch", max_batch=rng.choice([2, 4, 8]), **kw)
    alone = LLM("tiny-qwen3", backend="torch", max_batch=1, **kw)
    prompts, params = [], []
    for _ in range(rng.randint(3, 10)):
        prompts.append([rng.randrange(512) for _ in range(rng.randint(1, 40))])
        params.append(SamplingParams(temperature=rng.choice([0, 0.5, 1.0, 1.5]), top_k=rng.choice([0, 1, 5, 50]),
                                     top_p=rng.choice([1.0, 0.9, 0.5]), seed=rng.randrange(10 ** 6),
                                     max_tokens=rng.randint(1, 30), ignore_eos=True,
                                     stop_token_ids=rng.choice([None, [rng.randrange(512)]])))
    outs = eng.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        assert o.token_ids == alone.generate([p], sp)[0].token_ids, (kw, sp)
