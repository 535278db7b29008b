"""Prefix caching (engine/prefix_cache.py): the allocator's bookkeeping on its own, then requests through LLM on the
paged CPU backends against the reference model's greedy loop (an independent oracle that caches nothing) and against
the same engine with caching off."""
import random

import pytest

from mpk_runtime.engine import LLM, SamplingParams
from mpk_runtime.engine.errors import InvalidRequestError
from mpk_runtime.engine.prefix_cache import PrefixCachingAllocator, block_key
from mpk_runtime.engine.request import Request

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
SYSTEM = list(range(3, 43))   # 40 tokens: two full pages of 16, and 8 more


def _req(tokens, seq=0):
    return Request(request_id=str(seq), seq_id=seq, prompt=None, prompt_token_ids=list(tokens),
                   params=GREEDY, max_total_len=len(tokens) + 8)


def _computed(a, r, n):
    r.num_computed = n
    a.commit(r)


def _admit(a, r, n):
    """As the scheduler admits: the request's pages and its computed (cached) prefix."""
    got = a.admit(r, n)
    if got is not None:
        r.block_table, r.num_computed = got
    return got


# --- the allocator -------------------------------------------------------------------------------------------
def test_admit_takes_the_cached_pages_of_a_prefix_and_leaves_the_last_token():
    a = PrefixCachingAllocator(num_pages=10, page_size=4)
    r1 = _req(range(10))                      # pages: [0..3] [4..7] [8, 9]
    pages1, cached = _admit(a, r1, 3)
    assert cached == 0 and a.num_cached == 0
    _computed(a, r1, 9)                       # two full pages computed
    assert a.num_cached == 2
    r2 = _req(list(range(8)) + [50, 51])
    pages2, cached = _admit(a, r2, 3)
    assert cached == 8 and pages2[:2] == pages1[:2] and pages2[2] not in pages1
    assert r2.block_keys == [block_key(b"", [0, 1, 2, 3]), block_key(block_key(b"", [0, 1, 2, 3]), [4, 5, 6, 7])]
    # a prompt that is exactly the cached pages: its last page is computed again (its last token's logits)
    r3 = _req(range(8))
    assert _admit(a, r3, 2)[1] == 4
    # a different first page: nothing, even with the same second page
    assert _admit(a, _req([9, 1, 2, 3, 4, 5, 6, 7, 1]), 3)[1] == 0
    assert (a.query_tokens, a.hit_tokens) == (10 + 10 + 8 + 9, 12)


def test_pages_are_shared_by_reference_and_evicted_least_recently_released_first():
    a = PrefixCachingAllocator(num_pages=6, page_size=2)
    r1 = _req([1, 2, 3, 4, 5])
    p1, _ = _admit(a, r1, 3)
    _computed(a, r1, 4)                        # pages p1[0] ([1, 2]) and p1[1] ([3, 4]) cached
    r2 = _req([1, 2, 3, 4, 9])
    p2, cached = _admit(a, r2, 3)
    assert cached == 4 and a.num_free == 6 - 4
    a.free(p1)                                 # r2 still holds the shared pages: only r1's tail is free
    assert a.num_free == 6 - 3 and a.num_cached == 2
    a.free(p2)
    assert a.num_free == 6 and a.num_cached == 2
    # the cached pages are evictable, not free: with the other 4 pages taken, the next 2 evict, the tail first
    held = a.allocate(4)
    assert set(held).isdisjoint(p1[:2])
    first = a.allocate(1)
    assert first == [p1[1]] and a.evictions == 1 and a.num_cached == 1
    r3 = _req([1, 2, 7])                       # the head page is still found
    assert _admit(a, r3, 1) == ([p1[0]], 2)
    assert a.num_free == 0 and _admit(a, _req([5, 6, 7]), 1) is None


