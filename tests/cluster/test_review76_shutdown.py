"""Ctrl+C / SIGTERM with requests in flight (session 76): uvicorn cancelled their handlers as its loop closed - a
CancelledError traceback a request in the log, a non-streaming client answered 500 "Internal Server Error", an engine
thread's late output a "RuntimeError: Event loop is closed" traceback. Now the server drains first: each request in
flight is aborted and answered 503 "shutting down" (a stream: an error event, then [DONE])."""
import asyncio
import json
import threading
import time

import httpx

from cluster.server import SHUTTING_DOWN, _Inbox

LONG = {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True}   # (seconds on this CPU)


def test_requests_in_flight_are_answered_shutting_down(demo_dir):
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router(demo_dir, executor="inprocess", dtype="float32", max_seq_len=512, max_batch=8,
                          health_interval=None)
    srv = ServerThread(create_app(router))
    got = {}

    def plain():
        got["plain"] = httpx.post(srv.url + "/v1/completions", json=LONG, timeout=60)

    def stream():
        with httpx.stream("POST", srv.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
            got["stream"] = [x for x in r.iter_lines() if x.startswith("data: ")]
    try:
        ts = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in ts:
            t.start()
        for _ in range(200):   # (both admitted: the engine holds two requests)
            if sum(s["outstanding"] for s in router.stats().values()) == 2:
                break
            time.sleep(0.01)
        srv.stop()
        for t in ts:
            t.join(30)
        r = got["plain"]
        assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
        assert r.json()["error"]["message"] == SHUTTING_DOWN
        lines = got["stream"]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["code"] == "server_shutting_down"
        assert all(s["outstanding"] == 0 for s in router.stats().values())
    finally:
        srv.stop()
        router.shutdown()


def test_an_output_after_the_loop_closed_is_dropped_quietly():
    loop = asyncio.new_event_loop()
    inbox = _Inbox(loop)
    loop.close()
    inbox.put(asyncio.Queue(), (0, None))   # (raised RuntimeError: Event loop is closed, logged by the engine thread)
