"""Replicas whose engine runs in a child process (engine/engine_process.py): the same tokens as an in-process LLM
through the HTTP server, bad input refused in the parent, errors that cross the pipe, a child killed mid-request."""
import os
import signal
import threading

import pytest

from cluster.client import Client
from cluster.router import build_router
from cluster.server import ServerThread, create_app
from mpk_runtime.engine import (LLM, InvalidRequestError, LLMEngine, PromptTooLongError, RequestFailedError,
                                SamplingParams)
from mpk_runtime.engine.engine_process import EngineProcess, PrefixShadow
from mpk_runtime.engine.errors import UnknownModelError

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
KW = dict(dtype="float32", max_seq_len=64, max_batch=8)


@pytest.fixture(scope="module")
def proc_server(demo_dir):
    router = build_router(demo_dir, executor="inprocess", engine_process=True, health_interval=None,
                          backend="torch", **KW)
    srv = ServerThread(create_app(router))
    yield srv, router
    srv.stop()
    router.shutdown()


@pytest.fixture(scope="module")
def local_llm(demo_dir):
    with LLM(demo_dir, backend="torch", **KW) as llm:
        yield llm


def _wait_for(proc: EngineProcess, ids, params=GREEDY, timeout=60.0):
    done, outs = threading.Event(), []

    def cb(o):
        outs.append(o)
        if o.finished:
            done.set()
    proc.submit(ids, params, cb)
    assert done.wait(timeout), "no final output"
    return outs


def test_http_through_engine_process_equals_llm(proc_server, local_llm):
    prompts = [[1, 2, 3], "hello world", [40, 41, 42, 43]]
    want = local_llm.generate(prompts, GREEDY, use_tqdm=False)
    with Client(proc_server[0].url) as c:
        got = c.generate(prompts, GREEDY)
        parts = list(c.stream([[5, 6, 7]], GREEDY))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    streamed = local_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert [t for p in parts for t in p.delta_token_ids] == streamed.token_ids
    rep = proc_server[1].replicas[0]
    assert rep.llm is None and rep.loop.load == 0
    st = proc_server[1].stats()["replica-0"]
    assert st["dead"] is None and st["tokens_generated"] >= 4 * 8 and st["requests_finished"] >= 4
    assert rep.loop.pid != os.getpid()
    # the child's threads, by name: its engine loop among them
    assert "mpk-replica-0" in rep.loop.rpc("thread_cpu")


def test_parent_refuses_bad_requests_before_the_pipe(proc_server):
    proc = proc_server[1].replicas[0].loop
    sent = proc.load
    with pytest.raises(PromptTooLongError, match="context holds 64"):
        proc.submit(list(range(1, 70)), GREEDY, lambda o: None)
    with pytest.raises(InvalidRequestError, match="prompt token ids must be ints"):
        proc.submit([1, 10**9], GREEDY, lambda o: None)
    assert proc.load == sent
    with Client(proc_server[0].url) as c:   # through the server: a 400 with the parent's message
        with pytest.raises(PromptTooLongError, match="context holds 64"):
            c.generate([list(range(1, 70))], GREEDY)


