"""Review of the HTTP serving layer: each test failed before its fix (cluster/server.py, protocol.py, client.py)."""
import json
import threading
import time

import httpx

from cluster.client import Client
from mpk_runtime.engine import RequestFailedError, SamplingParams


def test_chat_without_max_tokens_runs_to_the_context(server):
    """OpenAI's chat has no max_tokens default (docs/serving.md: "the default (16, none for chat) stops at the
    context"): a chat that leaves it out generates until the context is full, not 16 tokens."""
    url = server[0].url   # max_seq_len 64
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == 64, u
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_client_sends_logit_bias_min_p_and_min_tokens(server):
    """Client.generate / stream take an LLM's SamplingParams: logit_bias, min_p and min_tokens must reach the server
    (they were left out of the request body, so the completion ignored them)."""
    url = server[0].url
    with Client(url) as c:
        biased = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={42: 100})
        assert c.generate([[1, 2, 3]], biased)[0].token_ids == [42] * 5
        assert list(c.stream([[1, 2, 3]], biased))[-1].token_ids == [42] * 5
        greedy = c.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
        # min_p = 1: only the most likely token survives, so any temperature draws the greedy tokens
        hot = SamplingParams(temperature=1.5, seed=1, max_tokens=8, ignore_eos=True, min_p=1.0)
        assert c.generate([[1, 2, 3]], hot)[0].token_ids == greedy
        # min_tokens: the stop token (greedy's first) cannot end the request before 3 tokens
        stop_first = SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[greedy[0]], min_tokens=3)
        assert len(c.generate([[1, 2, 3]], stop_first)[0].token_ids) >= 3


def test_chat_template_refusing_the_messages_is_400(server, monkeypatch):
    """A chat template that raises on the messages (Llama / Mistral: "roles must alternate", Qwen: "no user query")
    is the request's fault: 400 with the template's message, not a 500 "internal error, please report it"."""
    srv, router = server
    monkeypatch.setattr(router.tokenizer, "chat_template",
                        "{{ raise_exception('Conversation roles must alternate user/assistant') }}")
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"},
                                                                         {"role": "user", "content": "b"}]})
    assert r.status_code == 400, r.text
    assert "roles must alternate" in r.json()["error"]["message"]


def test_a_failed_submit_aborts_the_prompts_already_queued(server, monkeypatch):
    """A batch of prompts whose second submission fails (its replica died after the pick) answers 503; the first
    prompt, already queued, must be aborted, not left running for a client that got an error."""
    srv, router = server
    engine = router.replicas[0].llm.engine
    real_step, real_submit = engine.step, router.submit

    def slow_step():   # (50 tokens take >= 2.5 s: an abort sent at once lands long before the request ends)
        time.sleep(0.05)
        return real_step()
    ends, ended, calls = [], threading.Event(), []

    def submit(ids, sp, cb, **kw):
        calls.append(ids)
        if len(calls) > 1:
            raise RequestFailedError("replica replica-0 is down: its engine loop exited")

        def record(out):
            cb(out)
            if out.finished:
                ends.append(out.finish_reason)
                ended.set()
        return real_submit(ids, sp, record, **kw)
    monkeypatch.setattr(engine, "step", slow_step)
    monkeypatch.setattr(router, "submit", submit)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [[1, 2], [3, 4]], "max_tokens": 50,
                                                      "ignore_eos": True}, timeout=60)
    assert r.status_code == 503, r.text
    assert ended.wait(20)
    assert ends == ["abort"]