def test_admission_counts_its_own_evictable_hits_as_taken():
    """A request whose hits are evictable must not be admitted on the strength of those same pages being free."""
    a = PrefixCachingAllocator(num_pages=4, page_size=2)
    r1 = _req([1, 2, 3, 4, 5])
    p1, _ = _admit(a, r1, 3)
    _computed(a, r1, 4)
    a.free(p1)                                    # 4 free or evictable, 2 of them the cached prefix
    assert _admit(a, _req([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), 5) is None   # 2 hits + 3 new > 4 pages
    pages, cached = _admit(a, _req([1, 2, 3, 4, 5, 6, 7, 8]), 4)         # 2 hits + 2 new
    assert cached == 4 and sorted(pages) == [0, 1, 2, 3] and a.num_free == 0


def test_the_same_block_computed_twice_is_cached_once():
    a = PrefixCachingAllocator(num_pages=8, page_size=2)
    r1, r2 = _req([1, 2, 3], 1), _req([1, 2, 3], 2)
    p1, _ = _admit(a, r1, 2)
    p2, cached = _admit(a, r2, 2)               # admitted before r1 computed anything: no hit
    assert cached == 0
    _computed(a, r1, 2)
    _computed(a, r2, 2)                       # the same key: r2's page stays private
    assert a.num_cached == 1
    a.free(p1)
    a.free(p2)
    assert a.num_free == 8 and a.num_cached == 1 and _admit(a, _req([1, 2, 5]), 1) == ([p1[0]], 2)


def test_reset_forgets_the_cache_and_keeps_the_counters():
    a = PrefixCachingAllocator(num_pages=4, page_size=2)
    r = _req([1, 2, 3])
    _admit(a, r, 2)
    _computed(a, r, 2)
    assert _admit(a, _req([1, 2, 4]), 1)[1] == 2
    a.reset()
    assert a.num_cached == 0 and a.num_free == 4 and a.hit_tokens == 2
    assert _admit(a, _req([1, 2, 4]), 2)[1] == 0


# --- through the engine -----------------------------------------------------------------------------------------
def _llm(backend="torch", model="tiny-llama", **kw):
    return LLM(model, backend=backend, dtype="float32", **{"max_seq_len": 128, "max_batch": 4, **kw})


@pytest.mark.parametrize("backend,model,plan", [("torch", "tiny-llama", None), ("pyvm", "tiny-qwen3", None),
                                                ("pyvm", "tiny-llama", "auto")])
def test_shared_system_prompt_is_computed_once(backend, model, plan, ref_greedy):
    prompts = [SYSTEM + [50 + i, 60 + i, 70 + i] for i in range(4)]
    with _llm(backend, model, enable_prefix_caching=True, **({"plan": plan} if plan else {})) as llm:
        first = llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        computed = llm.engine.stats["prompt_tokens"]
        rest = llm.generate(prompts[1:], GREEDY, use_tqdm=False)
        st = llm.engine.stats
        assert [o.num_cached_tokens for o in first + rest] == [0, 32, 32, 32]   # two full pages of the 40
        assert st["prompt_tokens"] - computed == 3 * (len(prompts[0]) - 32)
        assert st["prefix_cache_hit_tokens"] == 96 and st["prefix_cache_query_tokens"] == 4 * len(prompts[0])
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages   # cached pages are reusable
    for p, o in zip(prompts, first + rest):
        assert o.token_ids == ref_greedy(model, p, 10)


def test_a_chat_turn_reuses_the_pages_of_the_turns_before(ref_greedy):
    """The next turn's prompt is the last prompt + its answer + a new message: the answer's pages are cached too."""
    turn = SYSTEM[:21]
    with _llm(enable_prefix_caching=True, decode_steps=4) as llm:
        for n in range(3):
            out = llm.generate([turn], GREEDY, use_tqdm=False)[0]
            assert out.token_ids == ref_greedy("tiny-llama", turn, 10)
            if n:   # the last turn's prompt and answer minus its last token were computed: their full pages
                assert out.num_cached_tokens == (computed // 16) * 16 > prev_len - 16
            computed, prev_len = len(turn) + 10 - 1, len(turn)
            turn = turn + out.token_ids + [90 + n, 91 + n]


def test_outputs_equal_caching_off_under_page_pressure_and_sampling(ref_greedy):
    """Small cache (evictions), prefixes shared by some prompts and not others, requests arriving while others
    run, seeded sampling (graph top-k, full-vocabulary top_p) and bursts: every output the same with caching
    on and off, greedy ones the reference's."""
    rng = random.Random(0)
    heads = [list(range(10 + 20 * h, 30 + 20 * h)) for h in range(3)]   # 20 tokens: one page and 4 more at 16
    prompts = [rng.choice(heads) + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 6))] for _ in range(14)]
    params = [GREEDY if i % 3 == 0 else
              SamplingParams(temperature=0.9, top_k=20, max_tokens=10, seed=i, ignore_eos=True) if i % 3 == 1 else
              SamplingParams(temperature=1.1, top_p=0.8, max_tokens=10, seed=i, ignore_eos=True)
              for i in range(len(prompts))]
    outs = {}
    for caching in (False, True):
        with _llm(enable_prefix_caching=caching, num_pages=9, max_batch=3, decode_steps=3) as llm:
            e, got = llm.engine, {}
            for i, (p, sp) in enumerate(zip(prompts, params)):   # arrivals interleaved with steps
                e.add_request(p, sp, request_id=str(i))
                for o in e.step():
                    if o.finished:
                        got[o.request_id] = o
            while e.has_unfinished():
                for o in e.step():
                    if o.finished:
                        got[o.request_id] = o
            outs[caching] = [got[str(i)] for i in range(len(prompts))]
            if caching:
                assert e.stats["prefix_cache_hit_tokens"] > 0 and e.stats["prefix_cache_evictions"] > 0
            assert e.allocator.num_free == e.allocator.num_pages
    assert [o.token_ids for o in outs[True]] == [o.token_ids for o in outs[False]]
    assert sum(o.num_cached_tokens for o in outs[True]) > 0 == sum(o.num_cached_tokens for o in outs[False])
    for i in range(0, len(prompts), 3):
        assert outs[True][i].token_ids == ref_greedy("tiny-llama", prompts[i], 10)


