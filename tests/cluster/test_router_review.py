"""Review of the router, the /metrics page and the engine loop (cluster/router.py, cluster/metrics.py,
mpk_runtime/engine/async_engine.py): each test failed before its fix."""
import math
import threading
import time

import httpx
import pytest

from cluster.metrics import Metrics
from cluster.router import build_router
from mpk_runtime.engine import LLM, LLMEngine, RequestFailedError, SamplingParams
from mpk_runtime.engine.async_engine import EngineLoop

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _parse(text: str) -> tuple[dict[str, float], list[str]]:
    """Prometheus text -> ({'name{labels}': value}, comment lines)."""
    samples, comments = {}, []
    for line in text.splitlines():
        if line.startswith("#"):
            comments.append(line)
        elif line:
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples, comments


def _wait(pred, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_summary_count_and_sum_cover_every_finished_request(demo_dir):
    """The latency summaries' _count and _sum were taken over the last `keep` requests only: _count stopped at
    keep and _sum went down as the window slid, where Prometheus reads both as counters (rate() broke)."""
    with LLM(demo_dir, dtype="float32", max_seq_len=64) as llm:
        outs = llm.generate([[1, 2, i] for i in range(3, 8)], SP, use_tqdm=False)
    m = Metrics(keep=2)
    last_sum = 0.0
    for k, o in enumerate(outs, 1):
        m.on_finish(o)
        s, _ = _parse(m.render({}))
        assert s['mpk_requests_total{status="finished"}'] == k
        assert s["mpk_request_latency_seconds_count"] == k
        assert s["mpk_time_to_first_token_seconds_count"] == k
        assert s["mpk_request_latency_seconds_sum"] >= last_sum
        last_sum = s["mpk_request_latency_seconds_sum"]
    want = sum(o.metrics.finish_time - o.metrics.arrival_time for o in outs)
    assert math.isclose(last_sum, want, rel_tol=1e-4, abs_tol=1e-6)


def test_metrics_page_families_and_counts_match_the_requests_sent(server):
    """`mpk_requests_total` had a TYPE line but no HELP line; every family must have both, once, before its
    samples, and the request / token counters must equal what the test sent."""
    srv, _router = server
    before, _ = _parse(httpx.get(srv.url + "/metrics").text)
    for i in range(3):
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3 + i], "max_tokens": 5,
                                                           "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
    assert httpx.post(srv.url + "/v1/completions", json={"prompt": [1], "max_tokens": 500}).status_code == 400
    text = httpx.get(srv.url + "/metrics").text
    after, comments = _parse(text)

    def d(k):
        return after[k] - before.get(k, 0)
    assert d('mpk_requests_total{status="finished"}') == 3
    assert d('mpk_requests_total{status="rejected"}') == 1
    assert d("mpk_generated_tokens_total") == 15
    families = {}
    for c in comments:
        kind, name = c.split()[1:3]
        assert (name, kind) not in families, c
        families[name, kind] = True
    sample_names = {k.split("{")[0] for k in after}
    for n in sample_names:
        base = n[:-4] if n.endswith("_sum") else n[:-6] if n.endswith("_count") else n
        assert (base, "HELP") in families and (base, "TYPE") in families, n
    assert after['mpk_running_requests{replica="replica-0"}'] == 0


def test_call_and_submit_after_the_loop_stopped_fail_at_once(demo_dir):
    """EngineLoop.call() after the loop stopped queued its call where nobody would run it (POST
    /reset_prefix_cache then hung for good); and a request submitted from a callback of the shutdown's own error
    outputs (a client retrying) was accepted after the queue's last drain and never answered."""
    with LLM(demo_dir, dtype="float32", max_seq_len=64) as llm:
        loop = EngineLoop(llm.engine, name="t", health_interval=None)
        retried, done = {}, threading.Event()

        def retry(out):
            if out.finished and not retried:
                try:
                    retried["rid"] = loop.submit([1, 2, 3], SP, lambda o: done.set() if o.finished else None)
                except RequestFailedError as e:
                    retried["error"] = e
                    done.set()
        loop.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True), retry)
        loop.shutdown()
        assert done.wait(20), f"the request resubmitted during shutdown was never answered: {retried}"
        fut = loop.call(LLMEngine.reset_prefix_cache)
        with pytest.raises(RequestFailedError):
            fut.result(timeout=10)
        with pytest.raises(RequestFailedError):
            loop.submit([1, 2, 3], SP, lambda o: None)


