"""Admission limit of the HTTP server (--max-concurrent-requests, create_app(max_concurrent_requests=N)): past N
generation requests in flight a new one is refused at once with 429 (OpenAI's error shape, Retry-After), never
queued without bound; other endpoints are never refused; every way a request ends gives its slot back; the refusals
are counted on /metrics; cluster.Client raises ServerOverloadedError. Each test failed before the feature."""
import concurrent.futures as cf
import socket
import threading
import time

import httpx
import pytest

from cluster.client import Client, _raise_for
from cluster.server import ServerThread, build_parser, create_app
from mpk_runtime.engine import RequestFailedError, SamplingParams, ServerOverloadedError
from tests.cluster.test_client_stream import _record_submits, _wait_for
from tests.cluster.test_router_review import _parse

LIMIT = 2
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def limited(server):
    """A second app over the `server` fixture's router, admitting at most LIMIT generation requests at once."""
    app = create_app(server[1], max_concurrent_requests=LIMIT)
    srv = ServerThread(app)
    yield srv, app
    srv.stop()


@pytest.fixture
def held(server, monkeypatch):
    """The replica's engine steps wait for the returned `release` event (at most 30 s), then run 20 ms slower each;
    `submitted` lists the prompts the server queued, `ends` the finish reasons of those that ended."""
    router = server[1]
    engine = router.replicas[0].llm.engine
    real_step = engine.step
    release = threading.Event()

    def step():
        release.wait(30)
        time.sleep(0.02)
        return real_step()
    monkeypatch.setattr(engine, "step", step)
    submitted, ends = _record_submits(monkeypatch, router)
    yield release, submitted, ends
    release.set()


def _post(url: str, path: str = "/v1/completions", **body) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def _metric(url: str, key: str) -> float:
    return _parse(httpx.get(url + "/metrics").text)[0][key]


def _hold_two(pool, url: str, app, submitted):
    """Two generation requests (a completion and a chat completion) in flight: admitted and queued in the engine."""
    futs = [pool.submit(_post, url, prompt=[1, 2], max_tokens=3, temperature=0, ignore_eos=True),
            pool.submit(_post, url, "/v1/chat/completions", messages=CHAT, max_tokens=3, temperature=0)]
    assert _wait_for(lambda: len(submitted) == 2 and app.state.metrics.in_flight == 2, 20), (submitted,)
    return futs


def _assert_overloaded(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "overloaded" and err["param"] is None, err
    assert "--max-concurrent-requests" in err["message"] and "retry" in err["message"].lower(), err
    assert f"{LIMIT} " in err["message"], err   # (says the limit)
    assert r.headers["retry-after"] == "1"


def test_a_request_past_the_limit_is_429_and_other_endpoints_still_answer(limited, held):
    srv, app = limited
    release, submitted, ends = held
    before = _parse(httpx.get(srv.url + "/metrics").text)[0]
    with cf.ThreadPoolExecutor(2) as pool:
        futs = _hold_two(pool, srv.url, app, submitted)
        _assert_overloaded(_post(srv.url, prompt=[3, 4], max_tokens=2))
        _assert_overloaded(_post(srv.url, prompt=[3, 4], max_tokens=2, stream=True))
        _assert_overloaded(_post(srv.url, "/v1/chat/completions", messages=CHAT, max_tokens=2))
        _assert_overloaded(_post(srv.url, "/v1/chat/completions", messages=CHAT, max_tokens=2, stream=True))
        assert len(submitted) == 2   # (nothing of the refused ones reached the engine)
        # not generation: never refused
        assert httpx.get(srv.url + "/v1/models").status_code == 200
        assert httpx.get(srv.url + "/v1/models/tiny-qwen3-demo").status_code == 200
        assert httpx.get(srv.url + "/health").json()["status"] == "ok"
        during = _parse(httpx.get(srv.url + "/metrics").text)[0]
        assert during["mpk_requests_in_flight"] == 2
        assert during["mpk_requests_overloaded_total"] - before["mpk_requests_overloaded_total"] == 4
        # (a 429 for overload is no bad request: "rejected" stays as it was)
        assert during['mpk_requests_total{status="rejected"}'] == before['mpk_requests_total{status="rejected"}']
        release.set()
        assert [f.result().status_code for f in futs] == [200, 200], [f.result().text for f in futs]
    assert _wait_for(lambda: app.state.metrics.in_flight == 0, 10)
    assert _metric(srv.url, "mpk_requests_in_flight") == 0
    # the slots are free again: two at once are admitted
    with cf.ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda p: _post(srv.url, prompt=p, max_tokens=2, temperature=0), [[5], [6]]))
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]


