"""Review 4 of the HTTP serving layer as an OpenAI user sees it: each test failed before its fix (cluster/server.py,
protocol.py, openai_params.py, client.py)."""
import socket

import httpx
import pytest

from cluster.client import Client
from cluster.server import ServerThread
from mpk_runtime.engine import RequestFailedError, SamplingParams

CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": [1, 2], "n": True}, "n"),
    ("/v1/completions", {"prompt": [1, 2], "n": 2.0}, "n"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "seed": True}, "seed"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": "0"}, "temperature"),
    ("/v1/completions", {"prompt": [1, 2], "top_p": True}, "top_p"),
    ("/v1/completions", {"prompt": [1, 2], "stream": "true"}, "stream"),
    ("/v1/completions", {"prompt": [1, 2], "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/completions", {"prompt": [1, 2], "logprobs": 2.0}, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2], "truncate_max_tokens": "true"}, "truncate_max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "truncate_max_tokens": 1}, "truncate_max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "truncate_max_tokens": 0}, "truncate_max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": True}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 2.0}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "stream_options": {"include_usage": "yes"}},
     "include_usage"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True, "stream_options": {"include_usage": 1}},
     "include_usage"),
])
def test_values_of_the_wrong_json_type_are_400_naming_the_field(server, path, body, field):
    """pydantic's lax mode served `"n": true` as n=1, `"n": 2.0` as 2, `"max_tokens": true` as one token,
    `"temperature": "0"` as greedy, `"stream": "true"` as a stream, chat `"logprobs": 1` as true and a stream_options
    include_usage of "yes" as true; OpenAI answers each with a 400 naming the parameter (its `param`), so a client bug
    surfaces instead of being served as something it did not say."""
    r = httpx.post(server[0].url + path, json={"max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["type"] == "invalid_request_error", err
    assert err["param"] is not None and field in err["param"], err


def test_json_numbers_still_take_ints_for_floats(server):
    """(The strict types above keep what JSON cannot tell apart: an int where a float goes.)"""
    url = server[0].url
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "temperature": 0, "top_p": 1,
                                                  "presence_penalty": 0, "seed": -3, "n": 2, "logprobs": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "temperature": 1,
                                                       "logprobs": True, "top_logprobs": 2, "stream": True,
                                                       "stream_options": {"include_usage": False}}, timeout=60)
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text


@pytest.mark.parametrize("method, path, status", [
    ("GET", "/v1/nothing", 404), ("POST", "/v1/embeddings", 404), ("GET", "/v1/completions", 405),
    ("DELETE", "/v1/models", 405),
])
def test_unknown_routes_and_methods_answer_an_openai_error_body(server, method, path, status):
    """A path or method the server does not have answered FastAPI's {"detail": "Not Found"}, which OpenAI clients
    cannot read as an error (no error.message / type / code); it is the OpenAI shape, naming the path."""
    r = httpx.request(method, server[0].url + path)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert path in err["message"] and err["type"] == "invalid_request_error", err


