"""stop_reason over HTTP (vLLM's server field; session 76): each choice, streamed or not, completions and chat, says
which stop token id or stop string ended it (null otherwise), and cluster.Client's outputs carry it."""
import json

import httpx

from mpk_runtime.engine import SamplingParams


def _post(srv, path, body):
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def test_choices_say_what_stopped_them(server):
    srv, _ = server
    base = {"prompt": [5, 6, 7], "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    (full,) = _post(srv, "/v1/completions", base)
    assert full["finish_reason"] == "length" and full["stop_reason"] is None
    tok = full["token_ids"][3]
    (c,) = _post(srv, "/v1/completions", {**base, "stop_token_ids": [tok]})
    assert c["finish_reason"] == "stop" and c["stop_reason"] == tok
    stop = full["text"][1:3]
    (c,) = _post(srv, "/v1/completions", {**base, "stop": stop})
    assert c["finish_reason"] == "stop" and c["stop_reason"] == stop
    # streamed: the last chunk of the choice
    with httpx.stream("POST", srv.url + "/v1/completions", json={**base, "stop_token_ids": [tok], "stream": True},
                      timeout=60) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    assert chunks[-1]["choices"][0]["stop_reason"] == tok
    assert all(ch["choices"][0]["stop_reason"] is None for ch in chunks[:-1])
    chat = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    (m,) = _post(srv, "/v1/chat/completions", chat)
    (m2,) = _post(srv, "/v1/chat/completions", {**chat, "stop_token_ids": [m["token_ids"][2]]})
    assert m["stop_reason"] is None and m2["stop_reason"] == m["token_ids"][2]


def test_client_outputs_carry_it(server):
    from cluster.client import Client
    srv, _ = server
    with Client(srv.url) as c:
        full = c.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        tok = full.token_ids[3]
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop_token_ids=[tok])
        assert c.generate([[5, 6, 7]], sp)[0].outputs[0].stop_reason == tok
        assert list(c.stream([[5, 6, 7]], sp))[-1].stop_reason == tok
        assert full.stop_reason is None
