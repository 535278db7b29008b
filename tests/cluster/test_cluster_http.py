"""The OpenAI-compatible server over in-process replicas: the `openai` client, SSE, errors, batching, metrics."""
import concurrent.futures as cf

import httpx
import pytest

from cluster.client import Client
from cluster.router import build_router
from cluster.server import ServerThread, create_app
from mpk_runtime.engine import (LLM, InvalidRequestError, NoTokenizerError, PromptTooLongError, RequestFailedError,
                                SamplingParams)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def local_llm(demo_dir):
    with LLM(demo_dir, dtype="float32", max_seq_len=64) as llm:
        yield llm


@pytest.fixture(scope="module")
def oai(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key="unused", max_retries=0)


def test_client_generate_equals_llm(server, local_llm):
    prompts = [[1, 2, 3], "hello world", [40, 41]]
    with Client(server[0].url) as c:
        got = c.generate(prompts, GREEDY)
    want = local_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert got[1].prompt_token_ids == want[1].prompt_token_ids
    assert all(o.finish_reason == "length" and o.metrics.time_to_first_token is not None for o in got)


def test_client_stream_equals_generate(server, local_llm):
    want = local_llm.generate([[5, 6, 7]], GREEDY)[0]
    with Client(server[0].url) as c:
        parts = list(c.stream([[5, 6, 7]], GREEDY))
    assert [t for p in parts for t in p.delta_token_ids] == want.token_ids
    assert parts[-1].finished and parts[-1].token_ids == want.token_ids


