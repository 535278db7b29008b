"""LLM(async_bursts=True) (engine/bursts.py): the next burst of decode steps is launched (Worker.execute(defer=True))
before the engine reads the last one (Worker.collect), resumed from the tokens the runner drew. Every output must
equal the synchronous bursts' (and the reference), each burst's successor must be launched before it is read, rows
that stop or are aborted mid-pipeline keep their pages until the burst in flight returns, new arrivals end the
pipeline, and a worker failure in flight fails its requests cleanly."""
import pytest
import torch

from mpk_runtime.engine import LLM, InvalidRequestError, SamplingParams

PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3], [8, 9, 7, 9, 3, 2]]


def _params():
    """Rows that stop at different points of different bursts: lengths, a stop token, seeded graph / full draws."""
    return [SamplingParams(temperature=0, max_tokens=23, ignore_eos=True),
            SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=17, ignore_eos=True),
            SamplingParams(temperature=1.1, top_p=0.9, seed=6, max_tokens=30, ignore_eos=True),   # full draw
            SamplingParams(temperature=0.7, top_k=8, seed=7, max_tokens=26, ignore_eos=True, stop_token_ids=[11])]


def _llm(async_bursts, backend="torch", **kw):
    return LLM("tiny-llama", backend=backend, dtype="float32", **{"max_seq_len": 64, "max_batch": 4,
                                                                  "decode_steps": 4, "async_bursts": async_bursts,
                                                                  **kw})


@pytest.mark.parametrize("backend", ["torch", "pyvm"])
def test_async_bursts_equal_synchronous_ones(backend, ref_greedy):
    got = {}
    for a in (False, True):
        with _llm(a, backend) as llm:
            got[a] = [o.token_ids for o in llm.generate(PROMPTS, _params(), use_tqdm=False)]
            st = llm.engine.stats
            assert (st["async_bursts"] > 0) == a
            assert not llm.engine.has_unfinished() or a   # (a burst may still be in flight after the last output)
            for _ in range(2):
                llm.engine.step()
            assert not llm.engine.has_unfinished()
            assert llm.engine.allocator.num_free == llm.engine.allocator.num_pages
    assert got[True] == got[False]
    assert got[True][0] == ref_greedy("tiny-llama", PROMPTS[0], 23)
    assert [len(t) for t in got[True]][:3] == [23, 17, 30]


def test_pages_of_a_row_that_stopped_stay_taken_while_the_next_burst_runs(ref_greedy):
    """A row that stops on a token (not by its length: that one the pipeline sees coming) inside a burst whose
    successor is already running."""
    stop = ref_greedy("tiny-llama", PROMPTS[1], 8)[6]
    with _llm(True) as llm:
        e = llm.engine
        e.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), request_id="long")
        e.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop]),
                      request_id="short")
        held = None
        while e.has_unfinished():
            outs = e.step()
            if any(o.request_id == "short" and o.finished for o in outs) and e._inflight is not None:
                held = e.allocator.num_free            # "short" finished, a burst holding its row is in flight
                assert "short" in e._inflight.dropped
                e.step()                               # that burst is read: now its pages go back
                assert e.allocator.num_free > held
        assert held is not None and e.allocator.num_free == e.allocator.num_pages


def test_arrivals_and_aborts_during_the_pipeline(ref_greedy):
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with _llm(True, max_batch=3) as llm:
        e = llm.engine
        for i, p in enumerate(PROMPTS[:2]):
            e.add_request(p, sp, request_id=str(i))
        done, aborted = {}, None
        for n in range(200):
            if not e.has_unfinished():
                break
            if e._inflight is not None and aborted is None:   # abort a row of the burst in flight
                aborted = e.abort("1")
                assert aborted is not None and aborted.finish_reason == "abort"
                e.add_request(PROMPTS[2], sp, request_id="2")    # and one arrives while it runs
            for o in e.step():
                if o.finished:
                    done[o.request_id] = o
        assert aborted is not None and "1" not in done
        assert done["0"].token_ids == ref_greedy("tiny-llama", PROMPTS[0], 20)
        assert done["2"].token_ids == ref_greedy("tiny-llama", PROMPTS[2], 20)
        assert e.allocator.num_free == e.allocator.num_pages and not e.scheduler.running


