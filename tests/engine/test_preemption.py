"""kv_allocation="lazy" (engine/scheduler.py): pages taken as tokens need them, the request admitted last preempted
when they run out and computed again on readmission. The scheduler's bookkeeping step by step, then the engine under
page pressure: every output must equal the one "reserve" (whole length at admission, never preempted) gives, on every
sampling path (greedy, seeded graph / full-vocabulary draws on the device, host sampling with logprobs and
penalties), with bursts, asynchronous bursts, prefix caching, streaming and aborts."""
import pytest

from mpk_runtime.engine import LLM, InvalidRequestError, SamplingParams
from mpk_runtime.engine.block_allocator import BlockAllocator
from mpk_runtime.engine.prefix_cache import PrefixCachingAllocator
from mpk_runtime.engine.request import Request, Status
from mpk_runtime.engine.scheduler import Scheduler
from mpk_runtime.runtime.base import SeqChunk
from mpk_runtime.runtime.worker import check_pages


# --- the scheduler alone ------------------------------------------------------------------------------------

def _req(i: int, n_prompt: int, max_tokens: int = 20) -> Request:
    return Request(request_id=str(i), seq_id=i, prompt=None, prompt_token_ids=[100 * i + j for j in range(n_prompt)],
                   params=SamplingParams(max_tokens=max_tokens), max_total_len=n_prompt + max_tokens)


def _run(sched: Scheduler) -> list[tuple[str, int]]:
    """One engine step without a model: every chunk computed, a token appended where the chunk was the last."""
    out = sched.schedule()
    for s in out:
        r = s.request
        r.num_computed += s.num_tokens
        if r.num_computed == r.num_tokens:
            r.output_token_ids.append(7)
    return [(s.request.request_id, s.num_tokens) for s in out]


