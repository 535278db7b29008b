"""Router / replica shutdown (cluster/router.py), session 69's review: health after shutdown, and shutting the
replicas down at once rather than one after another. Each test failed before its fix."""
import sys
import threading
import time

import httpx
import pytest

from cluster.router import Replica, Router, build_router
from mpk_runtime.engine import RequestFailedError


class SlowLoop:
    """An engine loop whose shutdown takes `delay` seconds (an engine process or Ray actors waited for), or raises."""

    def __init__(self, delay: float = 0.0, error: Exception | None = None, hang: threading.Event | None = None):
        self.delay, self.error, self.hang = delay, error, hang
        self.stopped = threading.Event()
        self.engine = self   # (Replica.engine / the router read loop.engine.dead)
        self.dead = None

    @property
    def alive(self) -> bool:
        return not self.stopped.is_set()

    load, stalled_s = 0, 0.0

    def stats(self) -> dict:
        return {"dead": None, "outstanding": 0, "stalled_s": 0.0}

    def shutdown(self) -> None:
        time.sleep(self.delay)
        if self.hang is not None:
            self.hang.wait(60)
        if self.error is not None:
            raise self.error
        self.stopped.set()


def test_a_shut_down_replica_reports_down_and_why(demo_dir):
    """After a replica (or the whole router) was shut down, its stats - what GET /health reads - still had
    dead=None: /health answered 200 "ok" for a router with nothing left running, and pick() still chose it."""
    from cluster.server import ServerThread, create_app
    router = build_router(demo_dir, executor="inprocess", num_replicas=2, dtype="float32", max_seq_len=64,
                          health_interval=None)
    srv = ServerThread(create_app(router))
    try:
        r0, r1 = router.replicas
        r0.shutdown()
        st = router.stats()
        assert st["replica-0"]["dead"] and "shut down" in st["replica-0"]["dead"], st["replica-0"]
        assert not st["replica-1"]["dead"]
        assert all(router.pick([1, 2, 3]) is r1 for _ in range(4))
        h = httpx.get(srv.url + "/health", timeout=30)
        assert h.status_code == 200 and h.json()["replicas"] == {"replica-0": False, "replica-1": True}, h.text
        router.shutdown()
        assert all("shut down" in s["dead"] for s in router.stats().values()), router.stats()
        h = httpx.get(srv.url + "/health", timeout=30)
        assert h.status_code == 503 and h.json()["status"] == "down", h.text
        with pytest.raises(RequestFailedError, match="shut down"):
            router.pick([1, 2, 3])
    finally:
        srv.stop()
        router.shutdown()


def test_an_engine_process_replica_says_it_was_shut_down(demo_dir):
    """An engine-process replica reported itself down after shutdown, but as "the engine process ... exited"
    (as a crash reads), not that it was shut down."""
    router = build_router(demo_dir, executor="inprocess", engine_process=True, dtype="float32", max_seq_len=64,
                          health_interval=None)
    router.shutdown()
    dead = router.stats()["replica-0"]["dead"]
    assert dead and "shut down" in dead, dead


def test_router_shuts_its_replicas_down_at_once():
    """Router.shutdown stopped replicas one after another: 4 replicas whose shutdown takes 0.5 s took 2 s."""
    loops = [SlowLoop(0.5) for _ in range(4)]
    router = Router([Replica(f"replica-{i}", None, lp) for i, lp in enumerate(loops)], "fake")
    t0 = time.monotonic()
    router.shutdown()
    took = time.monotonic() - t0
    assert all(lp.stopped.is_set() for lp in loops)
    assert took < 1.2, f"shutdown took {took:.2f} s for 4 x 0.5 s (serial would be 2 s)"


def test_a_failing_replica_shutdown_stops_no_other_and_is_reported():
    """Every replica is stopped even where one's shutdown raises; the error is raised after, naming the others."""
    loops = [SlowLoop(0.3), SlowLoop(0.1, RuntimeError("cannot stop r1")), SlowLoop(0.3),
             SlowLoop(0.2, ValueError("cannot stop r3"))]
    router = Router([Replica(f"replica-{i}", None, lp) for i, lp in enumerate(loops)], "fake")
    with pytest.raises(RuntimeError, match="cannot stop r1") as ei:
        router.shutdown()
    assert loops[0].stopped.is_set() and loops[2].stopped.is_set()
    if sys.version_info >= (3, 11):   # (add_note)
        assert "replica-3" in " ".join(getattr(ei.value, "__notes__", [])), ei.value
    st = router.stats()
    assert all(s["dead"] and "shut down" in s["dead"] for s in st.values()), st
    assert "cannot stop r1" in st["replica-1"]["dead"]


def test_router_shutdown_is_bounded_by_one_timeout():
    """A replica whose shutdown hangs holds the router's shutdown no longer than its timeout, and is reported."""
    hang = threading.Event()
    loops = [SlowLoop(0.0), SlowLoop(0.0, hang=hang), SlowLoop(0.0)]
    router = Router([Replica(f"replica-{i}", None, lp) for i, lp in enumerate(loops)], "fake")
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="replica-1"):
            router.shutdown(timeout=0.5)
        assert time.monotonic() - t0 < 5
        assert loops[0].stopped.is_set() and loops[2].stopped.is_set()
        assert "shut down" in router.stats()["replica-1"]["dead"]
    finally:
        hang.set()   # (its shutdown thread ends)