def test_a_stream_that_fails_midway_ends_with_the_error_then_done(server, monkeypatch):
    """A request that fails after its first chunks (its replica died) streams the error event and then [DONE], as
    every other stream ends, so a client reading to [DONE] stops there."""
    from mpk_runtime.engine.request import RequestOutput
    srv, router = server
    real_submit = router.submit

    def submit(ids, sp, cb, **kw):
        seen = []

        def fail_second(out):
            seen.append(out)
            if len(seen) == 2 and not out.finished:
                out = RequestOutput.failed(out.request_id, out.prompt, out.prompt_token_ids, "replica-0 exited")
            if len(seen) <= 2:
                cb(out)
        return real_submit(ids, sp, fail_second, **kw)
    monkeypatch.setattr(router, "submit", submit)
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60,
                      json={"prompt": [1, 2, 3], "max_tokens": 20, "ignore_eos": True, "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert '"error"' in events[-2] and "replica-0 exited" in events[-2], events[-3:]
    assert events[-1] == "[DONE]"


def test_prompt_token_ids_are_ints_not_coerced_bools_or_floats(server):
    """pydantic's lax mode read `"prompt": [true, false]` as token ids [1, 0] and [1.0, 2.0] as [1, 2]; a token id is
    an integer, so anything else is a 400 that says what to send (and nothing is queued)."""
    url = server[0].url
    for bad in ([True, False], [1.0, 2.0], [[1, True]], [1, "2"]):
        r = httpx.post(url + "/v1/completions", json={"prompt": bad, "max_tokens": 2})
        assert r.status_code == 400, (bad, r.text)
        assert "prompt" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text


def test_stream_options_without_stream_is_400(server):
    """OpenAI answers 400 to stream_options on a request that does not stream (include_usage is a streaming
    option); the server ignored it, so a client asking for usage chunks silently got none."""
    url = server[0].url
    for path, body in (("/v1/completions", {"prompt": "a"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
        r = httpx.post(url + path, json={**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert r.status_code == 400, r.text
        assert "stream_options" in r.json()["error"]["message"]
        r = httpx.post(url + path, json={**body, "max_tokens": 2, "stream": True,
                                         "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text


def test_chat_message_roles_are_checked(server):
    """A message role outside OpenAI's set (a typo: "usr", "assistent") went to the chat template as is, which
    either dropped the message or rendered it under a role the model never saw; it is a 400 naming the roles."""
    url = server[0].url
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "usr", "content": "hi"}],
                                                        "max_tokens": 2})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "usr" in msg and "user" in msg and "assistant" in msg, msg
    ok = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": ok, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_request_no_replica_takes_counts_as_failed(server, monkeypatch):
    """A 503 because the replica is down (router.submit raised) was counted nowhere in mpk_requests_total: neither
    failed nor rejected, so an outage left the request counters flat."""
    srv, router = server

    def metric():
        text = httpx.get(srv.url + "/metrics").text
        return int(next(l for l in text.splitlines() if l.startswith('mpk_requests_total{status="failed"}')).split()[-1])
    before = metric()

    def down(*a, **k):
        raise RequestFailedError("replica r0 is down: test")
    monkeypatch.setattr(router, "submit", down)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 503, r.text
    assert metric() == before + 1


def test_a_streamed_string_prompt_carries_its_token_ids_from_the_first_chunk(server):
    """The tokenised prompt is known before the first token: each choice's first streamed chunk carries its
    prompt_token_ids (vLLM's place for them), and every output of Client.stream has them (they were sent only with
    the last chunk, so Client.stream gave a string prompt prompt_token_ids [] until its last output)."""
    url = server[0].url
    prompts = ["hello world", "the quick brown fox"]
    body = {"prompt": prompts, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    want = [c["prompt_token_ids"] for c in httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"]]
    assert all(want) and want[0] != want[1]
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json={**body, "stream": True}) as r:
        chunks = [c for line in r.iter_lines() if line.startswith("data: {")
                  for c in json.loads(line[6:])["choices"]]
    for i in range(len(prompts)):
        mine = [c for c in chunks if c["index"] == i]
        assert len(mine) > 1 and mine[0]["finish_reason"] is None
        assert mine[0].get("prompt_token_ids") == want[i], mine[0]
        assert mine[-1].get("prompt_token_ids") == want[i]   # (still on the last, as documented before)
    with Client(url) as c:
        outs = list(c.stream(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    assert len(outs) > 1 and all(o.prompt_token_ids == want[0] and o.metrics.num_prompt_tokens == len(want[0])
                                 for o in outs), [o.prompt_token_ids for o in outs]
