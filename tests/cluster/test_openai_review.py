"""Review of the HTTP server as a user porting an application from OpenAI's API / vLLM's OpenAI server sees it: each
test failed before its fix (cluster/server.py, protocol.py, openai_params.py)."""
import threading
import time

import httpx
import pytest

CHAT = [{"role": "user", "content": "hi"}]
C, CH = "/v1/completions", "/v1/chat/completions"


def _post(server, path, body):
    return httpx.post(server[0].url + path, json={"max_tokens": 2, **body}, timeout=60)


@pytest.mark.parametrize("path, body, param", [
    (C, {"prompt": "hi", "echo": True}, "echo"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": ""}, "prompt"),
    (C, {"prompt": [[1], []]}, "prompt"),
    (C, {"prompt": [999999]}, "prompt"),
    (C, {"prompt": list(range(1, 70))}, "prompt"),
    (C, {"prompt": [1], "stop_token_ids": [999999]}, "stop_token_ids"),
    (C, {"prompt": [1], "logit_bias": {"999999": 1}}, "logit_bias"),
    (CH, {"messages": []}, "messages"),
    (CH, {"messages": [{"role": "user", "content": "hello " * 80}]}, "messages"),
    (CH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content"),
    # a user / system turn without content (OpenAI refuses it; it was rendered as an empty turn)
    (CH, {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    (CH, {"messages": [{"role": "system", "content": "be brief"}, {"role": "user"}]}, "messages[1].content"),
    (CH, {"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
])
def test_every_400_names_its_parameter(server, path, body, param):
    """These 400s said what was wrong but answered `param: null` (OpenAI's error.param names the field at fault, and
    clients show or branch on it): echo, an empty or out-of-vocabulary prompt, one past the context, stop_token_ids /
    logit_bias past the vocabulary (the engine's checks), an empty conversation or one with an image part."""
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_engine_check_400s_keep_their_error_code(server):
    """(The param above is added without changing the code cluster.Client maps to its exception types.)"""
    r = _post(server, C, {"prompt": list(range(1, 70))})
    assert r.json()["error"]["code"] == "PromptTooLongError", r.text


@pytest.mark.parametrize("path, body, param", [
    # vLLM's extensions this server does not implement: each changes the tokens, the text or the response
    (C, {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    (C, {"prompt": "hi", "prompt_logprobs": 1}, "prompt_logprobs"),
    (C, {"prompt": "hi", "allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    (C, {"prompt": "hi", "bad_words": ["dog"]}, "bad_words"),
    (C, {"prompt": "hi", "guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    (C, {"prompt": "hi", "structured_outputs": {"choice": ["a", "b"]}}, "structured_outputs"),
    (C, {"prompt": "hi", "truncate_prompt_tokens": 1}, "truncate_prompt_tokens"),
    (C, {"prompt": "hi", "skip_special_tokens": False}, "skip_special_tokens"),
    (C, {"prompt": "hi", "add_special_tokens": False}, "add_special_tokens"),
    (C, {"prompt": "hi", "return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
    (C, {"prompt": "hi", "logits_processors": ["x"]}, "logits_processors"),
    (C, {"prompt": "hi", "prompt_embeds": "AAAA"}, "prompt_embeds"),
    (C, {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    (CH, {"messages": CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    (CH, {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    (CH, {"messages": CHAT, "add_generation_prompt": False}, "add_generation_prompt"),
    (CH, {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
    (CH, {"messages": CHAT, "echo": True}, "echo"),
    (CH, {"messages": CHAT, "documents": [{"title": "a", "text": "b"}]}, "documents"),
    (CH, {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    # OpenAI's
    (CH, {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    (CH, {"messages": CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    (CH, {"messages": CHAT, "web_search_options": {}}, "web_search_options"),
    (CH, {"messages": CHAT, "reasoning_effort": "low"}, "reasoning_effort"),
    # an assistant turn's tool calls: the template was given the turn without them (an empty assistant message)
    (CH, {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "1"}]}, "messages[1].tool_calls"),
    (CH, {"messages": [*CHAT, {"role": "assistant", "content": None,
                               "function_call": {"name": "f", "arguments": "{}"}}]}, "messages[1].function_call"),
])
def test_fields_that_would_change_the_answer_are_refused_not_ignored(server, path, body, param):
    """Unknown fields are ignored, as vLLM ignores them; but these ask for something this server does not do (a
    beam search, prompt logprobs, a token allow-list, grammar, another chat template or its kwargs, special tokens in
    the text, no BOS, audio, ...) and were served as if absent: an answer the client did not ask for, with no sign of
    it. Each is a 400 naming it now."""
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[-1].split("[")[0] in err["message"], err


@pytest.mark.parametrize("path, body", [
    (C, {"prompt": "hi", "use_beam_search": False, "skip_special_tokens": True, "add_special_tokens": True,
         "bad_words": [], "return_tokens_as_token_ids": False, "prompt_logprobs": None, "truncate_prompt_tokens": None,
         "spaces_between_special_tokens": True, "length_penalty": 1.0, "priority": 0, "user": "u1"}),
    (C, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}),
    (CH, {"messages": CHAT, "add_generation_prompt": True, "continue_final_message": False, "echo": False,
          "add_special_tokens": False, "chat_template_kwargs": {}, "modalities": ["text"], "parallel_tool_calls": False,
          "store": False, "metadata": {"a": "b"}, "user": "u1", "service_tier": "auto"}),
    (CH, {"messages": [*CHAT, {"role": "assistant", "content": "hello", "tool_calls": []},
                       {"role": "user", "content": "and?", "name": "bob"}]}),
])
def test_the_values_that_change_nothing_are_still_taken(server, path, body):
    """(Clients that always send these fields, at their defaults, are served as before.)"""
    r = _post(server, path, body)
    assert r.status_code == 200, r.text


def test_a_long_prompt_is_tokenized_off_the_event_loop(server, monkeypatch):
    """A long text prompt was tokenized (and a chat rendered) on the server's event loop: a 12 MB prompt held every
    other request, streams included, for ~10 s on this machine before its own 400 (PromptTooLongError). A slow
    tokenization of one long prompt no longer stops /health from answering."""
    engine = server[1].engine
    real = type(engine).tokenize
    started = threading.Event()

    def slow(self, text):
        if len(text) > 20000:
            started.set()
            time.sleep(2.0)   # (as the Rust tokenizer does, without the GIL)
        return real(self, text)
    monkeypatch.setattr(type(engine), "tokenize", slow)
    res = {}
    th = threading.Thread(target=lambda: res.setdefault("r", _post(server, C, {"prompt": "hello " * 5000})))
    th.start()
    assert started.wait(30)
    t = time.monotonic()
    assert httpx.get(server[0].url + "/health", timeout=60).status_code == 200
    waited = time.monotonic() - t
    th.join(60)
    assert waited < 1.0, f"/health waited {waited:.2f} s behind a tokenization"
    assert res["r"].status_code == 400 and res["r"].json()["error"]["code"] == "PromptTooLongError", res["r"].text


def test_a_body_nested_too_deeply_says_so(server):
    """A JSON body nested past the parser's depth answered "/v1/completions: There was an error parsing the body"
    with code "400"; it says what was wrong now, with the code other bad bodies have."""
    body = b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    r = httpx.post(server[0].url + C, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "nested too deeply" in err["message"] and err["code"] == "InvalidRequestError", err


def test_a_message_name_is_taken_or_refused(server):
    """(session 75) a message's name goes to the chat template (tests/engine/test_chat_name.py); a non-string 400s."""
    import httpx
    url = server[0].url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi", "name": "ada"}], "max_tokens": 2, "temperature": 0}
    assert httpx.post(url, json=body, timeout=30).status_code == 200
    bad = httpx.post(url, json={**body, "messages": [{"role": "user", "content": "hi"}, {"role": "user", "content": "x",
                                                                                       "name": 3}]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[1].name", bad.json()