def test_openai_completions(oai, local_llm):
    want = local_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    r = oai.completions.create(model="tiny-qwen3-demo", prompt="hello world", max_tokens=6, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == len(want.prompt_token_ids)
    # token-id prompts and several prompts at once
    r = oai.completions.create(model="tiny-qwen3-demo", prompt=[[1, 2, 3], [4, 5]], max_tokens=3, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]


def test_openai_completions_stream(oai, local_llm):
    want = local_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    chunks = list(oai.completions.create(model="tiny-qwen3-demo", prompt="hello world", max_tokens=6,
                                         temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_chat_and_stream(oai, local_llm):
    tok = local_llm.tokenizer
    msgs = [{"role": "user", "content": "hello"}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    want = local_llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    r = oai.chat.completions.create(model="tiny-qwen3-demo", messages=msgs, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want.text
    chunks = list(oai.chat.completions.create(model="tiny-qwen3-demo", messages=msgs, max_tokens=6, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("body, word", [
    ({"prompt": 5}, "prompt"), ({"prompt": []}, "empty"), ({"prompt": [1, 2], "temperature": -1}, "temperature"),
    ({"prompt": [1, 2], "max_tokens": 0}, "max_tokens"), ({"prompt": [1, 2], "n": 0}, "n must be"),
    ({"prompt": [1, 2], "n": 65}, "n must be"), ({"prompt": [1, 2], "stop": [""]}, "stop must be"),
    ({"prompt": [1, 2], "logprobs": 21}, "logprobs must be"), ({"prompt": [1, 2], "logprobs": "x"}, "logprobs"),
    ({"prompt": [1, 2], "top_logprobs": 2}, "chat field"), ({"prompt": [1, 2], "presence_penalty": 3}, "presence"),
    ({"prompt": [1, 2], "repetition_penalty": 0}, "repetition_penalty"), ({"prompt": list(range(100))}, "context"),
    ({"prompt": [1, 10 ** 6]}, "token ids"), ({"prompt": [1], "model": "other"}, "not served"),
    ({"prompt": [1], "top_p": 2}, "top_p"), ({}, "prompt"),
])
def test_bad_inputs_get_4xx(server, body, word):
    r = httpx.post(server[0].url + "/v1/completions", json=body)
    assert 400 <= r.status_code < 500, r.text
    assert word in r.json()["error"]["message"]


def test_stop_strings_n_and_penalties_equal_llm(oai, local_llm):
    full = local_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    assert stop and stop in full.text
    want = local_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                              stop=stop))[0]
    assert want.finish_reason == "stop" and want.text == full.text[:full.text.index(stop)]
    r = oai.completions.create(model="tiny-qwen3-demo", prompt="hello world", max_tokens=12, temperature=0,
                               stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    chunks = list(oai.completions.create(model="tiny-qwen3-demo", prompt="hello world", max_tokens=12,
                                         temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want.text
    # n: seeded choices draw with seed + j, so choice j equals one request with that seed
    r = oai.completions.create(model="tiny-qwen3-demo", prompt=["hello", "world"], n=3, max_tokens=6,
                               temperature=1.0, seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == list(range(6))
    for i, c in enumerate(r.choices):
        one = local_llm.generate(["hello", "world"][i // 3], SamplingParams(temperature=1.0, seed=11 + i % 3,
                                                                           max_tokens=6, ignore_eos=True))[0]
        assert c.text == one.text
    assert len({c.text for c in r.choices[:3]}) > 1
    assert r.usage.prompt_tokens == sum(len(local_llm.tokenizer.encode(p)) for p in ("hello", "world"))
    assert r.usage.completion_tokens == 36
    # penalties reach the engine
    kw = dict(frequency_penalty=1.5, presence_penalty=0.5)
    want = local_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **kw))[0]
    r = oai.completions.create(model="tiny-qwen3-demo", prompt="hello world", max_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == want.text


def test_logprobs_completions_and_chat(oai, local_llm):
    tok = local_llm.tokenizer
    want = local_llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                              logprobs=2))[0]
    r = oai.completions.create(model="tiny-qwen3-demo", prompt="hello world", max_tokens=5, temperature=0,
                               logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and lp.tokens[0] == tok.decode([want.token_ids[0]])
    assert lp.token_logprobs == pytest.approx([next(iter(d.values())) for d in want.logprobs])
    # every position names its sampled token and the top 2, each under a name of its own (byte pieces that
    # decode to U+FFFD alone are named by their token strings)
    assert [len(d) for d in lp.top_logprobs] == [len(d) for d in want.logprobs]
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    chunks = list(oai.completions.create(model="tiny-qwen3-demo", prompt="hello world", max_tokens=5,
                                         temperature=0, logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(lp.token_logprobs)
    msgs = [{"role": "user", "content": "hello"}]
    r = oai.chat.completions.create(model="tiny-qwen3-demo", messages=msgs, max_tokens=4, temperature=0,
                                    logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    for c in content:   # greedy: the chosen token is the most likely one
        assert c.logprob == pytest.approx(c.top_logprobs[0].logprob) and c.logprob <= 0
        assert [a.logprob for a in c.top_logprobs] == sorted((a.logprob for a in c.top_logprobs), reverse=True)
    assert all(c.token in r.choices[0].message.content for c in content if c.bytes is not None)
    r = oai.chat.completions.create(model="tiny-qwen3-demo", messages=msgs, max_tokens=2, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].message.content == r.choices[1].message.content


def test_client_carries_stop_logprobs_and_penalties(server, local_llm):
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, frequency_penalty=1.0)
    full = local_llm.generate(["hello world"], sp)[0]
    sp_stop = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2, frequency_penalty=1.0,
                             stop=full.text[-4:-2], include_stop_str_in_output=True)
    want = local_llm.generate(["hello world"], sp_stop)[0]
    assert want.finish_reason == "stop" and len(want.token_ids) > 1
    with Client(server[0].url) as c:
        got = c.generate(["hello world"], sp_stop)[0]
        parts = list(c.stream(["hello world"], sp_stop))
    assert got.text == want.text and got.token_ids == want.token_ids and got.finish_reason == "stop"
    assert [list(d) for d in got.logprobs] == [list(d) for d in want.logprobs]
    assert [v for d in got.logprobs for v in d.values()] == pytest.approx(
        [v for d in want.logprobs for v in d.values()])
    assert parts[-1].token_ids == want.token_ids and parts[-1].text == want.text
    assert [list(d) for d in parts[-1].logprobs] == [list(d) for d in want.logprobs]


def test_bad_json_and_chat_errors(server):
    url = server[0].url
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


def test_chat_without_tokenizer_is_400():
    router = build_router("tiny-qwen3", executor="inprocess", dtype="float32", max_seq_len=64, health_interval=None)
    srv = ServerThread(create_app(router))
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        with Client(srv.url) as c:
            with pytest.raises(NoTokenizerError):
                c.generate(["text needs a tokenizer"])
            with pytest.raises(PromptTooLongError):
                c.generate([list(range(70))])
            with pytest.raises(InvalidRequestError):
                c.generate([[1]], SamplingParams(top_k=5, max_tokens=2, stop_token_ids=[10 ** 6]))
    finally:
        srv.stop()
        router.shutdown()


def test_concurrent_requests_share_decode_steps(server, local_llm):
    srv, router = server
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[i, i + 1] for i in range(1, 7)]
    with Client(srv.url) as c, cf.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda p: c.generate([p], sp)[0], prompts))
    want = local_llm.generate(prompts, sp, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert router.stats()["replica-0"]["max_batch_size_seen"] >= 2


def test_health_models_metrics(server):
    url = server[0].url
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "tiny-qwen3-demo"
    text = httpx.get(url + "/metrics").text
    for name in ("mpk_tokens_per_second", 'mpk_request_latency_seconds{quantile="0.99"}',
                 'mpk_queue_depth{replica="replica-0"}', "mpk_time_to_first_token_seconds_count",
                 'mpk_requests_total{status="rejected"}', 'mpk_multi_steps_total{replica="replica-0"}',
                 'mpk_multi_step_decode_steps_total{replica="replica-0"}',
                 'mpk_requests_full_sampled_total{replica="replica-0"}',
                 'mpk_requests_host_sampled_total{replica="replica-0"}'):
        assert name in text


def test_tiny_temperature_is_greedy_and_the_replica_keeps_serving(server, local_llm):
    """A temperature that overflows logits / T (1e-39) once killed the replica's engine thread: every later request
    hung while /health said ok. Below SAMPLING_EPS it is greedy (vLLM's cut-off), and the replica keeps serving."""
    want = local_llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    url = server[0].url
    for t in (1e-39, 1e-7):
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "temperature": t, "max_tokens": 4,
                                                       "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want.token_ids
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "temperature": 0.7, "seed": 2 ** 70,
                                                   "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text   # any int seed: its low 64 bits (as on device)
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_failing_sampler_fails_its_request_only(server, monkeypatch):
    """A step error must fail the requests it hits with an error, not kill the engine loop."""
    import mpk_runtime.engine.engine as eng

    def boom(*a, **k):
        raise RuntimeError("probability tensor contains nan")
    url = server[0].url
    monkeypatch.setattr(eng, "sample", boom)
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "temperature": 0.5, "max_tokens": 2,
                                                   "top_k": 0}, timeout=60)
    assert r.status_code == 503 and "sampling failed" in r.json()["error"]["message"]
    monkeypatch.undo()
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "temperature": 0.5, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert server[1].replicas[0].loop.alive


@pytest.mark.parametrize("body, word", [
    ({"prompt": [1], "logit_bias": {"five": 10}}, "logit_bias"), ({"prompt": [1], "best_of": 3}, "best_of"),
    ({"prompt": [1], "best_of": 0}, "best_of"),
    ({"prompt": [1], "logit_bias": {"5": 101}}, "logit_bias"), ({"prompt": [1], "min_p": 1.5}, "min_p"),
    ({"prompt": [1], "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"prompt": [1], "response_format": {"type": "json_object"}}, "response_format"),
    ({"prompt": [1], "suffix": "x"}, "suffix"),
])
def test_unsupported_or_invalid_openai_fields_are_400(server, body, word):
    r = httpx.post(server[0].url + "/v1/completions", json=body)
    assert r.status_code == 400 and word in r.json()["error"]["message"], r.text


def test_chat_non_text_parts_are_400(server):
    r = httpx.post(server[0].url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]})
    assert r.status_code == 400 and "content part" in r.json()["error"]["message"], r.text
    r = httpx.post(server[0].url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]})
    assert r.status_code == 400, r.text


def test_client_against_no_server_is_a_typed_error():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]   # closed again: nothing listens there
    with pytest.raises(RequestFailedError, match="cannot reach"):
        Client(f"http://127.0.0.1:{port}", timeout=5)


def test_explicit_max_tokens_past_the_context_is_400(server):
    url = server[0].url   # max_seq_len 64
    r = httpx.post(url + "/v1/completions", json={"prompt": list(range(1, 61)), "max_tokens": 10})
    assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", json={"prompt": list(range(1, 61)), "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"   # the default stops there


def test_json_errors_say_what_to_send(server):
    url = server[0].url
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": [1, 2', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": [1, 2]}')   # no content type
    assert r.status_code == 400 and "Content-Type" in r.json()["error"]["message"], r.text