def test_a_failure_in_flight_fails_its_requests_and_the_engine_goes_on(ref_greedy):
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with _llm(True) as llm:
        e = llm.engine
        e.add_request(PROMPTS[0], sp, request_id="a")
        while e._inflight is None:
            e.step()
        llm.executor.collective_rpc("inject_fault", ("raise",))   # the burst after the one in flight fails
        outs = []
        while e.has_unfinished():
            outs += e.step()
        assert [o.finish_reason for o in outs if o.finished] == ["error"]
        assert e.allocator.num_free == e.allocator.num_pages
        again = llm.generate([PROMPTS[1]], sp, use_tqdm=False)[0]
    assert again.token_ids == ref_greedy("tiny-llama", PROMPTS[1], 24)


def test_async_bursts_refused_where_they_cannot_work():
    with pytest.raises(InvalidRequestError, match="decode_steps"):
        _llm(True, decode_steps=1)
    with pytest.raises(InvalidRequestError, match="True, False or None"):
        _llm("yes")


def test_the_default_pipelines_every_burst():
    """async_bursts=None (the default, decode_steps > 1): every burst is pipelined, one row or many (since session
    54's measurements; before, only bursts of 32+ rows); the tokens are the synchronous bursts'."""
    prompts = [[1 + i % 50, 2, 3] for i in range(6)]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=8) as llm:
        assert llm.engine.async_bursts
        one = llm.generate(prompts[:1], sp, use_tqdm=False)
        assert llm.engine.stats["async_bursts"] > 0
        many = llm.generate(prompts, sp, use_tqdm=False)
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=64, max_batch=8, async_bursts=False) as llm:
        assert [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == [o.token_ids for o in many]
        assert llm.engine.stats["async_bursts"] == 0
    assert one[0].token_ids == many[0].token_ids
    with LLM("tiny-llama", backend="torch", dtype="float32", max_seq_len=32, decode_steps=1) as llm:
        assert not llm.engine.async_bursts   # (nothing to overlap: no error, as the default)


def test_each_burst_is_read_after_its_successor_is_launched():
    """The device never waits for the host between two bursts of the same rows: the runner sees burst i + 1 launched
    before burst i is waited for, every burst read once, in launch order (a single request, 4 steps a burst)."""
    log = []
    with _llm(True) as llm:
        runner = llm.executor.workers[0].runner
        launch = runner.launch_steps

        def logged(chunks, num_steps, resume=False):
            i = sum(e[0] == "launch" for e in log)
            log.append(("launch", i))
            p = launch(chunks, num_steps, resume)
            wait = p.wait
            p.wait = lambda: (log.append(("wait", i)), wait())[1]
            return p
        runner.launch_steps = logged
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                           use_tqdm=False)[0]
        llm.engine.step()
    n = sum(e[0] == "launch" for e in log)
    assert n >= 6 and [e for e in log if e[0] == "wait"] == [("wait", i) for i in range(n)]
    for i in range(n - 1):   # (the last burst: none after it, the request's length is known)
        assert log.index(("launch", i + 1)) < log.index(("wait", i)), log
    assert len(out.token_ids) == 30