def test_without_a_limit_nothing_is_refused(server, held):
    """The default (no --max-concurrent-requests): today's behaviour, every request is queued."""
    srv, _router = server
    release, submitted, _ends = held
    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(_post, srv.url, prompt=[i, 2], max_tokens=2, temperature=0) for i in range(1, 5)]
        assert _wait_for(lambda: len(submitted) == 4, 20), submitted
        assert _metric(srv.url, "mpk_requests_in_flight") == 4
        release.set()
        assert [f.result().status_code for f in futs] == [200] * 4
    assert _metric(srv.url, "mpk_requests_overloaded_total") == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1], "n": 0}),                          # HTTPError (sampling_params)
    ("/v1/completions", {"prompt": [1], "temperature": "0"}),              # RequestValidationError (pydantic)
    ("/v1/completions", {"prompt": [1], "echo": True}),                    # HTTPError (the prompt)
    ("/v1/completions", {"prompt": list(range(1, 80))}),                   # PromptTooLongError (engine.validate)
    ("/v1/completions", {"prompt": [1], "max_tokens": 500}),               # explicit max_tokens past the context
    ("/v1/completions", {"prompt": [1], "model": "nope"}),                 # 404
    ("/v1/chat/completions", {"messages": []}),                            # HTTPError (chat)
])
def test_a_bad_request_gives_its_slot_back(limited, path, body):
    srv, app = limited
    for _ in range(LIMIT + 2):   # (a slot kept by each would refuse the third with 429)
        r = _post(srv.url, path, **body)
        assert r.status_code in (400, 404), r.text
    assert app.state.metrics.in_flight == 0
    assert _post(srv.url, prompt=[1, 2], max_tokens=2).status_code == 200


def test_a_body_that_is_not_json_gives_its_slot_back(limited):
    srv, app = limited
    for _ in range(LIMIT + 2):
        r = httpx.post(srv.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
    assert app.state.metrics.in_flight == 0


def test_an_abandoned_stream_gives_its_slot_back(limited, held):
    srv, app = limited
    release, submitted, ends = held
    common = {"max_tokens": 40, "ignore_eos": True, "temperature": 0, "stream": True}   # (chat: 18 prompt tokens)
    body = {"prompt": [1, 2], **common}
    for path, b in (("/v1/completions", body), ("/v1/chat/completions", {"messages": CHAT, **common})):
        release.clear()
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", path, json=b) as r:
                assert r.status_code == 200
                assert _wait_for(lambda: len(submitted) >= 1, 10)
            # (the client left before any token: leaving the `with` closed the connection)
        release.set()   # (the next chunk finds the client gone: the server aborts the request)
        assert _wait_for(lambda: len(ends) == 1, 20), ends
        assert ends == ["abort"], ends   # (40 tokens at >= 20 ms: it was abandoned, not finished)
        assert _wait_for(lambda: app.state.metrics.in_flight == 0, 10), app.state.metrics.in_flight
        submitted.clear()
        ends.clear()
    # and a non-streaming request whose client gave up waiting
    release.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=httpx.Timeout(30, read=0.5))
    release.set()
    assert _wait_for(lambda: app.state.metrics.in_flight == 0, 20), app.state.metrics.in_flight
    with cf.ThreadPoolExecutor(2) as pool:
        rs = list(pool.map(lambda p: _post(srv.url, prompt=p, max_tokens=2, temperature=0), [[5], [6]]))
    assert [r.status_code for r in rs] == [200, 200], [r.text for r in rs]