def test_tensor_parallel_ranks_share_the_cached_pages(ref_greedy):
    prompts = [SYSTEM + [7], SYSTEM + [8, 9]]
    with _llm("torch", "tiny-qwen3", tp=2, enable_prefix_caching=True) as llm:
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 32]
    for p, o in zip(prompts, outs):
        assert o.token_ids == ref_greedy("tiny-qwen3", p, 10)


def test_a_worker_failure_empties_the_cache(ref_greedy):
    with _llm(enable_prefix_caching=True) as llm:
        llm.generate([SYSTEM + [1]], GREEDY, use_tqdm=False)
        llm.executor.collective_rpc("inject_fault", ("raise",))
        llm.engine.add_request(SYSTEM + [2], GREEDY, request_id="x")
        outs = llm.engine.step()
        assert outs and outs[0].finish_reason == "error"
        assert llm.engine.allocator.num_cached == 0
        out = llm.generate([SYSTEM + [3]], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.token_ids == ref_greedy("tiny-llama", SYSTEM + [3], 10)


def test_prefix_caching_needs_a_paged_backend():
    with pytest.raises(InvalidRequestError, match="keeps a cache per sequence"):
        LLM("tiny-llama", backend="reference", dtype="float32", enable_prefix_caching=True)
    with pytest.raises(InvalidRequestError, match="True, False or None"):
        LLM("tiny-llama", backend="torch", dtype="float32", enable_prefix_caching="yes")


def test_a_queued_request_hashes_its_prompt_once(monkeypatch):
    """Admission is retried every step while the head of the queue waits for pages: its prompt's page keys are kept
    on the request, not recomputed."""
    from mpk_runtime.engine import prefix_cache as pc
    a = PrefixCachingAllocator(num_pages=7, page_size=2)
    r1 = _req([1, 2, 3, 4, 5, 6, 7])
    _admit(a, r1, 4)
    _computed(a, r1, 6)                                   # three pages cached, held by r1
    calls = []
    real = pc.block_key
    monkeypatch.setattr(pc, "block_key", lambda prev, toks: calls.append(1) or real(prev, toks))
    r2 = _req([1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 9, 9])
    for _ in range(5):
        assert _admit(a, r2, 7) is None                   # 3 hits + 4 new > 3 free
    assert len(calls) == 4                                # 3 hits + the first miss, once
    a.free(r1.block_table)
    # admitted: its other full pages are hashed now (pending: other requests with this prompt wait for them), once
    assert _admit(a, r2, 7)[1] == 6 and len(calls) == 6
    _computed(a, r2, 13)
    assert len(calls) == 6 and len(r2.block_keys) == 6    # committing them reuses the keys


def test_reset_prefix_cache(ref_greedy):
    """LLM.reset_prefix_cache: the cache is forgotten (a cold run after a warm one), pages held by nobody are free
    again, and caching goes on afterwards."""
    a = PrefixCachingAllocator(num_pages=6, page_size=2)
    r = _req([1, 2, 3, 4, 5])
    p, _ = _admit(a, r, 3)
    _computed(a, r, 4)
    a.free(p)
    assert a.drop_cache() == 2 and a.num_cached == 0 and a.num_free == 6
    assert _admit(a, _req([1, 2, 3, 4, 9]), 3)[1] == 0
    with _llm(enable_prefix_caching=True) as llm:
        llm.generate([SYSTEM + [1]], GREEDY, use_tqdm=False)
        assert llm.reset_prefix_cache() == 3   # the system prompt's two pages and the answer's third
        cold = llm.generate([SYSTEM + [2]], GREEDY, use_tqdm=False)[0]
        warm = llm.generate([SYSTEM + [3]], GREEDY, use_tqdm=False)[0]
    assert (cold.num_cached_tokens, warm.num_cached_tokens) == (0, 32)
    assert warm.token_ids == ref_greedy("tiny-llama", SYSTEM + [3], 10)
    with _llm() as llm:
        assert llm.reset_prefix_cache() == 0


@pytest.mark.parametrize("backend", ["torch", "pyvm"])
def test_identical_prompts_together_compute_the_prompt_once(backend):
    """Eight copies of one prompt (n = 8 samples, or one system prompt arriving in a burst) queued at once: the first
    computes the prompt, the others are held back while its pages are pending and then take them from the cache,
    computing only their last partial page; the samples equal those of an engine without the cache."""
    prompt = list(range(3, 43))                               # 40 tokens: 9 full pages of 4 before the last token
    sps = [SamplingParams(temperature=0.9, seed=s, max_tokens=6, ignore_eos=True) for s in range(8)]
    got = {}
    for caching in (False, True):
        with LLM("tiny-llama", backend=backend, dtype="float32", max_seq_len=64, max_batch=8, page_size=4,
                 enable_prefix_caching=caching) as llm:
            outs = llm.generate([prompt] * 8, sps, use_tqdm=False)
            got[caching] = [o.token_ids for o in outs], dict(llm.engine.stats), [o.num_cached_tokens for o in outs]
            if caching:
                assert llm.engine.allocator.held == 7 and llm.engine.stats["prefix_cache_held"] == 7
    (toks0, st0, _), (toks1, st1, cached) = got[False], got[True]
    assert toks1 == toks0
    assert st0["prompt_tokens"] == 8 * 40
    assert cached == [0] + [36] * 7 and st1["prompt_tokens"] == 40 + 7 * 4


def test_held_requests_go_on_when_the_computing_one_is_aborted():
    prompt = list(range(3, 43))
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=4, page_size=4,
             max_num_batched_tokens=8, enable_prefix_caching=True) as llm:
        e = llm.engine
        sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        first = e.add_request(prompt, sp)
        others = [e.add_request(prompt, sp) for _ in range(3)]
        e.step()                                  # first computes 8 of its 40 tokens; the others are held
        assert [r.request_id for r in e.scheduler.running] == [first] and len(e.scheduler.waiting) == 3
        e.abort(first)                            # its pending pages are forgotten: one of the others computes them
        done = {}
        while e.has_unfinished():
            for o in e.step():
                if o.finished:
                    done[o.request_id] = o
        assert sorted(done) == sorted(others)
        assert len({tuple(o.token_ids) for o in done.values()}) == 1
        # the aborted one had computed and cached two pages; the next computes the rest, the last two wait for it
        assert sorted(o.num_cached_tokens for o in done.values()) == [8, 36, 36]