def test_worker_deferred_bursts_are_collected_in_order_and_guarded():
    """Worker.execute(defer=True) / collect: tokens in launch order, equal to synchronous decode_steps; collect with
    nothing launched and a step sent over uncollected bursts are errors (tokens would be lost); discard_bursts drops
    what is queued."""
    from mpk_runtime.runtime.base import SeqChunk
    from mpk_runtime.runtime.executor import InProcessExecutor
    from mpk_runtime.runtime.device_sampling import DeviceSampling
    ex = InProcessExecutor(1)
    try:
        ex.init_workers("torch", model="tiny-llama", dtype="float32", max_batch=2, max_seq_len=64)
        ds = DeviceSampling(temperature=0.0, top_k=1, top_p=1.0, seed=0)
        pre = [SeqChunk(i, p, 0, [1 + 4 * i, 2 + 4 * i, 3 + 4 * i], ds) for i, p in enumerate(PROMPTS[:2])]
        first = [int(t) for t in ex.collective_rpc("execute", (pre,))[0].tokens]
        dec = [SeqChunk(c.seq_id, [t], len(c.token_ids), c.block_table, ds) for c, t in zip(pre, first)]
        want = ex.collective_rpc("execute", (dec, 3))[0]
        # the same positions again (K/V rewritten with the same values), 2 + 1 steps, the second resumed
        ex.collective_rpc("execute", (dec, 2), {"defer": True})
        ex.collective_rpc("execute", ([SeqChunk(c.seq_id, [0], c.start_pos + 2, c.block_table, ds) for c in dec],
                                      1, True), {"defer": True})
        with pytest.raises(Exception, match="collect"):
            ex.collective_rpc("execute", (dec,))
        a, b = ex.collective_rpc("collect")[0], ex.collective_rpc("collect")[0]
        assert torch.cat([a, b], 1).tolist() == want.tolist()
        with pytest.raises(Exception, match="without a burst"):
            ex.collective_rpc("collect")
        ex.collective_rpc("execute", (dec, 2), {"defer": True})
        assert ex.collective_rpc("discard_bursts") == [1]
        assert ex.collective_rpc("execute", (dec, 3))[0].tolist() == want.tolist()
        ex.collective_rpc("execute", (dec, 2), {"defer": True})   # still queued at shutdown: waited for there
        pending = ex.workers[0]._pending
        assert len(pending) == 1
    finally:
        ex.shutdown()
    assert not pending


@pytest.mark.parametrize("async_bursts", [False, True])
def test_a_full_batch_with_a_queue_runs_bursts(async_bursts, ref_greedy):
    """With the batch full, a waiting request can only be admitted when a running one finishes, so the engine runs
    bursts (pipelined or not) instead of single steps; it admits the head once a row has finished, and every output
    is the reference's (greedy; 4 requests through 2 slots, lengths 9 / 20 / 13 / 11)."""
    lens = [9, 20, 13, 11]
    with _llm(async_bursts, max_batch=2) as llm:
        e = llm.engine
        for i, (p, n) in enumerate(zip(PROMPTS, lens)):
            e.add_request(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id=str(i))
        done, queued_bursts = {}, 0
        while e.has_unfinished():
            before = e.stats["multi_steps"]
            full = len(e.scheduler.running) == 2 and bool(e.scheduler.waiting)
            for o in e.step():
                if o.finished:
                    done[o.request_id] = o
            queued_bursts += full and e.stats["multi_steps"] > before
        e.step()
    assert queued_bursts >= 3
    for i, (p, n) in enumerate(zip(PROMPTS, lens)):
        assert done[str(i)].token_ids == ref_greedy("tiny-llama", p, n), i


@pytest.mark.parametrize("decode_steps", [1, 4])
def test_a_request_that_does_not_stream_is_reported_at_its_end_only(decode_steps, ref_greedy):
    """add_request(stream=False) (the server's non-streaming requests): step() returns no snapshot of it until it
    finishes, and that one output's delta holds every token; a streaming request beside it is reported every step,
    its deltas adding up to the same tokens. Single steps and bursts of 4 alike."""
    kw = {"decode_steps": 4, "async_bursts": True} if decode_steps == 4 else {"decode_steps": 1}
    with LLM("tiny-qwen3", backend="torch", dtype="float32", max_seq_len=64, max_batch=4, **kw) as llm:
        eng = llm.engine
        p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        eng.add_request([1, 2, 3], p, request_id="quiet", stream=False)
        eng.add_request([1, 2, 3], p, request_id="loud")
        seen = {"quiet": [], "loud": []}
        while eng.has_unfinished():
            for o in eng.step():
                seen[o.request_id].append(o)
    want = ref_greedy("tiny-qwen3", [1, 2, 3], 10)
    (q,) = seen["quiet"]
    assert q.finished and q.token_ids == want and q.delta_token_ids == want
    assert len(seen["loud"]) > 1 and [t for o in seen["loud"] for t in o.delta_token_ids] == want
    assert seen["loud"][-1].token_ids == want
