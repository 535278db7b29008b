"""Review 5: the server, Client and jobs CLI as a demanding user sees them; each test failed before its fix
(cluster/protocol.py, openai_params.py, server.py, client.py, jobs/generate.py)."""
import json

import httpx
import pytest

from cluster.client import Client
from mpk_runtime.engine import SamplingParams
from tests.cluster.test_job_resume import one_go  # noqa: F401  (the jobs' fixture: an input and its one-go output)

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 2], "n": None}),
    ("/v1/completions", {"prompt": [1, 2], "stream": None}),
    ("/v1/completions", {"prompt": [1, 2], "echo": None}),
    ("/v1/chat/completions", {"messages": CHAT, "n": None, "stream": None}),
])
def test_openai_nullable_fields_take_null_as_their_default(server, path, body):
    """OpenAI's schema has n, stream and echo nullable (null: the default), and the openai SDK sends null for an
    argument passed as None (`create(..., n=None)`); they were a 400 ("Input should be a valid integer")."""
    r = httpx.post(server[0].url + path, json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 200, r.text
    d = r.json()
    assert len(d["choices"]) == 1 and d["object"] in ("text_completion", "chat.completion"), d


def test_client_outputs_say_how_much_of_the_prompt_came_from_the_prefix_cache(demo_dir):
    """Client.generate / stream / chat returned num_cached_tokens=0 whatever the server's cache served (the server
    said it only in the request's usage); each output now carries it, as LLM.generate's does."""
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router(demo_dir, backend="torch", executor="inprocess", dtype="float32", max_seq_len=64,
                          max_batch=4, page_size=4, health_interval=None, enable_prefix_caching=True)
    srv = ServerThread(create_app(router))
    try:
        c = Client(srv.url)
        prompt = list(range(1, 14))   # three whole pages of 4, then one token
        sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        assert c.generate([prompt], sp)[0].num_cached_tokens == 0
        assert c.generate([prompt], sp)[0].num_cached_tokens == 12
        assert list(c.stream([prompt], sp))[-1].num_cached_tokens == 12
        c.chat(CHAT, sp)
        assert c.chat(CHAT, sp)[0].num_cached_tokens > 0
    finally:
        srv.stop()
        router.shutdown()


def _resume_with_changed_rows(tmp_path, one_go, changes: dict, kept: int):
    """The one-go output's first `kept` lines and its run record, and the input with ROWS[i] updated by
    changes[i]: (input, output)."""
    from tests.cluster.test_job_resume import ROWS, _copy
    _, full = one_go
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({**r, **changes.get(i, {})}) + "\n" for i, r in enumerate(ROWS)]
    inp.write_text("".join(lines[:2]) + "\n" + "".join(lines[2:]))   # (one_go's blank line: default ids count lines)
    _copy(full, out, kept)
    return inp, out


def test_resume_refuses_kept_results_whose_sampling_fields_changed(tmp_path, one_go, monkeypatch, capsys):
    """--resume checked a kept result's id and prompt against its input line, not its sampling fields: an input
    whose max_tokens / temperature changed for lines already written was resumed silently, the file ending with
    results of both settings. It is refused before the model loads, naming the line, the fields and what to do."""
    from tests.cluster.test_job_resume import _no_model, _run
    inp, out = _resume_with_changed_rows(tmp_path, one_go, {1: {"max_tokens": 3, "temperature": 0}}, kept=3)
    before = out.read_bytes()
    loaded = _no_model(monkeypatch)
    assert _run(inp, out, "--resume") == 2
    err = capsys.readouterr().err
    assert f"{inp}:2" in err and "max_tokens" in err and "temperature" in err, err
    assert "without --resume" in err, err
    assert not loaded and out.read_bytes() == before


def test_resume_takes_sampling_changes_past_the_kept_results_and_equal_spellings(tmp_path, one_go):
    """(Not over-eager: a line not written yet may change, and a kept line's fields may be spelled otherwise with
    the same meaning: 0 as 0.0, a default given explicitly.)"""
    from tests.cluster.test_job_resume import ROWS, _results, _run
    inp, out = _resume_with_changed_rows(tmp_path, one_go, {2: {"temperature": 0.0, "top_k": 0, "stop": None},
                                                            4: {"max_tokens": 2}}, kept=3)
    assert _run(inp, out, "--resume") == 0
    rows = _results(out)
    assert len(rows) == len(ROWS) and len(rows[4]["token_ids"]) == 2


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 1000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 1000}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 50}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 3}, "presence_penalty"),
])
def test_out_of_range_sampling_values_name_their_field(server, path, body, param):
    """A value of the right type but out of range (max_tokens 0, past the context, temperature -1, top_p 0, ...)
    answered a 400 with param null, where the docs (and OpenAI) name the field at fault."""
    r = httpx.post(server[0].url + path, json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_a_body_that_is_not_utf8_says_so(server):
    """A JSON body in another encoding (Latin-1 "h\\xe9llo") answered "/v1/completions: There was an error parsing
    the body" with code "400": it says the body is not UTF-8 and what to send, and counts as a rejected request."""
    url = server[0].url
    before = _rejected(url)
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "h\xe9llo", "max_tokens": 2}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "UTF-8" in err["message"] and err["type"] == "invalid_request_error", err
    assert err["code"] == "InvalidRequestError", err   # (as a body that is not JSON: Client raises the same)
    assert _rejected(url) == before + 1


def _rejected(url) -> float:
    line = next(x for x in httpx.get(url + "/metrics").text.splitlines()
                if x.startswith('mpk_requests_total{status="rejected"}'))
    return float(line.split()[-1])