def test_stream_chunks_carry_usage_null_and_the_prompt_ids(server):
    import json as _json
    url = server[0].url
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "stream": True,
                                                             "temperature": 0,
                                                             "stream_options": {"include_usage": True}}) as r:
        evs = [_json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" in e for e in evs) and evs[-1]["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in evs[:-1])
    with Client(url) as c:
        parts = list(c.stream([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3)))
    assert parts[-1].prompt_token_ids == [1, 2, 3]


def test_bursts_of_decode_steps_stream_through_the_server(demo_dir):
    """A backend that samples on the device (pyvm) runs bursts of decode steps by default: the SSE stream carries
    several tokens a chunk, and what the client assembles equals LLM.generate with one step per engine call."""
    router = build_router(demo_dir, backend="pyvm", executor="inprocess", dtype="float32", max_seq_len=64,
                          max_batch=4, health_interval=None)
    srv = ServerThread(create_app(router))
    try:
        with LLM(demo_dir, backend="pyvm", dtype="float32", max_seq_len=64, decode_steps=1) as llm:
            want = llm.generate([[1, 2, 3], "hello world"], GREEDY)
        with Client(srv.url) as c:
            got = c.generate([[1, 2, 3], "hello world"], GREEDY)
            parts = list(c.stream([[1, 2, 3]], GREEDY))
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.text for o in got] == [o.text for o in want]
        assert parts[-1].token_ids == want[0].token_ids and parts[-1].text == want[0].text
        assert any(len(p.delta_token_ids) > 1 for p in parts)          # bursts reached the client
        assert router.stats()["replica-0"]["multi_steps"] > 0
    finally:
        srv.stop()
        router.shutdown()


