"""--max-request-bytes (session 75): a request body past the limit is answered 413 with OpenAI's error body naming
the limit and the flag, before it is read whole (a Content-Length past it at once; a chunked body once the bytes read
pass it), not held in memory and parsed. Bodies within it are served as before."""
import json

import httpx
import pytest


@pytest.fixture(scope="module")
def small_server():
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router("tiny-qwen3", executor="inprocess", dtype="float32", max_seq_len=64, health_interval=None)
    srv = ServerThread(create_app(router, max_request_bytes=4096))
    yield srv
    srv.stop()
    router.shutdown()


def test_a_body_past_the_limit_is_413(small_server):
    url = small_server.url + "/v1/completions"
    ok = httpx.post(url, json={"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}, timeout=30)
    assert ok.status_code == 200, ok.text
    big = {"prompt": [1] * 3000, "max_tokens": 2}   # (~9 KB of JSON)
    r = httpx.post(url, json=big, timeout=30)
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
    assert "--max-request-bytes" in r.json()["error"]["message"]

    def chunks():   # (no Content-Length: counted as it is read)
        body = json.dumps(big).encode()
        for i in range(0, len(body), 1000):
            yield body[i:i + 1000]
    r = httpx.post(url, content=chunks(), headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 413, r.text
    assert httpx.post(url, json={"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}, timeout=30).json()[
        "choices"][0]["token_ids"] == ok.json()["choices"][0]["token_ids"]


def test_the_limit_is_checked():
    from cluster.server import create_app
    with pytest.raises(ValueError, match="max_request_bytes"):
        create_app(None, max_request_bytes=0)