def test_calls_cross_the_process_and_lambdas_are_refused(proc_server):
    proc = proc_server[1].replicas[0].loop
    # the call runs on the child's engine and its answer comes back: after a reset, one 39-token prompt + 2 greedy
    # tokens leaves 40 positions of computed K/V, floor(40 / 16) = 2 full pages for the prefix cache (the child's
    # LLM caches prefixes by default, pages of 16); the next reset finds nothing left
    proc.call(LLMEngine.reset_prefix_cache).result(timeout=30)
    _wait_for(proc, list(range(1, 40)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert proc.call(LLMEngine.reset_prefix_cache).result(timeout=30) == 2
    assert proc.call(LLMEngine.reset_prefix_cache).result(timeout=30) == 0
    with pytest.raises(RequestFailedError, match="module-level function"):
        proc.call(lambda e: e.stats).result(timeout=30)
    with pytest.raises(KeyError):
        proc.rpc("no-such-rpc")


def _grow(engine):   # a call that needs the loop thread (module level: it crosses the pipe)
    return engine.stats["steps"]


def test_cancelled_call_leaves_the_replica_serving(proc_server):
    """A caller that gave up on a call (asyncio.wait_for's timeout cancels the future) must not take the reader
    thread down with it, in process or out."""
    from mpk_runtime.engine.async_engine import EngineLoop
    proc = proc_server[1].replicas[0].loop
    fut = proc.call(_grow)
    fut.cancel()
    assert _wait_for(proc, [1, 2, 3])[-1].finish_reason == "length" and proc.alive and proc.dead is None
    assert proc.call(_grow).result(timeout=30) >= 1
    llm = LLM("tiny-llama", **KW)
    loop = EngineLoop(llm.engine, name="c", health_interval=None)
    try:
        loop._cmds.put(("call", _grow, _cancelled()))
        assert loop.call(_grow).result(timeout=30) == 0 and loop.alive
    finally:
        loop.shutdown()
        llm.shutdown()


def _cancelled():
    import concurrent.futures as cf
    f = cf.Future()
    f.cancel()
    return f


def test_what_cannot_cross_the_pipe_is_refused_in_the_parent(proc_server):
    proc = proc_server[1].replicas[0].loop

    def from_main(engine):
        return 0
    from_main.__module__ = "__main__"   # (as a script's function would be: the child cannot import it)
    with pytest.raises(RequestFailedError, match="cannot import this program's __main__"):
        proc.call(from_main).result(timeout=30)

    class LocalParams(SamplingParams):   # a local class does not pickle
        pass
    load = proc.load
    with pytest.raises(InvalidRequestError, match="cannot cross to the engine process"):
        proc.submit([1, 2, 3], LocalParams(temperature=0, max_tokens=4), lambda o: None)
    assert proc.load == load and proc.alive


def test_call_answers_after_the_outputs_before_it(proc_server):
    """abort(); call(fn).result() is a barrier, as in process: the aborted request's end arrived first."""
    proc = proc_server[1].replicas[0].loop
    seen = []
    rid = proc.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                      lambda o: seen.append(o.finish_reason) if o.finished else None)
    proc.abort(rid)
    proc.call(_grow).result(timeout=30)
    assert seen and seen[-1] in ("abort", "length")


def test_construction_errors_surface_in_the_parent():
    with pytest.raises(UnknownModelError, match="unknown model 'no-such-model'"):
        EngineProcess("no-such-model", name="bad")
    with pytest.raises(InvalidRequestError, match="'inprocess' or 'ray', not 'nope'"):
        build_router("tiny-llama", executor="nope", engine_process=True)


def test_killed_child_fails_its_requests_and_restarts(demo_dir, local_llm):
    proc = EngineProcess(demo_dir, name="k", health_interval=None, max_restarts=1, backend="torch", **KW)
    try:
        first = proc.pid
        done, outs = threading.Event(), []

        def cb(o):
            outs.append(o)
            if o.finished:
                done.set()
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        proc.submit([1, 2, 3], long, cb)
        os.kill(first, signal.SIGKILL)
        assert done.wait(60)
        assert outs[-1].finish_reason == "error" and "exited" in outs[-1].error
        # a new child took over: the next request runs there, with the same tokens as in process
        for _ in range(600):
            if proc.dead is None and proc.alive:
                break
            threading.Event().wait(0.1)
        assert proc.pid != first and proc.restarts == 1
        got = _wait_for(proc, [5, 6, 7])[-1]
        assert got.token_ids == local_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
        # past max_restarts: down for good, and submit says so
        os.kill(proc.pid, signal.SIGKILL)
        for _ in range(600):
            if proc.dead and "not restarted" in proc.dead:
                break
            threading.Event().wait(0.1)
        with pytest.raises(RequestFailedError, match="not restarted"):
            proc.submit([1, 2], GREEDY, lambda o: None)
        assert proc.stats()["dead"]
    finally:
        proc.shutdown()


def test_prefix_shadow_matches_what_was_sent_and_forgets_oldest():
    sh = PrefixShadow(num_pages=3, page_size=4)
    a = list(range(1, 14))            # 3 full pages before the last token
    assert sh.match(a)[0] == []
    sh.note(a)
    assert len(sh.match(a)[0]) == 3
    assert len(sh.match(a[:8] + [99] * 5)[0]) == 2      # shares the first two pages
    assert len(sh.match([7] + a[1:])[0]) == 0           # a different first page: no chain
    sh.note([50 + i for i in range(9)])                 # 2 new pages: the 2 oldest go
    assert len(sh.match(a)[0]) == 0 and sh.pages_for(9) == 3


def test_wire_form_rebuilds_every_output_exactly():
    """pack_output (child) -> PendingRequest.unpack (parent) gives back each RequestOutput the engine made, field for field:
    streamed snapshots with logprobs and text, a stream=False request's one output, a failed request's."""
    from mpk_runtime.engine.process_wire import PendingRequest, pack_output
    from mpk_runtime.engine.request import RequestOutput
    llm = LLM("tiny-llama", **KW)
    try:
        sp = SamplingParams(temperature=0.8, seed=3, max_tokens=12, logprobs=2)
        outs = list(llm.stream([[1, 2, 3], [4, 5, 6, 7]], sp))
        eng = llm.engine
        rid = eng.add_request([9, 8, 7], GREEDY, stream=False)
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.request_id == rid]
    finally:
        llm.shutdown()
    outs.append(RequestOutput.failed("gone", None, [3, 4], "the engine process exited"))
    assert sum(o.finished for o in outs) == 4 and any(o.logprobs for o in outs)
    sent, pend = {}, {}
    for o in outs:
        p = pend.setdefault(o.request_id, PendingRequest(None, o.prompt, o.prompt_token_ids))
        assert p.unpack(o.request_id, pack_output(o, sent)) == o
    assert sent == {}   # (forgotten at each request's end)


