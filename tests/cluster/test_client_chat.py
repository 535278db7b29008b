"""Client.chat: the LLM.chat interface over the HTTP server's /v1/chat/completions."""
import pytest

from cluster.client import Client
from mpk_runtime.engine import InvalidRequestError, NoTokenizerError, SamplingParams

from test_cluster_http import local_llm  # noqa: F401  (the module fixture: an LLM of the demo model)

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
FOUR = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)   # (TURNS renders to 59 of the 64)
HELLO = [{"role": "user", "content": "hello"}]
TURNS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello"}, {"role": "user", "content": "the quick brown fox"}]


def test_client_chat_equals_llm_chat(server, local_llm):  # noqa: F811
    with Client(server[0].url) as c:
        one = c.chat(HELLO, GREEDY)
        two = c.chat([HELLO, TURNS], GREEDY)
    want = local_llm.chat([HELLO, TURNS], GREEDY)
    assert len(one) == 1 and one[0].text == want[0].text and one[0].token_ids == want[0].token_ids
    assert [o.text for o in two] == [o.text for o in want]
    assert [o.token_ids for o in two] == [o.token_ids for o in want]
    assert [o.request_id for o in two] == ["0", "1"]
    assert all(o.finished and o.finish_reason == "length" for o in two)
    assert [o.metrics.num_prompt_tokens for o in two] == [len(o.prompt_token_ids) for o in want]


def test_client_chat_sends_the_sampling_fields(server, local_llm):  # noqa: F811
    """max_tokens past the context stops at it (truncate_max_tokens, as LLM.chat), stop strings and per-conversation
    params reach the server."""
    long = SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    with Client(server[0].url) as c:
        got = c.chat([HELLO, TURNS], [long, GREEDY])
        want = local_llm.chat([HELLO, TURNS], [long, GREEDY])
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert got[0].finish_reason == "length" and len(got[0].token_ids) == 64 - len(want[0].prompt_token_ids)
        until = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)   # None: until the context
        assert c.chat(HELLO, until)[0].token_ids == local_llm.chat(HELLO, until)[0].token_ids
        biased = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logit_bias={42: 100})
        assert c.chat(HELLO, biased)[0].token_ids == [42] * 3


def test_client_chat_errors_are_typed(server):
    with Client(server[0].url) as c:
        with pytest.raises(InvalidRequestError, match="usr"):
            c.chat([{"role": "usr", "content": "hi"}], GREEDY)
        with pytest.raises(InvalidRequestError, match="empty"):
            c.chat([], GREEDY)


def test_client_chat_without_a_tokenizer_is_no_tokenizer_error():
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router("tiny-qwen3", executor="inprocess", dtype="float32", max_seq_len=64, health_interval=None)
    srv = ServerThread(create_app(router))
    try:
        with Client(srv.url) as c:
            with pytest.raises(NoTokenizerError, match="tokenizer"):
                c.chat(HELLO, GREEDY)
    finally:
        srv.stop()
        router.shutdown()