def test_an_engine_failure_gives_its_slot_back(limited, monkeypatch):
    """503s (a sampler that raises; a replica that takes no request) and a stream's error event free their slots."""
    import mpk_runtime.engine.engine as eng
    srv, app = limited
    router = limited[1].state.router

    def boom(*a, **k):
        raise RuntimeError("probability tensor contains nan")
    monkeypatch.setattr(eng, "sample", boom)
    failing = {"prompt": [1, 2], "temperature": 0.5, "max_tokens": 2, "top_k": 0}
    for _ in range(LIMIT + 1):
        r = _post(srv.url, **failing)
        assert r.status_code == 503 and "sampling failed" in r.json()["error"]["message"], r.text
        r = _post(srv.url, **failing, stream=True)
        assert r.status_code == 200 and '"RequestFailedError"' in r.text, r.text
    monkeypatch.undo()

    def down(*a, **k):
        raise RequestFailedError("every replica is down")
    monkeypatch.setattr(router, "submit", down)
    for _ in range(LIMIT + 1):
        assert _post(srv.url, prompt=[1, 2], max_tokens=2).status_code == 503
    monkeypatch.undo()
    assert app.state.metrics.in_flight == 0
    assert _post(srv.url, prompt=[1, 2], max_tokens=2).status_code == 200


def test_the_client_raises_server_overloaded_error(limited, held):
    srv, app = limited
    release, submitted, _ends = held
    sp = SamplingParams(temperature=0, max_tokens=2)
    with cf.ThreadPoolExecutor(2) as pool:
        futs = _hold_two(pool, srv.url, app, submitted)
        with Client(srv.url) as c:   # (its GET /v1/models is never refused)
            with pytest.raises(ServerOverloadedError) as ei:
                c.generate([[1, 2]], sp)
            assert isinstance(ei.value, RequestFailedError)   # (the runtime's side: retrying later may succeed)
            assert "429" in str(ei.value) and "--max-concurrent-requests" in str(ei.value), ei.value
            with pytest.raises(ServerOverloadedError, match="--max-concurrent-requests"):
                list(c.stream([[1, 2]], sp))
        release.set()
        assert [f.result().status_code for f in futs] == [200, 200]


def test_the_client_maps_any_429_to_server_overloaded_error():
    import mpk_runtime
    assert mpk_runtime.ServerOverloadedError is ServerOverloadedError
    with pytest.raises(ServerOverloadedError, match="Too Many Requests"):
        _raise_for(429, "<html>Too Many Requests</html>")   # (a proxy's page)
    with pytest.raises(ServerOverloadedError, match="busy"):
        _raise_for(429, {"error": {"message": "busy", "type": "rate_limit_error", "code": "overloaded"}})


def test_the_cli_flag_parses_and_refuses_what_is_no_limit(capsys):
    ap = build_parser()
    assert ap.parse_args(["--model", "m"]).max_concurrent_requests is None   # (default: no limit)
    assert ap.parse_args(["--model", "m", "--max-concurrent-requests", "8"]).max_concurrent_requests == 8
    for bad in ("-1", "0", "two"):
        with pytest.raises(SystemExit):
            ap.parse_args(["--model", "m", "--max-concurrent-requests", bad])
        err = capsys.readouterr().err
        assert "--max-concurrent-requests" in err and "positive" in err and "leave the flag out" in err, err
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        create_app(object(), max_concurrent_requests=0)


def test_main_passes_the_flag_to_the_app(monkeypatch):
    import uvicorn

    import cluster.router
    import cluster.server as server_mod

    class FakeRouter:
        model_name = "m"
        tokenizer = None

        def shutdown(self):
            pass
    seen = {}
    monkeypatch.setattr(cluster.router, "build_router", lambda *a, **k: FakeRouter())
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.setdefault("app", self.config.app))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server_mod.main(["--model", "m", "--port", str(port), "--max-concurrent-requests", "3"])
    assert seen["app"].state.max_concurrent_requests == 3
