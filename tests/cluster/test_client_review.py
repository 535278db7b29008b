"""Review of cluster/client.py against LLM.generate: each test failed before its fix (cluster/client.py, server.py,
protocol.py)."""
import os
import subprocess
import sys
import threading

import httpx
import pytest

from cluster.client import Client
from mpk_runtime.engine import InvalidRequestError, SamplingParams
from tests.cluster.test_cluster_http import local_llm  # noqa: F401  (the fixture: LLM over the demo model, ctx 64)

NEAR = list(range(1, 61))   # 60 prompt tokens: 4 more fit the server fixture's (and local_llm's) 64-token context
PAST = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


# --- max_tokens past the context ------------------------------------------------------------------------------

def test_client_max_tokens_past_the_context_stops_there_as_llm_generate(server, local_llm):  # noqa: F811
    """LLM.generate caps max_tokens at the context (finish_reason "length"); Client.generate and Client.stream sent
    max_tokens explicitly, which the server answers with OpenAI's 400 when it does not fit: a Client user near the
    context got InvalidRequestError where LLM.generate answered. The client asks for the cap (truncate_max_tokens)."""
    want = local_llm.generate([NEAR], PAST, use_tqdm=False)[0]
    assert want.finish_reason == "length" and len(want.token_ids) == 4, want
    with Client(server[0].url) as c:
        got = c.generate([NEAR, [1, 2, 3]], PAST)
        parts = list(c.stream([NEAR], PAST))
    assert got[0].finish_reason == "length" and got[0].token_ids == want.token_ids, got[0]
    assert len(got[1].token_ids) == 10   # (a prompt with room gets its whole max_tokens)
    assert parts[-1].finished and parts[-1].finish_reason == "length" and parts[-1].token_ids == want.token_ids


def test_truncate_max_tokens_is_opt_in_and_plain_openai_requests_keep_the_400(server, local_llm):  # noqa: F811
    url = server[0].url
    want = local_llm.generate([NEAR], PAST, use_tqdm=False)[0].token_ids
    body = {"prompt": NEAR, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    for extra in ({}, {"truncate_max_tokens": False}):
        r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=60)
        assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", json={**body, "truncate_max_tokens": True}, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and c["token_ids"] == want, c
    r = httpx.post(url + "/v1/completions", json={**body, "truncate_max_tokens": True, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"length"' in r.text, r.text
    # chat takes it too (CommonRequest): max_completion_tokens past the context after the chat prompt
    msgs = [{"role": "user", "content": "hi " * 10}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 1}, timeout=60)
    room = 64 - r.json()["usage"]["prompt_tokens"]
    assert 0 < room < 60, r.text
    past = {"messages": msgs, "max_completion_tokens": room + 5, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=past, timeout=60)
    assert r.status_code == 400 and f"at most {room}" in r.text, r.text
    r = httpx.post(url + "/v1/chat/completions", json={**past, "truncate_max_tokens": True}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert r.json()["usage"]["completion_tokens"] == room, r.text


# --- a failed prompt among several ----------------------------------------------------------------------------

def _client_with(one) -> Client:
    """A Client (no server: model given, so nothing is asked at construction) whose requests are `one`."""
    c = Client("http://127.0.0.1:9", model="fake", max_parallel=4)
    c._one = one
    return c


def test_client_generate_raises_a_failed_prompt_while_others_are_still_in_flight():
    """Client.generate cancelled the prompts not sent yet when one failed, but leaving its ThreadPoolExecutor's
    `with` waited for every request in flight: the error reached the caller only after all the others had been
    generated (minutes) and thrown away. It is raised as soon as that request fails."""
    in_flight, release = threading.Event(), threading.Event()

    def one(prompt, sp, rid, index=0):
        if prompt == [1]:
            assert in_flight.wait(60)
            raise InvalidRequestError("prompt 0 is bad")
        in_flight.set()
        release.wait(120)   # held until the test has seen the error
        return rid

    c = _client_with(one)
    got = {}

    def call():
        try:
            got["out"] = c.generate([[1], [2], [3]], SamplingParams(max_tokens=2))
        except Exception as e:   # noqa: BLE001
            got["err"] = e

    t = threading.Thread(target=call, daemon=True)
    t.start()
    try:
        t.join(timeout=60)   # (a guard only: the error comes as soon as prompt 0 fails)
        assert not t.is_alive(), "generate waited for the requests in flight before raising the failed one"
        assert isinstance(got.get("err"), InvalidRequestError) and "prompt 0" in str(got["err"]), got
        assert not release.is_set()
    finally:
        release.set()
        c.close()


EXIT_ON_ERROR = """
import threading
from cluster.client import Client
from mpk_runtime.engine import SamplingParams
in_flight = threading.Event()

def one(prompt, sp, rid, index=0):
    if prompt == [1]:
        assert in_flight.wait(60)
        raise ValueError("prompt 0 is bad")
    in_flight.set()
    threading.Event().wait()   # a request that never answers

c = Client("http://127.0.0.1:9", model="fake")
c._one = one
c.generate([[1], [2]], SamplingParams(max_tokens=2))
"""


def test_a_program_that_stops_on_a_failed_prompt_does_not_wait_for_the_others():
    """(The same at the program's end: the threads of a ThreadPoolExecutor are joined at the interpreter's exit, so
    a script that stopped on the error still waited for every request in flight, up to the client's timeout.)"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", EXIT_ON_ERROR], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "ValueError: prompt 0 is bad" in r.stderr, r.stderr[-2000:]


def test_client_generate_returns_outputs_in_prompt_order_whatever_order_they_finish_in():
    """(The success path as before: the outputs in prompt order, here finishing last to first.)"""
    done = [threading.Event() for _ in range(4)]

    def one(prompt, sp, rid, index=0):
        i = int(rid)
        if i + 1 < len(done):
            assert done[i + 1].wait(60)
        done[i].set()
        return (rid, prompt)

    c = _client_with(one)
    try:
        assert c.generate([[i + 1] for i in range(4)], SamplingParams(max_tokens=2)) == \
            [(str(i), [i + 1]) for i in range(4)]
    finally:
        c.close()
