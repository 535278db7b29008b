"""Client.stream as LLM.stream: the requests of one call run concurrently (up to max_parallel), their snapshots
interleave (told apart by request_id), a failed request is raised at once, and a caller that stops early stops the
others. Each test failed before the fix (cluster/client.py streamed the prompts one request after another)."""
import asyncio
import json
import threading
import time

import pytest

from cluster.client import Client
from cluster.server import ServerThread
from mpk_runtime.engine import RequestFailedError, SamplingParams
from tests.cluster.test_cluster_http import local_llm  # noqa: F401  (the fixture: LLM over the demo model, ctx 64)

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("mpk-client-stream")]


def _wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _watch_submits(monkeypatch, router, gate_at: int | None = None, step_delay: float = 0.0):
    """Records each request the server submits (its prompt) and how it ended; with gate_at, the engine's steps wait
    (at most 10 s) until that many requests were submitted; step_delay slows every step."""
    engine = router.replicas[0].llm.engine
    real_step = engine.step
    all_in = threading.Event()

    def step():
        if gate_at is not None and not all_in.wait(10):
            all_in.set()   # (the requests came one after another: the later steps need not wait)
        if step_delay:
            time.sleep(step_delay)
        return real_step()

    def on_submit(submitted):
        if gate_at is not None and len(submitted) >= gate_at:
            all_in.set()
    monkeypatch.setattr(engine, "step", step)
    return _record_submits(monkeypatch, router, on_submit)


def _record_submits(monkeypatch, router, on_submit=None):
    """router.submit patched to record each submitted prompt (`submitted`) and each finish reason (`ends`);
    on_submit(submitted) runs after each submission is recorded."""
    real_submit = router.submit
    submitted, ends = [], []

    def submit(ids, sp, cb, **kw):
        submitted.append(list(ids))
        if on_submit is not None:
            on_submit(submitted)

        def record(out):
            cb(out)
            if out.finished:
                ends.append(out.finish_reason)
        return real_submit(ids, sp, record, **kw)
    monkeypatch.setattr(router, "submit", submit)
    return submitted, ends


# --- the requests of one call run concurrently ----------------------------------------------------------------

def test_client_stream_runs_the_prompts_concurrently_and_interleaves_their_snapshots(server, local_llm,  # noqa: F811
                                                                                     monkeypatch):
    """Client.stream sent prompt 2's request only after prompt 1's stream had ended, so the server could not batch
    them (N prompts took ~N times LLM.stream's time). Its requests now run at once: snapshots of prompts 1 and 2
    arrive before prompt 0's last, and each request's cumulative fields are LLM.generate's."""
    srv, router = server
    prompts = [[1, 2, 3], "hello world", [40, 41]]
    want = local_llm.generate(prompts, GREEDY, use_tqdm=False)
    submitted, _ = _watch_submits(monkeypatch, router, gate_at=3)   # (the first step waits for all three)
    with Client(srv.url) as c:
        parts = list(c.stream(prompts, GREEDY))
        gen = c.generate(prompts, GREEDY)
    assert len(submitted) == 6
    order = [p.request_id for p in parts]
    first_final = next(k for k, p in enumerate(parts) if p.request_id == "0" and p.finished)
    assert {"1", "2"} & set(order[:first_final]), order
    assert sorted(set(order)) == ["0", "1", "2"]
    for i, w in enumerate(want):
        mine = [p for p in parts if p.request_id == str(i)]
        assert [p.finished for p in mine] == [False] * (len(mine) - 1) + [True], (i, mine)
        last = mine[-1]
        assert last.token_ids == w.token_ids == gen[i].token_ids, i
        assert last.text == w.text == gen[i].text, i
        assert last.finish_reason == "length" and last.prompt_token_ids == w.prompt_token_ids, i
        assert [t for p in mine for t in p.delta_token_ids] == w.token_ids, i
        assert "".join(p.delta_text for p in mine) == w.text, i
        # cumulative fields grow request by request, not across requests
        for a, b in zip(mine, mine[1:]):
            assert b.token_ids[:len(a.token_ids)] == a.token_ids, i
        assert last.prompt == (prompts[i] if isinstance(prompts[i], str) else None)
    assert _wait_for(lambda: not _stream_threads(), 10), _stream_threads()