def test_lazy_pages_follow_the_tokens():
    a = BlockAllocator(8, 4)
    sched = Scheduler(a, max_batch=4, max_num_batched_tokens=64)
    r = _req(0, 3)
    sched.add(r)
    assert _run(sched) == [("0", 3)] and len(r.block_table) == 1     # the prompt's positions 0-2
    for _ in range(12):
        assert _run(sched) == [("0", 1)]
        # positions 0 .. num_computed - 1 written: the table covers them, one page at a time
        assert len(r.block_table) == -(-r.num_computed // 4)
    assert a.num_free == 8 - len(r.block_table) and sched.num_preemptions == 0


def test_reserve_takes_the_whole_length_at_admission():
    a = BlockAllocator(16, 4)
    sched = Scheduler(a, max_batch=4, max_num_batched_tokens=64, kv_allocation="reserve")
    r = _req(0, 3, max_tokens=10)
    sched.add(r)
    _run(sched)
    assert len(r.block_table) == 3 and sched.watermark == 0   # ceil((3 + 10 - 1) / 4)
    with pytest.raises(ValueError, match="kv_allocation"):
        Scheduler(a, 4, 64, kv_allocation="eager")


def test_the_newest_request_is_preempted_and_queued_first():
    a = BlockAllocator(4, 4)     # watermark 1 page
    sched = Scheduler(a, max_batch=4, max_num_batched_tokens=64)
    reqs = [_req(i, 4) for i in range(4)]
    for r in reqs:
        sched.add(r)
    # admission: r0 takes 1 page (nothing runs: no watermark), r1 and r2 leave 1 free each, r3 would not
    assert _run(sched) == [("0", 4), ("1", 4), ("2", 4)] and a.num_free == 1
    # every one now writes position 4 (a second page): r0 takes the free page, r1 preempts r2 (the newest)
    assert _run(sched) == [("0", 1), ("1", 1)]
    r2 = reqs[2]
    assert sched.num_preemptions == 1 and sched.preempted == [r2]
    assert r2.status is Status.WAITING and r2.block_table == [] and r2.num_computed == 0 and r2.num_preemptions == 1
    assert r2.output_token_ids == [7]                         # its output stays: computed again on readmission
    assert list(sched.waiting) == [r2, reqs[3]] and a.num_free == 0
    # the next steps fit in the held pages; nothing is admitted while nothing is free
    assert _run(sched) == [("0", 1), ("1", 1)] and list(sched.waiting) == [r2, reqs[3]]


def test_victims_of_one_step_queue_oldest_first_and_a_request_can_preempt_itself():
    a = BlockAllocator(5, 2)     # watermark 1
    sched = Scheduler(a, max_batch=8, max_num_batched_tokens=64)
    reqs = [_req(i, 1) for i in range(5)]
    for r in reqs:
        sched.add(r)
    assert _run(sched) == [(str(i), 1) for i in range(4)] and a.num_free == 1   # r4 would leave none free
    assert _run(sched) == [(str(i), 1) for i in range(4)]   # position 1: still the first page
    # position 2: r0 takes the free page, r1 preempts r3, and r2, now the newest, preempts itself
    assert _run(sched) == [("0", 1), ("1", 1)]
    assert sched.preempted == [reqs[3], reqs[2]] and sched.num_preemptions == 2
    assert list(sched.waiting) == [reqs[2], reqs[3], reqs[4]]
    assert sched.running == reqs[:2] and a.num_free == 1   # (r2's own page, given back)


def test_a_step_that_preempted_admits_nobody_and_admission_keeps_a_watermark():
    a = BlockAllocator(200, 4)   # watermark 2
    sched = Scheduler(a, max_batch=8, max_num_batched_tokens=4096)
    assert sched.watermark == 2
    first = _req(0, 4 * 150)     # 150 pages
    sched.add(first)
    _run(sched)
    nxt = _req(1, 4 * 49)        # 49 pages: would leave 1 free, under the watermark
    sched.add(nxt)
    _run(sched)
    assert nxt.status is Status.WAITING
    last = _req(2, 4 * 48)       # (FIFO: nxt stays first even though this one would fit)
    sched.add(last)
    _run(sched)
    assert list(sched.waiting) == [nxt, last]


def test_grow_burst_fits_the_free_pages_without_preempting():
    a = BlockAllocator(6, 4)
    sched = Scheduler(a, max_batch=4, max_num_batched_tokens=64)
    r0, r1 = _req(0, 4), _req(1, 4)
    for r in (r0, r1):
        sched.add(r)
    _run(sched)
    assert a.num_free == 4
    # rows at position 4: k steps write positions 4 .. 3 + k; k = 8 needs 2 more pages each (to 12), k = 9 three
    assert sched.grow_burst([r0, r1], [4, 4], 9) == 8
    assert len(r0.block_table) == len(r1.block_table) == 3 and a.num_free == 0
    assert sched.grow_burst([r0, r1], [12, 12], 8) == 0 and sched.num_preemptions == 0


def test_preempted_request_finds_its_own_cached_pages():
    a = PrefixCachingAllocator(8, 4)
    sched = Scheduler(a, max_batch=4, max_num_batched_tokens=64)
    r0, r1 = _req(0, 9), _req(1, 12)
    sched.add(r0)
    sched.add(r1)
    for _ in range(20):          # both grow a page every 4 tokens until none is free: r1, the newer, goes
        _run(sched)
        for r in sched.running:
            a.commit(r)
        if sched.num_preemptions:
            break
    assert list(sched.waiting) == [r1] and r1.num_computed == 0 and r1.block_table == []
    n = r1.num_tokens            # its prompt and output; all but the newest token were computed
    assert len(r1.prompt_keys) == (n - 1) // 4 and a.num_cached >= len(r1.prompt_keys)
    sched.running.remove(r0)     # r0 ends: its pages go back (cached)
    a.free(r0.block_table)
    hits = a.hit_tokens
    # readmitted with its computed full pages found in the cache: it computes only the rest (here the newest token)
    assert [(s.request, s.num_tokens) for s in sched.schedule()] == [(r1, n - 4 * ((n - 1) // 4))]
    assert r1.num_computed == 4 * ((n - 1) // 4) and a.hit_tokens == hits   # (readmissions: not in the hit rate)
    assert r1.num_cached_tokens == 0   # (what the prompt found at its first admission)


# --- the engine ---------------------------------------------------------------------------------------------

PROMPTS = [[3, 1, 4, 1, 5, 9], [2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2, 3, 8], [4, 6, 2, 6, 4]]


def _params(n: int = len(PROMPTS)):
    """Every sampling path: greedy, a seeded graph draw, a seeded full-vocabulary draw, host sampling (logprobs and
    penalties), a stop token."""
    ps = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=25, ignore_eos=True),
          SamplingParams(temperature=1.1, top_p=0.9, seed=6, max_tokens=28, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=8, max_tokens=22, ignore_eos=True, logprobs=2, presence_penalty=0.5),
          SamplingParams(temperature=0.7, top_k=8, seed=7, max_tokens=26, ignore_eos=True, stop_token_ids=[11])]
    return ps[:n]


def _llm(kv_allocation, backend="torch", **kw):
    return LLM("tiny-llama", backend=backend, dtype="float32", kv_allocation=kv_allocation,
               **{"max_seq_len": 64, "max_batch": 5, "page_size": 4, "num_pages": 12, "decode_steps": 1, **kw})


def _generate(kv_allocation, backend="torch", **kw):
    with _llm(kv_allocation, backend, **kw) as llm:
        outs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        for _ in range(2):        # (async bursts: one may still be in flight after the last output)
            llm.engine.step()
        e = llm.engine
        assert not e.has_unfinished() and e.allocator.num_free == e.allocator.num_pages
        return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs], dict(e.stats)


@pytest.mark.parametrize("backend,kw", [("torch", {}), ("pyvm", {}), ("reference", {"device_sampling": "off"}),
                                        ("torch", {"decode_steps": 4}),
                                        ("torch", {"decode_steps": 4, "async_bursts": True})],
                         ids=["torch", "pyvm", "reference", "bursts", "async-bursts"])
def test_lazy_under_page_pressure_equals_reserve(backend, kw, ref_greedy):
    want, st0 = _generate("reserve", backend, **kw)
    got, st = _generate("lazy", backend, **kw)
    assert st0["preemptions"] == 0 and st["preemptions"] > 0 and st["recomputed_tokens"] > 0
    assert st["max_batch_size_seen"] > st0["max_batch_size_seen"]   # more requests ran at once
    assert [g[0] for g in got] == [w[0] for w in want]
    assert [g[2] for g in got] == [w[2] for w in want]
    for g, w in zip(got, want):   # logprobs: equal tokens, values up to a prefill's rounding against a decode's
        assert (g[1] is None) == (w[1] is None)
        if g[1] is not None:
            assert [list(d) for d in g[1]] == [list(d) for d in w[1]]
            assert all(abs(g[1][i][t] - w[1][i][t]) < 1e-4 for i in range(len(g[1])) for t in g[1][i])
    assert got[0][0] == ref_greedy("tiny-llama", PROMPTS[0], 30)


def test_a_preempted_request_holds_nothing_on_the_workers():
    """The reference backend keeps K/V per sequence: a preempted request's goes with its pages (freed on the worker),
    so the worker holds caches for the running requests only."""
    with _llm("lazy", "reference", device_sampling="off") as llm:
        e, runner = llm.engine, llm.executor.workers[0].runner
        for p, sp in zip(PROMPTS, _params()):
            e.add_request(p, sp)
        while e.has_unfinished():
            e.step()
            assert runner.num_cached() == len(e.scheduler.running)
        assert e.stats["preemptions"] > 0


def test_prefix_caching_makes_readmission_cheap():
    runs = {}
    for caching in (False, True):
        with _llm("lazy", enable_prefix_caching=caching) as llm:
            toks = [o.token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]
            runs[caching] = toks, dict(llm.engine.stats)
    (t0, s0), (t1, s1) = runs[False], runs[True]
    assert t0 == t1
    assert s0["preemptions"] > 0 and s1["preemptions"] > 0
    # the same prompts share nothing: a readmitted request finds its own computed pages again, so it recomputes less
    assert s1["prefix_cache_hit_tokens"] == 0   # (the prompt hit rate: readmissions are not counted in it)
    per_preemption = (s0["recomputed_tokens"] / s0["preemptions"], s1["recomputed_tokens"] / s1["preemptions"])
    assert per_preemption[1] < per_preemption[0]


def test_streams_of_preempted_requests_add_up():
    with _llm("lazy") as llm:
        want = {str(i): o.token_ids for i, o in enumerate(llm.generate(PROMPTS, _params(), use_tqdm=False))}
        assert llm.engine.stats["preemptions"] > 0
        got: dict[str, list[int]] = {}
        for o in llm.stream(PROMPTS, _params()):
            got.setdefault(o.request_id, []).extend(o.delta_token_ids)
            assert got[o.request_id] == o.token_ids   # no token twice, none lost across a preemption
    assert sorted(got.values()) == sorted(want.values())


def test_aborting_a_preempted_request():
    with _llm("lazy") as llm:
        e = llm.engine
        ids = [e.add_request(p, sp) for p, sp in zip(PROMPTS, _params())]
        victim = None
        while e.has_unfinished():
            e.step()
            if victim is None and e.stats["preemptions"]:
                victim = next(r for r in e.scheduler.waiting if r.num_preemptions)
                out = e.abort(victim.request_id)
                assert out.finished and out.finish_reason == "abort" and out.token_ids == victim.output_token_ids
                assert victim not in e.scheduler.waiting
        assert victim is not None
        assert e.allocator.num_free == e.allocator.num_pages and not e._requests
        assert set(ids) >= {victim.request_id}


def test_kv_allocation_is_checked():
    with pytest.raises(InvalidRequestError, match="kv_allocation"):
        LLM("tiny-llama", kv_allocation="eager")


def test_workers_refuse_a_block_table_that_does_not_cover_the_positions():
    ok = [SeqChunk(0, [5], 7, [3, 4])]               # position 7, pages of 4: two pages
    check_pages(ok, 1, 4)
    with pytest.raises(ValueError, match="too few"):
        check_pages(ok, 2, 4)                        # a burst of 2 writes position 8 too
    with pytest.raises(ValueError, match="too few"):
        check_pages([SeqChunk(1, [1, 2, 3, 4, 5], 0, [9])], 1, 4)


def test_generate_cli_takes_the_kv_flags(capsys):
    """python -m mpk_runtime generate shares the serving CLIs' engine flags: few pages, lazy and reserve, same tokens."""
    from mpk_runtime.__main__ import main
    got = {}
    for alloc in ("lazy", "reserve"):
        args = ["generate", "--model", "tiny-llama", "--backend", "torch", "--dtype", "float32", "--max-tokens", "20",
                "--ignore-eos", "--max-seq-len", "64", "--num-pages", "12", "--page-size", "4", "--decode-steps", "1",
                "--kv-allocation", alloc]
        for p in PROMPTS:
            args += ["--prompt-ids", ",".join(map(str, p))]
        assert main(args) == 0
        import json
        cap = capsys.readouterr()
        got[alloc] = [json.loads(x)["token_ids"] for x in cap.out.splitlines() if x.startswith("{")]
        assert ("preemptions for KV pages" in cap.err) == (alloc == "lazy")
    assert len(got["lazy"]) == len(PROMPTS) and got["lazy"] == got["reserve"]


def test_a_prompt_preempted_in_its_prefill_is_counted_once():
    """A request preempted before its first token: on readmission the positions it had computed count as recomputed,
    the rest of its prompt as prompt tokens (found by a review: all of it counted as prompt tokens again)."""
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, page_size=4, num_pages=14,
             max_batch=4, decode_steps=1, max_num_batched_tokens=3) as llm:
        e = llm.engine
        e.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        e.step()
        e.step()
        e.add_request(list(range(5, 45)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        while e.has_unfinished():
            e.step()
        st = e.stats
        assert st["preemptions"] > 0 and st["recomputed_tokens"] > 0
        assert st["prompt_tokens"] == 3 + 40