def test_router_sends_a_shared_prefix_to_the_replica_that_has_it(demo_dir):
    """Two engine-process replicas with prefix caching: the router reads each one's prefix shadow (what it was sent),
    so a prompt that starts with pages one replica computed goes there, and the cache there serves them."""
    router = build_router(demo_dir, executor="inprocess", engine_process=True, num_replicas=2, health_interval=None,
                          backend="torch", enable_prefix_caching=True, page_size=4, **KW)
    try:
        base = list(range(1, 14))   # 3 full pages before the last token
        first = router.pick(base)
        _wait_for(first.loop, base, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        for tail in ([50, 51, 52], [60, 61]):
            rep = router.pick(base[:12] + tail)
            assert rep is first
            out = _wait_for(rep.loop, base[:12] + tail, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            assert out[-1].num_cached_tokens == 12   # the three pages came from that replica's cache
        other = next(r for r in router.replicas if r is not first)
        assert other.engine.allocator.match(base)[0] == []   # (its shadow holds none of those pages)
    finally:
        router.shutdown()


def _wait_until(cond, timeout=60.0):
    end = threading.Event()
    for _ in range(int(timeout / 0.05)):
        if cond():
            return True
        end.wait(0.05)
    return False


def test_wedged_child_is_skipped_then_killed_and_restarted(demo_dir, local_llm):
    """A child that stops (SIGSTOP: no heartbeat, no step) is passed over by the router once stalled, then killed
    after wedge_timeout: its request fails naming the wedge, a new child serves the next one. The other child, idle
    and then busy for longer than its own (shorter) wedge_timeout, is left alone: its heartbeat keeps it fresh."""
    router = build_router(demo_dir, executor="inprocess", engine_process=True, num_replicas=2, health_interval=None,
                          backend="torch", stall_after=5.0, wedge_timeout=None, **KW)
    try:
        a, b = router.replicas
        for r in (a, b):   # (the first step warms torch up: seconds on a busy CPU machine)
            _wait_for(r.loop, [1, 2])
        a.loop.wedge_timeout, b.loop.wedge_timeout = 12.0, 6.0
        first, b_pid = a.loop.pid, b.loop.pid
        done, outs = threading.Event(), []

        def cb(o):
            outs.append(o)
            if o.finished:
                done.set()
        os.kill(first, signal.SIGSTOP)
        a.loop.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), cb)
        assert b.loop.stalled_s < 5.0   # (b is idle: its heartbeat keeps it fresh, late by ~1.5 s at most)
        assert _wait_until(lambda: a.loop.stalled_s > 6.0, 15)
        # a holds one request, b none: least-loaded alone would pick b anyway, so load b past a first
        for _ in range(3):
            b.loop.submit([4, 5], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), lambda o: None)
        assert a.loop.load < b.loop.load and a.loop.alive and not a.engine.dead
        assert all(router.pick([9, 9]) is b for _ in range(4))
        from cluster.metrics import Metrics
        line = next(x for x in Metrics().render(router.stats()).splitlines()
                    if x.startswith('mpk_stalled_seconds{replica="replica-0"}'))
        assert float(line.split()[-1]) > 5.0
        srv = ServerThread(create_app(router))
        try:
            import httpx
            health = httpx.get(srv.url + "/health", timeout=30).json()
        finally:
            srv.stop()
        # (a child that sends nothing, not even its heartbeat, is reported down at once: no stats rpc to wait out)
        assert health["status"] == "ok" and list(health["stalled_s"]) == ["replica-0"]
        assert health["replicas"] == {"replica-0": False, "replica-1": True}
        assert done.wait(30), "the wedged child's request never ended"
        assert outs[-1].finish_reason == "error" and "wedged" in outs[-1].error and "no progress" in outs[-1].error
        assert _wait_until(lambda: a.loop.dead is None and a.loop.alive and a.loop.pid != first)
        assert a.loop.stalled_s < 2.0
        got = _wait_for(a.loop, [5, 6, 7])[-1]
        assert got.token_ids == local_llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
        assert b.loop.pid == b_pid and b.loop.restarts == 0 and b.loop.dead is None
    finally:
        try:
            os.kill(first, signal.SIGCONT)
        except ProcessLookupError:
            pass
        router.shutdown()