def test_a_loop_thread_that_dies_ends_its_requests(demo_dir, monkeypatch):
    """An error escaping the loop (here a failing recovery after a failed step) ended its thread and left every
    caller waiting for good; now the requests it held end with an error and later calls fail at once."""
    with LLM(demo_dir, dtype="float32", max_seq_len=64) as llm:
        def bad_step(*a, **k):
            raise RuntimeError("step bug")

        def bad_recovery(e):
            raise RuntimeError("recovery bug")
        monkeypatch.setattr(llm.engine, "step", bad_step)
        monkeypatch.setattr(llm.engine, "_on_failure", bad_recovery)
        loop = EngineLoop(llm.engine, name="t", health_interval=None)
        got = []
        try:
            loop.submit([1, 2, 3], SP, lambda o: got.append(o) if o.finished else None)
            assert _wait(lambda: got), "the request never ended"
            assert got[0].finish_reason == "error" and "recovery bug" in got[0].error
            assert loop.load == 0 and not loop.alive and loop.stats()["dead"]
            with pytest.raises(RequestFailedError):
                loop.call(LLMEngine.reset_prefix_cache).result(timeout=10)
        finally:
            loop.shutdown()


def test_router_shutdown_goes_on_past_a_replica_that_fails_to_stop(demo_dir):
    """Router.shutdown stopped at the first replica whose shutdown raised: the replicas after it kept their engine
    loops (and workers, or child processes) running and their requests were never ended."""
    router = build_router(demo_dir, executor="inprocess", num_replicas=2, dtype="float32", max_seq_len=64,
                          health_interval=None)
    r0, r1 = router.replicas
    orig = r0.llm.shutdown

    def broken():
        orig()
        raise RuntimeError("cannot stop")
    r0.llm.shutdown = broken
    ends = []
    r1.loop.submit([1, 2, 3], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
                   lambda o: ends.append(o) if o.finished else None)
    with pytest.raises(RuntimeError, match="cannot stop"):
        router.shutdown()
    assert not r1.loop.alive
    assert _wait(lambda: ends) and ends[0].finished


def test_a_failed_build_reports_its_own_error_and_stops_every_replica_built(demo_dir, monkeypatch):
    """When a later replica failed to build, build_router shut the built ones down in a loop that stopped at the
    first whose shutdown raised: that error replaced the build's own and the replicas after it kept running."""
    import cluster.router as router_mod
    built = []

    class FlakyLLM(LLM):
        def __init__(self, *a, **k):
            if len(built) == 2:
                raise RuntimeError("no memory for replica-2")
            super().__init__(*a, **k)
            built.append(self)
            if len(built) == 1:
                orig = self.shutdown

                def broken():
                    orig()
                    raise RuntimeError("cannot stop replica-0")
                self.shutdown = broken
    monkeypatch.setattr(router_mod, "LLM", FlakyLLM)
    loops = []
    real_loop = router_mod.EngineLoop
    monkeypatch.setattr(router_mod, "EngineLoop", lambda *a, **k: loops.append(real_loop(*a, **k)) or loops[-1])
    with pytest.raises(RuntimeError, match="no memory for replica-2"):
        build_router(demo_dir, executor="inprocess", num_replicas=3, dtype="float32", max_seq_len=64,
                     health_interval=None)
    assert len(loops) == 2 and not any(lp.alive for lp in loops)