def test_reset_keeps_the_counters():
    a = PrefixCachingAllocator(8, 4)
    a.query_tokens, a.hit_tokens, a.evictions, a.held = 9, 5, 2, 3
    a.reset()
    assert (a.query_tokens, a.hit_tokens, a.evictions, a.held) == (9, 5, 2, 3)


def test_prefix_caching_is_on_by_default_where_the_backend_can():
    for backend, on in (("torch", True), ("pyvm", True), ("reference", False)):
        with LLM("tiny-llama", backend=backend, dtype="float32", max_seq_len=32) as llm:
            assert llm.engine.prefix_caching is on
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=32, enable_prefix_caching=False) as llm:
        assert not llm.engine.prefix_caching


def test_the_command_lines_turn_the_defaults_off():
    import argparse
    from mpk_runtime.engine.cli_flags import add_engine_flags, engine_kwargs
    ap = argparse.ArgumentParser()
    add_engine_flags(ap)
    kw = engine_kwargs(ap.parse_args([]))
    assert kw["enable_prefix_caching"] is None and kw["async_bursts"] is None and kw["kv_allocation"] == "lazy"
    kw = engine_kwargs(ap.parse_args(["--no-enable-prefix-caching", "--no-async-bursts", "--kv-allocation", "reserve"]))
    assert kw["enable_prefix_caching"] is False and kw["async_bursts"] is False and kw["kv_allocation"] == "reserve"
