"""Two differences from vLLM's server the session 76 audit found: `"stop": ""` was served as no stop string (while
`[""]` was a 400; vLLM refuses both), and a request for another model that also used an unsupported field was a
400 about the field (vLLM answers 404 for the model first)."""
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