def test_prefix_caching_through_the_server(demo_dir):
    """--enable-prefix-caching: chats sharing a system message report cached prompt tokens in OpenAI's usage field,
    the router sends them to the replica that holds the prefix, /metrics counts the hits, and the answers equal an
    LLM without the cache."""
    router = build_router(demo_dir, backend="torch", executor="inprocess", dtype="float32", max_seq_len=128,
                          max_batch=4, num_replicas=2, health_interval=None, enable_prefix_caching=True)
    srv = ServerThread(create_app(router))
    system = {"role": "system", "content": "Be brief and kind."}
    try:
        with LLM(demo_dir, dtype="float32", max_seq_len=128) as llm:
            tok = llm.tokenizer
            usages, texts, wants = [], [], []
            for q in ("hello", "what is two plus two", "name a colour"):
                msgs = [system, {"role": "user", "content": q}]
                ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                                 add_special_tokens=False)
                wants.append(llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                                          use_tqdm=False)[0].text)
                r = httpx.post(srv.url + "/v1/chat/completions", json={
                    "model": "tiny-qwen3-demo", "messages": msgs, "max_tokens": 5, "temperature": 0,
                    "ignore_eos": True}, timeout=60).json()
                usages.append(r["usage"])
                texts.append(r["choices"][0]["message"]["content"])
        assert texts == wants
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
        assert cached[0] == 0 and cached[1] >= 16 and cached[2] >= 16
        stats = router.stats()
        assert sorted(s["prefix_cache_hit_tokens"] for s in stats.values()) == [0, cached[1] + cached[2]]
        metrics = httpx.get(srv.url + "/metrics").text
        assert "mpk_prefix_cache_hit_tokens_total{replica=" in metrics
        reset = httpx.post(srv.url + "/reset_prefix_cache").json()
        assert reset["reset"] and reset["cached_pages_dropped"] > 0
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "model": "tiny-qwen3-demo", "messages": msgs, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            timeout=60).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and r["choices"][0]["message"]["content"] == \
            wants[-1]
    finally:
        srv.stop()
        router.shutdown()


