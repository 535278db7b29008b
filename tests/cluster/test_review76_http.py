"""Two differences from vLLM's server the session 76 audit found: `"stop": ""` was served as no stop string (while
`[""]` was a 400; vLLM refuses both), and a request for another model that also used an unsupported field was a
400 about the field (vLLM answers 404 for the model first)."""
import time

import httpx
import pytest

C, CH = "/v1/completions", "/v1/chat/completions"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body", [(C, {"prompt": "hi", "stop": ""}), (C, {"prompt": "hi", "stop": [""]}),
                                        (CH, {"messages": CHAT, "stop": ""})])
def test_an_empty_stop_string_is_refused(server, path, body):
    r = httpx.post(server[0].url + path, json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop"


@pytest.mark.parametrize("path, body", [(C, {"prompt": "hi", "echo": True}), (C, {"prompt": "hi", "n": 0}),
                                        (CH, {"messages": CHAT, "reasoning_effort": "low"})])
def test_another_model_is_a_404_whatever_else_the_request_asks(server, path, body):
    r = httpx.post(server[0].url + path, json={"max_tokens": 2, "model": "gpt-4o", **body}, timeout=60)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["param"] == "model"


def test_a_failed_completion_aborts_its_siblings_at_once(demo_dir, monkeypatch):
    """n=3 without stream, completion 1 failing at its first token: the 503 came only after completions 0 and 2 ran
    to their ends (their tokens thrown away; a stream aborted them already). Now they are aborted as it fails."""
    import mpk_runtime.engine.engine as eng
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    real, bad = eng.sample, 4242

    def sample(logits, params, seed, pos):
        if seed == bad:
            raise ValueError("injected bad logits")
        return real(logits, params, seed, pos)
    monkeypatch.setattr(eng, "sample", sample)
    router = build_router(demo_dir, executor="inprocess", dtype="float32", max_seq_len=64, max_batch=8,
                          health_interval=None)
    app = create_app(router)
    srv = ServerThread(app)
    try:
        r = httpx.post(srv.url + C, json={"prompt": [5, 6, 7], "n": 3, "seed": bad - 1, "temperature": 1.0,
                                          "max_tokens": 50, "ignore_eos": True}, timeout=60)
        assert r.status_code == 503 and "injected bad logits" in r.text, r.text
        for _ in range(100):   # (the aborts reach the engine loop a moment later)
            if app.state.metrics.requests["aborted"] == 2:
                break
            time.sleep(0.05)
        assert app.state.metrics.requests["aborted"] == 2, app.state.metrics.requests
        assert app.state.metrics.requests["finished"] == 0
    finally:
        srv.stop()
        router.shutdown()