def test_client_stream_logprobs_are_per_request(server, local_llm):  # noqa: F811
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    prompts = [[1, 2, 3], [7, 8]]
    want = local_llm.generate(prompts, sp, use_tqdm=False)
    with Client(server[0].url) as c:
        parts = list(c.stream(prompts, sp))
    for i, w in enumerate(want):
        last = [p for p in parts if p.request_id == str(i)][-1]
        assert last.finished and last.token_ids == w.token_ids
        assert len(last.logprobs) == len(w.logprobs) == 5
        for got, exp in zip(last.logprobs, w.logprobs):
            assert got.keys() == exp.keys()
            assert [got[t] for t in exp] == pytest.approx([exp[t] for t in exp], abs=1e-4)


def test_client_stream_keeps_max_parallel_requests_in_flight(server, monkeypatch):
    """max_parallel bounds the streams in flight; the others are sent as those end, all are answered."""
    srv, router = server
    submitted, _ = _watch_submits(monkeypatch, router)
    in_flight, peak, lock = [0], [0], threading.Lock()
    real = router.submit

    def counting(ids, sp, cb, **kw):
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])

        def end(out):
            if out.finished:
                with lock:
                    in_flight[0] -= 1
            cb(out)
        return real(ids, sp, end, **kw)
    monkeypatch.setattr(router, "submit", counting)
    prompts = [[i + 1, i + 2] for i in range(5)]
    with Client(srv.url, max_parallel=2) as c:
        parts = list(c.stream(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)))
    assert len(submitted) == 5 and 1 <= peak[0] <= 2, (submitted, peak)
    finals = {p.request_id: p for p in parts if p.finished}
    assert sorted(finals) == [str(i) for i in range(5)] and all(len(p.token_ids) == 3 for p in finals.values())


# --- a failed request -----------------------------------------------------------------------------------------

CHUNK = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "a", "token_ids": [5],
                                                               "finish_reason": None, "prompt_token_ids": [2]}]}