def _sse_events(url: str, body: dict) -> list[dict]:
    import json

    import httpx
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_chat_response_carries_prompt_token_ids_and_metrics(server, local_llm):  # noqa: F811
    """Each chat choice carries the completions choices' extensions: prompt_token_ids (the rendered conversation's
    ids, as LLM.chat's) and metrics (the same keys, with time_to_first_token)."""
    import httpx
    url = server[0].url
    want = local_llm.chat(TURNS, FOUR)[0]
    body = {"messages": TURNS, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    cmpl = httpx.post(url + "/v1/completions", json={"prompt": want.prompt_token_ids, "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60).json()
    keys = set(cmpl["choices"][0]["metrics"])
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for c in out["choices"]:
        assert c["prompt_token_ids"] == want.prompt_token_ids
        assert c["token_ids"] == want.token_ids
        m = c["metrics"]
        assert set(m) == keys
        assert isinstance(m["time_to_first_token"], float) and m["time_to_first_token"] >= 0
        assert isinstance(m["per_token_latency"], float) and m["per_token_latency"] >= 0
        assert m["num_prompt_tokens"] == len(want.prompt_token_ids) and m["num_generated_tokens"] == 4
    assert out["usage"]["prompt_tokens"] == len(want.prompt_token_ids)   # (unchanged: counted once for n=2)


def test_client_chat_fills_prompt_token_ids_and_timings(server, local_llm):  # noqa: F811
    want = local_llm.chat([HELLO, TURNS], GREEDY)
    with Client(server[0].url) as c:
        got = c.chat([HELLO, TURNS], GREEDY)
    assert [o.prompt_token_ids for o in got] == [o.prompt_token_ids for o in want]
    for o in got:
        m = o.metrics
        assert m.first_token_time is not None and m.time_to_first_token >= 0
        assert m.finish_time is not None and m.finish_time >= m.first_token_time
        assert m.per_token_latency is not None and m.per_token_latency >= 0
        assert m.num_prompt_tokens == len(o.prompt_token_ids) and m.num_generated_tokens == len(o.token_ids)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_streaming_chat_first_and_last_chunk_carry_prompt_token_ids(server, local_llm):  # noqa: F811
    """As a streamed completion's: each choice's first chunk (the role chunk) and its last carry prompt_token_ids."""
    want = local_llm.chat(TURNS, FOUR)[0]
    evs = _sse_events(server[0].url + "/v1/chat/completions",
                      {"messages": TURNS, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "n": 2,
                       "stream": True, "stream_options": {"include_usage": True}})
    for j in range(2):
        mine = [e["choices"][0] for e in evs if e["choices"] and e["choices"][0]["index"] == j]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[0]["prompt_token_ids"] == want.prompt_token_ids
        assert mine[-1]["finish_reason"] == "length" and mine[-1]["prompt_token_ids"] == want.prompt_token_ids
        assert sum((c.get("token_ids") or [] for c in mine), []) == want.token_ids
    assert evs[-1]["usage"]["prompt_tokens"] == len(want.prompt_token_ids)


LP2 = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)


def _same_logprobs(got, want):
    """As the completions tests: the same ids a position (in order, the sampled one first), values approx."""
    assert got is not None and len(got) == len(want)
    assert [list(d) for d in got] == [list(d) for d in want]
    assert [v for d in got for v in d.values()] == pytest.approx([v for d in want for v in d.values()], abs=1e-5)


def test_client_chat_returns_logprobs(server, local_llm):  # noqa: F811
    """Client.chat with SamplingParams(logprobs=n) sends logprobs: true, top_logprobs: n and reads the chat
    choices' logprobs_by_id extension into RequestOutput.logprobs, as Client.generate does (was refused)."""
    zero = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=0)
    with Client(server[0].url) as c:
        got = c.chat([HELLO, TURNS], LP2)
        got0 = c.chat(HELLO, zero)[0]
        plain = c.chat(HELLO, FOUR)[0]
    want = local_llm.chat([HELLO, TURNS], LP2)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        assert len(g.logprobs) == 4 and all(len(d) >= 2 for d in g.logprobs)
        _same_logprobs(g.logprobs, w.logprobs)
    _same_logprobs(got0.logprobs, local_llm.chat(HELLO, zero)[0].logprobs)
    assert all(len(d) == 1 for d in got0.logprobs)   # (logprobs=0: the sampled token's only)
    assert plain.logprobs is None


def test_chat_response_carries_logprobs_by_id(server, local_llm):  # noqa: F811
    """A chat choice with logprobs carries logprobs_by_id ([[token id, logprob], ...] a position, as a completion
    choice's), beside OpenAI's logprobs.content (unchanged); without logprobs, neither."""
    import httpx
    url = server[0].url
    want = local_llm.chat(TURNS, LP2)[0]
    body = {"messages": TURNS, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    rows = c["logprobs_by_id"]
    _same_logprobs([{t: v for t, v in row} for row in rows], want.logprobs)
    assert [row[0][0] for row in rows] == c["token_ids"] == want.token_ids   # (the sampled token first)
    content = c["logprobs"]["content"]
    assert set(c["logprobs"]) == {"content"} and len(content) == 4
    for e, row in zip(content, rows):
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert e["logprob"] == row[0][1] and len(e["top_logprobs"]) == 2
        assert all(set(a) == {"token", "logprob", "bytes"} for a in e["top_logprobs"])
    r = httpx.post(url + "/v1/chat/completions", json={k: v for k, v in body.items() if "logprobs" not in k},
                   timeout=60)
    c = r.json()["choices"][0]
    assert c["logprobs"] is None and "logprobs_by_id" not in c


def test_streaming_chat_chunks_carry_logprobs_by_id(server, local_llm):  # noqa: F811
    """As a streamed completion's chunks: each content chunk with logprobs carries its positions' logprobs_by_id."""
    want = local_llm.chat(TURNS, LP2)[0]
    evs = _sse_events(server[0].url + "/v1/chat/completions",
                      {"messages": TURNS, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                       "logprobs": True, "top_logprobs": 2, "stream": True})
    chunks = [e["choices"][0] for e in evs if e["choices"]]
    assert "logprobs_by_id" not in chunks[0]   # (the role chunk: no tokens, logprobs null)
    rows = [row for ch in chunks[1:] for row in ch["logprobs_by_id"]]
    _same_logprobs([{t: v for t, v in row} for row in rows], want.logprobs)
    content = [e for ch in chunks[1:] for e in ch["logprobs"]["content"]]
    assert [e["logprob"] for e in content] == [row[0][1] for row in rows]