def test_models_retrieve_one_model(server):
    """GET /v1/models/{model} (the openai SDK's `client.models.retrieve`) was a 404 for the served model itself;
    it answers the model's card, and an unknown id a 404 with code model_not_found."""
    srv, router = server
    r = httpx.get(srv.url + "/v1/models/tiny-qwen3-demo")
    assert r.status_code == 200, r.text
    assert r.json() == httpx.get(srv.url + "/v1/models").json()["data"][0]
    r = httpx.get(srv.url + "/v1/models/other-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    openai = pytest.importorskip("openai")
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    assert oai.models.retrieve("tiny-qwen3-demo").id == "tiny-qwen3-demo"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("other-model")


def _fake_server(events: list[str], crash: bool = False) -> ServerThread:
    """An OpenAI-looking server whose /v1/completions stream sends `events` (SSE data lines) and then ends (or,
    with crash, breaks the connection mid-body)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(_req):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(_req):
        async def body():
            for e in events:
                yield f"data: {e}\n\n"
            if crash:
                raise RuntimeError("the server went away mid-stream")
        return StreamingResponse(body(), media_type="text/event-stream")
    return ServerThread(Starlette(routes=[Route("/v1/models", models),
                                          Route("/v1/completions", completions, methods=["POST"])]))


CHUNK = ('{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "a", "token_ids": [5], '
         '"finish_reason": null, "prompt_token_ids": [1, 2]}]}')


def test_client_stream_cut_short_is_an_error_not_a_short_answer():
    """A stream that ends without its finish_reason chunk and "data: [DONE]" (a proxy's read timeout, a server
    that went away between chunks) ended Client.stream quietly: the caller took a truncated answer for a whole
    one. It raises RequestFailedError saying the stream ended early."""
    srv = _fake_server([CHUNK])
    try:
        with Client(srv.url) as c:
            got = []
            with pytest.raises(RequestFailedError, match="ended before"):
                for out in c.stream([[1, 2]], SamplingParams(max_tokens=4)):
                    got.append(out)
            assert [o.delta_token_ids for o in got] == [[5]] and not got[-1].finished
    finally:
        srv.stop()


def test_client_stream_broken_mid_body_does_not_say_the_server_cannot_be_reached():
    """A connection that breaks mid-stream raised "cannot reach the mpk-runtime server ... is it running and is
    the address right?", sending the user to check an address that had just answered; the error says the response
    was cut off."""
    srv = _fake_server([CHUNK], crash=True)
    try:
        with Client(srv.url) as c:
            with pytest.raises(RequestFailedError) as ei:
                list(c.stream([[1, 2]], SamplingParams(max_tokens=4)))
        msg = str(ei.value)
        assert "cannot reach" not in msg and "broke" in msg and srv.url in msg, msg
    finally:
        srv.stop()


def test_serve_refuses_a_port_in_use_before_loading_the_model(monkeypatch):
    """A port already in use was uvicorn's 'address already in use' after the model had loaded (minutes for an 8B
    model); the server binds first and says what to do."""
    import socket
    from cluster import router as router_mod
    from cluster import server as server_mod
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")
    monkeypatch.setattr(router_mod, "build_router", no_load)
    try:
        with pytest.raises(SystemExit) as e:
            server_mod.main(["--model", "tiny-qwen3", "--port", str(port)])
        assert f"cannot listen on 127.0.0.1:{port}" in str(e.value.code) and "another --port" in str(e.value.code)
        with pytest.raises(SystemExit, match="1-65535"):
            server_mod.main(["--model", "tiny-qwen3", "--port", "70000"])
    finally:
        held.close()


def test_start_up_errors_are_one_line_and_ctrl_c_is_a_clean_exit(monkeypatch, capsys):
    """(session 74, Ray user audit) An unknown --model printed a traceback at start-up, as did a Ray address nobody
    answers and replicas the cluster cannot hold; each is now "error: ..." and exit code 2, as the jobs CLI. Ctrl+C
    (uvicorn re-raises the KeyboardInterrupt after its shutdown) ends with 0 and the router shut down, no traceback."""
    import uvicorn

    import cluster.router as router_mod
    from cluster import server as server_mod
    from cluster.ray_executor import PlacementError
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    assert server_mod.main(["--model", "no-such-model", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no-such-model" in err and "Traceback" not in err

    def cannot_place(*a, **k):
        raise PlacementError("3 replicas of tp=1 need 3 x {'GPU': 1}: run --replicas 2 or fewer")
    monkeypatch.setattr(router_mod, "build_router", cannot_place)
    assert server_mod.main(["--model", "tiny-qwen3", "--port", port]) == 2
    assert "--replicas 2 or fewer" in capsys.readouterr().err

    class FakeRouter:
        model_name = "m"
        tokenizer = None
        down = False

        def shutdown(self):
            FakeRouter.down = True

    def interrupted(self, sockets=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(router_mod, "build_router", lambda *a, **k: FakeRouter())
    monkeypatch.setattr(uvicorn.Server, "run", interrupted)
    assert server_mod.main(["--model", "m", "--port", port]) == 0 and FakeRouter.down


def test_a_damaged_tokenizer_is_a_start_up_error(demo_dir, tmp_path, capsys):
    """(session 75) A model directory whose tokenizer.json is damaged started serving, then answered every request
    (token-id prompts too: the engine needs the EOS ids) with a 400 blaming the client. Now the server loads the
    tokenizer at start-up: one line naming it, exit 2, the port given back."""
    import shutil

    from cluster import server as server_mod
    d = tmp_path / "demo-broken-tokenizer"
    shutil.copytree(demo_dir, d)
    (d / "tokenizer.json").write_text("{not json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert server_mod.main(["--model", str(d), "--port", str(port), "--executor", "inprocess",
                            "--no-engine-process"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tokenizer" in err and str(d) in err and "Traceback" not in err
    with socket.socket() as s:   # (given back)
        s.bind(("127.0.0.1", port))