def _held_server(held_prompt, on_request):
    """A fake OpenAI-looking server: the stream of `held_prompt` sends one chunk, then SSE comments every 20 ms until
    the client leaves (or 60 s); the other prompts' answers are `on_request(prompt)`'s async generator of SSE text.
    Returns the server and a dict of threading.Events: "held" (its first chunk went out), "left" (its client left)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    ev = {"held": threading.Event(), "left": threading.Event()}

    async def models(_req):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def completions(req):
        prompt = (await req.json())["prompt"]
        if prompt != held_prompt:
            return StreamingResponse(on_request(prompt), media_type="text/event-stream")

        async def held():
            try:
                yield f"data: {json.dumps(CHUNK)}\n\n"
                ev["held"].set()
                for _ in range(3000):
                    await asyncio.sleep(0.02)
                    yield ": still working\n\n"
            finally:   # (the client closed the connection: the stream is cancelled)
                ev["left"].set()
        return StreamingResponse(held(), media_type="text/event-stream")
    return ServerThread(Starlette(routes=[Route("/v1/models", models),
                                          Route("/v1/completions", completions, methods=["POST"])])), ev


def test_client_stream_raises_a_failed_request_while_another_is_still_in_flight():
    """A request that fails (an SSE error event) is raised at once, while another is still streaming (not after it
    ends); the stream in flight is closed and the prompts not sent yet are not sent."""
    others = []
    ev: dict = {}

    async def answer(prompt):
        others.append(prompt)
        if prompt == [1]:
            for _ in range(500):   # (at most 5 s: the old client sent prompt [2] only after this one had ended)
                if ev["held"].is_set():
                    break
                await asyncio.sleep(0.01)
            yield 'data: {"error": {"message": "prompt 0 is bad", "code": "RequestFailedError"}}\n\n'
            yield "data: [DONE]\n\n"
        else:
            chunk = {**CHUNK, "choices": [{**CHUNK["choices"][0], "finish_reason": "length"}]}
            yield f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n"

    srv, events = _held_server([2], answer)
    ev.update(events)
    got = {}

    def call(c):
        seen = []
        try:
            for out in c.stream([[1], [2], [3], [4]], SamplingParams(max_tokens=4)):
                seen.append(out)
        except Exception as e:   # noqa: BLE001
            got["err"] = e
            got["held_at_error"] = ev["held"].is_set() and not ev["left"].is_set()
        got["seen"] = seen

    try:
        with Client(srv.url, max_parallel=2) as c:
            t = threading.Thread(target=call, args=(c,), daemon=True)
            t.start()
            t.join(timeout=30)
            assert not t.is_alive(), "stream waited for the request in flight before raising the failed one"
            assert isinstance(got.get("err"), RequestFailedError) and "prompt 0 is bad" in str(got["err"]), got
            assert got["held_at_error"], "the failed request was raised before the other was sent, or after it ended"
            assert [o.request_id for o in got["seen"]] in ([], ["1"]), got["seen"]
            assert ev["left"].wait(10), "the stream in flight was left open"
            assert _wait_for(lambda: not _stream_threads(), 10), _stream_threads()
            assert others == [[1]], others   # (prompts [3] and [4] were not sent)
    finally:
        srv.stop()


def test_client_stream_raises_an_http_error_of_one_prompt_while_another_is_in_flight(server):
    """(The same for a request the server refuses: the 400's InvalidRequestError.)"""
    from mpk_runtime.engine import PromptTooLongError
    with Client(server[0].url, max_parallel=2) as c:
        with pytest.raises(PromptTooLongError):
            list(c.stream([[1, 2, 3], list(range(1, 100))], GREEDY))
        assert _wait_for(lambda: not _stream_threads(), 10), _stream_threads()


# --- the caller stops early -----------------------------------------------------------------------------------

def test_breaking_out_of_client_stream_ends_the_other_streams_and_sends_no_more(server, monkeypatch):
    """A caller that stops reading (break, generator.close(), an exception) ends every stream in flight (the server
    aborts their requests) and the prompts not sent yet are not sent."""
    srv, router = server
    submitted, ends = _watch_submits(monkeypatch, router, gate_at=2, step_delay=0.05)   # (50 tokens: >= 2.5 s)
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with Client(srv.url, max_parallel=2) as c:
        for out in c.stream([[1, 2], [3, 4], [5, 6], [7, 8]], long):
            assert not out.finished
            break
        assert _wait_for(lambda: len(ends) == 2, 20), (submitted, ends)
        assert ends == ["abort", "abort"], ends
        assert _wait_for(lambda: not _stream_threads(), 10), _stream_threads()
        assert submitted == [[1, 2], [3, 4]] or submitted == [[3, 4], [1, 2]], submitted
        # the client (its connections) still serves
        assert c.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=2))[0].finish_reason == "length"


def test_an_exception_in_the_caller_ends_the_streams_too(server, monkeypatch):
    srv, router = server
    submitted, ends = _watch_submits(monkeypatch, router, gate_at=3, step_delay=0.05)
    long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    with Client(srv.url, max_parallel=3) as c:
        gen = c.stream([[1, 2], [3, 4], [5, 6]], long)
        next(gen)
        with pytest.raises(ValueError):
            gen.throw(ValueError("the caller's"))
        assert _wait_for(lambda: len(ends) == 3, 20), (submitted, ends)
        assert ends == ["abort"] * 3, ends
        assert _wait_for(lambda: not _stream_threads(), 10), _stream_threads()