def test_preemption_through_the_server(demo_dir):
    """kv_allocation lazy (the default) on a replica with few KV pages: a batch of prompts in one request preempts,
    /metrics counts it, and every completion equals an LLM that reserves whole lengths (never preempts)."""
    kw = dict(backend="torch", dtype="float32", max_seq_len=64, max_batch=4, page_size=4, num_pages=12)
    router = build_router(demo_dir, executor="inprocess", num_replicas=1, health_interval=None, **kw)
    srv = ServerThread(create_app(router))
    prompts = [[3, 1, 4, 1, 5, 9], [2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2, 3, 8]]
    try:
        with LLM(demo_dir, kv_allocation="reserve", **kw) as llm:
            want = [o.text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30,
                                                                         ignore_eos=True), use_tqdm=False)]
            assert llm.engine.stats["preemptions"] == 0
        r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny-qwen3-demo", "prompt": prompts,
                                                          "max_tokens": 30, "temperature": 0, "ignore_eos": True},
                       timeout=60).json()
        assert [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])] == want
        metrics = httpx.get(srv.url + "/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith("mpk_preemptions_total{"))
        assert float(line.split()[-1]) > 0
        assert 'mpk_kv_pages_total{replica="replica-0"} 12' in metrics
    finally:
        srv.stop()
        router.shutdown()


def test_logit_bias_min_p_min_tokens_through_the_server(demo_dir):
    """OpenAI's logit_bias (string token ids) and vLLM's min_p / min_tokens reach the sampler: the completions equal
    LLM.generate's with the same SamplingParams, and a +100 bias makes every token the biased one."""
    router = build_router(demo_dir, backend="torch", executor="inprocess", dtype="float32", max_seq_len=64,
                          num_replicas=1, health_interval=None)
    srv = ServerThread(create_app(router))
    try:
        with LLM(demo_dir, backend="torch", dtype="float32", max_seq_len=64) as llm:
            sp = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={42: 100}),
                  SamplingParams(temperature=0.9, seed=4, max_tokens=8, min_p=0.2, min_tokens=8,
                                 logit_bias={42: -100, 43: 5})]
            want = llm.generate(["hello world"] * 2, sp, use_tqdm=False)
        assert want[0].token_ids == [42] * 5 and 42 not in want[1].token_ids and len(want[1].token_ids) == 8
        bodies = [{"prompt": "hello world", "temperature": 0, "max_tokens": 5, "ignore_eos": True,
                   "logit_bias": {"42": 100}},
                  {"prompt": "hello world", "temperature": 0.9, "seed": 4, "max_tokens": 8, "min_p": 0.2,
                   "min_tokens": 8, "logit_bias": {"42": -100, "43": 5}}]
        for body, w in zip(bodies, want):
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny-qwen3-demo", **body}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == w.text
    finally:
        srv.stop()
        router.shutdown()


def test_gil_switch_interval_from_the_environment(monkeypatch):
    """MPK_GIL_SWITCH_S sets the server process's GIL switch interval (the handlers share the GIL with the engine
    loop); unset keeps the interpreter's; a bad value is a clear error, not a silent default."""
    import sys
    router = build_router("tiny-qwen3", executor="inprocess", dtype="float32", max_seq_len=64, health_interval=None)
    old = sys.getswitchinterval()
    try:
        create_app(router)
        assert sys.getswitchinterval() == old
        monkeypatch.setenv("MPK_GIL_SWITCH_S", "0.0005")
        create_app(router)
        assert abs(sys.getswitchinterval() - 0.0005) < 1e-9
        monkeypatch.setenv("MPK_GIL_SWITCH_S", "-1")
        with pytest.raises(ValueError, match="MPK_GIL_SWITCH_S"):
            create_app(router)
    finally:
        sys.setswitchinterval(old)
        router.shutdown()


def test_inbox_wakes_the_loop_once_a_batch_and_keeps_order():
    """cluster.server._Inbox: outputs put from engine threads while the loop is busy cost one wake-up of the loop
    (one call_soon_threadsafe, a self-pipe write) for the whole batch, and reach each queue in the order put; the
    next output after the drain schedules the next one."""
    import asyncio
    import threading

    from cluster.server import _Inbox
    loop = asyncio.new_event_loop()
    wakes = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda cb, *a: (wakes.append(cb), real(cb, *a))[1]
    inbox = _Inbox(loop)
    qs = [asyncio.Queue(), asyncio.Queue()]

    def engine(k: int) -> None:
        for j in range(50):
            inbox.put(qs[k], (k, j))
    threads = [threading.Thread(target=engine, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wakes) == 1   # the loop never ran meanwhile: one drain holds all 100
    loop.run_until_complete(asyncio.sleep(0))
    for k in range(2):
        got = [qs[k].get_nowait() for _ in range(qs[k].qsize())]
        assert got == [(k, j) for j in range(50)]
    inbox.put(qs[0], "again")
    loop.run_until_complete(asyncio.sleep(0))
    assert len(wakes) == 2 and qs[0].get_nowait() == "again"
    loop.close()
