"""OpenAI-compatible HTTP server over a `Router` of replicas.

    python -m cluster.server --model tiny-qwen3 --dtype float32 --replicas 2 --executor ray --port 8000

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with SSE `stream`), GET /v1/models (and
/v1/models/{model}), /health,
/metrics (Prometheus text). Each replica's engine runs its continuous batching in one background loop, so
concurrent HTTP requests share decode steps. Bad inputs answer 4xx with an OpenAI-style error body; a request
the runtime failed on (worker died/hung) answers 503, or an `error` event when it was already streaming. With
--max-concurrent-requests N, a generation request arriving while N are in flight answers 429 at once (Retry-After).
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import time
import uuid
from typing import Any, AsyncIterator

from mpk_runtime.engine import InvalidRequestError, LLMEngine, NoTokenizerError, RequestFailedError, RequestOutput
from mpk_runtime.engine.chat import CHAT_ROLES, check_messages, render_chat
from mpk_runtime.engine.generation_config import log_defaults, sampling_defaults

from mpk_runtime.engine.request import logprobs_by_id

from mpk_runtime.envflags import env_seconds
from .admission import MAX_REQUEST_BYTES, BodyTooLarge, _AdmissionLimit, _BodyLimit, _err_body, too_large
from .metrics import Metrics
from .openai_params import HTTPError, choices, max_tokens_field, sampling_params
from .protocol import ChatRequest, CommonRequest, CompletionRequest  # module level: FastAPI resolves annotations here
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request  # likewise (the endpoints take the raw request to see disconnects)
from .router import Router

SHUTTING_DOWN = ("the server is shutting down (Ctrl+C / SIGTERM): this request was stopped unfinished; send it again "
                 "to another replica or once the server is back")


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param(loc) -> str | None:
    """OpenAI's error.param of a pydantic error location: ("body", "messages", 0, "content", "str") ->
    "messages[0].content" (the union member pydantic tried, "str" / "list[int]", is no field)."""
    out = ""
    for x in loc:
        if x == "body" and not out:
            continue
        if isinstance(x, int):
            out += f"[{x}]"
            continue
        x = str(x)
        if x in _TYPE_TAGS or "[" in x or "-" in x:
            break
        out += f".{x}" if out else x
    return out or None


class _Inbox:
    """Outputs from the engine loop threads to one event loop's request queues, one wake-up of the loop a batch: a
    `call_soon_threadsafe` writes the loop's self-pipe, a system call that lets go of the GIL in the engine thread (and
    waits to get it back while a handler runs), so one a streamed output was 64 a step at 64 streaming rows. The
    first output after a drain schedules the next drain; the rest only queue behind it, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: list = []
        self._lock = threading.Lock()
        self._armed = False

    def put(self, q: asyncio.Queue, item) -> None:
        """From any thread: item into q on the loop's thread, soon (dropped once the loop has closed: the server
        stopped, and nobody reads q)."""
        with self._lock:
            self._items.append((q, item))
            if self._armed:
                return
            self._armed = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:   # (the loop is closed: an engine thread's output after the server stopped)
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items, self._armed = self._items, [], False
        for q, item in items:
            q.put_nowait(item)


OFF_LOOP_CHARS = 16384   # a prompt (or conversation) with this many characters is tokenized on a worker thread


def _chars(x) -> int:
    """The characters of text in a prompt or in messages' contents (token ids: none)."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, dict):   # (a content part)
        return _chars(x.get("text"))
    if isinstance(x, list) and x and not isinstance(x[0], int):   # (lists are of one kind: pydantic's union)
        return sum(_chars(y) for y in x if not isinstance(y, int))
    return 0


def _bad_message(msgs: list[dict]) -> str:
    """The param of a conversation render_chat refused: the first message refused alone (its role, name or content),
    else "messages" (an empty conversation, or one the template refused as a whole)."""
    for i, m in enumerate(msgs):
        try:
            check_messages([m])
        except InvalidRequestError as e:
            field = "role" if m["role"] not in CHAT_ROLES else "name" if "].name" in str(e) else "content"
            return f"messages[{i}].{field}"
    return "messages"


def _engine_param(message: str, r: CommonRequest | None) -> str | None:
    """The request field an engine check's error (RequestChecks.validate) names first, as the request spells it (a
    chat's prompt: its messages); None where it names none."""
    chat = isinstance(r, ChatRequest)
    prompt = "messages" if chat else "prompt"
    for prefix, field in (("the prompt", prompt), ("prompt token ids", prompt), ("stop_token_ids", "stop_token_ids"),
                          ("logit_bias", "logit_bias"), ("top_k=", "top_k"), ("stop strings", "stop"),
                          ("logprobs=", "top_logprobs" if chat else "logprobs")):
        if message.startswith(prefix):
            return field
    if message.startswith("the request needs") and r is not None:   # (more KV pages than the cache: max_tokens)
        return max_tokens_field(r)
    return None


def served_name(model: str, served_model_name: str | None = None) -> str:
    """The name requests must give as `model`: --served-model-name, else the last path component of --model."""
    return served_model_name or os.path.basename(os.path.normpath(model))


def _ended_extensions(o: RequestOutput) -> dict:
    """A non-streaming choice's fields beyond OpenAI's, completions and chat alike (what cluster.Client reads): its
    token ids, its prompt's (a chat's rendered conversation) and how many of those the prefix cache served, the
    timings, and with logprobs the same by token id."""
    return {"token_ids": o.token_ids, "prompt_token_ids": o.prompt_token_ids,
            "num_cached_tokens": o.num_cached_tokens, "metrics": o.metrics.to_dict(),
            **({"logprobs_by_id": logprobs_by_id(o.logprobs)} if o.logprobs is not None else {})}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def create_app(router: Router, served_model_name: str | None = None, max_concurrent_requests: int | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES, generation_config: str | None = "auto"):
    """generation_config: where a request's left-out sampling fields come from (engine/generation_config.py):
    "auto" = the model directory's generation_config.json (vLLM's default), "vllm" = none, or a directory.
    max_concurrent_requests: generation requests in flight at once (--max-concurrent-requests); one past them is
    refused with 429 (see _AdmissionLimit). None: no limit, every request is queued in the engine.
    max_request_bytes: a larger request body is refused 413 before it is read whole (_BodyLimit)."""
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive int (the largest request body, bytes), got "
                         f"{max_request_bytes!r}")
    if max_concurrent_requests is not None and (isinstance(max_concurrent_requests, bool)
                                                or not isinstance(max_concurrent_requests, int)
                                                or max_concurrent_requests < 1):
        raise ValueError(f"max_concurrent_requests must be a positive int (generation requests in flight at once) "
                         f"or None for no limit, got {max_concurrent_requests!r}")
    from fastapi import FastAPI
    from fastapi.routing import APIRoute
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    name = served_name(router.model_name, served_model_name)
    defaults = sampling_defaults(router.model_name, generation_config)
    log_defaults(defaults, f"server for {name!r}")
    # the HTTP handlers and the engine loops share this process's GIL: a thread that released it (a CUDA wait) may
    # wait up to the switch interval (Python's 5 ms) to run again while a handler runs. MPK_GIL_SWITCH_S sets it
    # for the process (session 64 measures 0.5 ms against the default)
    sys.setswitchinterval(env_seconds("MPK_GIL_SWITCH_S", sys.getswitchinterval()))
    metrics = Metrics()
    inboxes: dict = {}   # event loop -> its _Inbox (uvicorn runs one)
    app = FastAPI(title="mpk-runtime", version="0.1.0")
    app.state.router, app.state.metrics = router, metrics
    app.state.sampling_defaults = defaults
    app.state.max_concurrent_requests = max_concurrent_requests
    app.add_middleware(_AdmissionLimit, metrics=metrics, limit=max_concurrent_requests)
    app.add_middleware(_BodyLimit, metrics=metrics, limit=max_request_bytes)   # (outermost: before the count)

    # --- errors -> 4xx / 503 with a message ------------------------------------------------------------------
    @app.exception_handler(HTTPError)
    async def _http_error(_req, e: HTTPError):
        if e.status < 500:
            metrics.on_reject()
        etype = "invalid_request_error" if e.status < 500 else "server_error"
        return JSONResponse(_err_body(e.message, e.code, etype, e.param), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def _no_route(req: Request, e: StarletteHTTPException):
        """A path or method this server does not have (FastAPI answered {"detail": "Not Found"}, no error an OpenAI
        client reads): OpenAI's error body naming what was asked for. (Not a rejected generation request; a body
        that is not UTF-8, FastAPI's 400 "error parsing the body", is one, and says so.)"""
        if e.status_code == 404:
            routes = sorted(f"{m} {r.path_format}" for r in app.routes if isinstance(r, APIRoute) for m in r.methods)
            msg = f"no route {req.method} {req.url.path} on this server; it serves {', '.join(routes)}"
            code = "not_found"
        elif e.status_code == 405:
            allow = next((v for k, v in (e.headers or {}).items() if k.lower() == "allow"), None)
            msg = f"method {req.method} is not allowed for {req.url.path}" + (f" (allowed: {allow})" if allow else "")
            code = "method_not_allowed"
        elif e.status_code == 400 and isinstance(e.__cause__, UnicodeDecodeError):   # (FastAPI: "error parsing")
            metrics.on_reject()   # (a generation request's body, as one that is not JSON)
            msg = (f"invalid request: the body is not UTF-8 ({e.__cause__}): send JSON encoded as UTF-8 with the "
                   "header Content-Type: application/json")
            code = "InvalidRequestError"
        elif e.status_code == 400 and isinstance(e.__cause__, BodyTooLarge):   # (a chunked body past the limit)
            metrics.on_reject()
            return too_large(e.__cause__)
        elif e.status_code == 400 and isinstance(e.__cause__, RecursionError):   # (json.loads past its depth)
            metrics.on_reject()
            msg = "invalid request: the body's JSON is nested too deeply to parse"
            code = "InvalidRequestError"
        else:
            msg, code = f"{req.url.path}: {e.detail}", str(e.status_code)
        etype = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(_err_body(msg, code, etype), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_req, e: InvalidRequestError):
        metrics.on_reject()
        return JSONResponse(_err_body(str(e), type(e).__name__), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, e: RequestValidationError):
        metrics.on_reject()
        parts, param = [], None
        for err in e.errors():
            if err.get("type") == "json_invalid":   # (its loc is a character offset, not a field)
                at = err.get("loc", ())[-1:]
                parts.append(f"the body is not valid JSON (at character {at[0] if at else '?'}: "
                             f"{(err.get('ctx') or {}).get('error', err.get('msg'))})")
                continue
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            param = param or _param(err.get("loc", ()))
            msg = err.get("msg")
            if not loc and err.get("type") in ("model_attributes_type", "dict_type"):
                msg += " (send a JSON object with the header Content-Type: application/json)"
            parts.append(f"{loc or 'body'}: {msg}")
        return JSONResponse(_err_body("invalid request: " + "; ".join(parts[:5]), "InvalidRequestError",
                                      param=param), status_code=400)

    @app.exception_handler(RequestFailedError)
    async def _failed(_req, e: RequestFailedError):
        return JSONResponse(_err_body(str(e), "RequestFailedError", "server_error"), status_code=503)

    @app.exception_handler(Exception)
    async def _internal(_req, e: Exception):  # a bug: still an OpenAI-style JSON body (clients parse it)
        return JSONResponse(_err_body(f"internal error ({type(e).__name__}: {e}); please report it", "internal_error",
                                      "server_error"), status_code=500)

    # --- request -> (token ids, params) -------------------------------------------------------------------
    def _tok_str(t: int) -> tuple[str, bool]:
        """A generated token as text, and whether that is its own text: a token that is part of a UTF-8 character
        (it decodes to U+FFFD alone) is named by the tokenizer's token string instead, and one with no tokenizer or
        past its vocabulary "token_id:<id>", so that different tokens never share a name."""
        tok = router.tokenizer
        if tok is None or t >= len(tok):
            return f"token_id:{t}", False
        s = tok.decode([t])
        if "\ufffd" in s:
            return tok.convert_ids_to_tokens(t) or f"token_id:{t}", False
        return s, True

    def _completion_logprobs(lps: list[dict] | None, offset: int) -> dict | None:
        """The legacy completions format for the given positions (text offsets from `offset`)."""
        if lps is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            t, v = next(iter(lp.items()))
            s = _tok_str(t)[0]
            out["tokens"].append(s)
            out["token_logprobs"].append(v)
            out["top_logprobs"].append({_tok_str(a)[0]: b for a, b in lp.items()})
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def _chat_logprobs(lps: list[dict] | None, top: int) -> dict | None:
        if lps is None:
            return None

        def entry(t, v):
            s, own = _tok_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8")) if own else None}
        content = []
        for lp in lps:
            t, v = next(iter(lp.items()))
            alts = sorted(lp.items(), key=lambda kv: -kv[1])[:top]
            content.append({**entry(t, v), "top_logprobs": [entry(a, b) for a, b in alts]})
        return {"content": content}

    def _delta_logprobs(out: RequestOutput) -> list[dict] | None:
        if out.logprobs is None:
            return None
        k = len(out.delta_token_ids)
        return out.logprobs[len(out.logprobs) - k:]

    def _tokenize(text: str) -> list[int]:
        return router.engine.tokenize(text)

    async def _off_loop(fn, r):
        """fn(r) on a worker thread where r's text is long (OFF_LOOP_CHARS): tokenizing 12 MB held the event loop,
        so every other request and stream, ~10 s; the Rust tokenizer lets go of the GIL. Short text stays on the
        loop (it tokenizes in less than a thread hop)."""
        text = r.prompt if isinstance(r, CompletionRequest) else [m.content for m in r.messages]
        if _chars(text) < OFF_LOOP_CHARS:
            return fn(r)
        return await asyncio.get_running_loop().run_in_executor(None, fn, r)

    def _completion_prompts(r: CompletionRequest) -> list[tuple[list[int], str | None]]:
        p = r.prompt
        if isinstance(p, str):
            return [(_tokenize(p), p)]
        if not p:
            raise HTTPError(400, "prompt is empty: give a string, a list of token ids, or a list of those",
                            param="prompt")
        if all(isinstance(x, int) for x in p):
            return [(list(p), None)]
        return [(_tokenize(x), x) if isinstance(x, str) else (list(x), None) for x in p]

    def _chat_prompt(r: ChatRequest) -> tuple[list[int], str]:
        """The request's messages (pydantic already checked their JSON types) rendered by the engine's render_chat,
        as LLM.chat renders them: NoTokenizerError (400, its own code) as is; a bad message or one the template
        refuses is a 400 invalid_request_error (param: the message at fault where one alone is); a template that
        does not parse raises (500: the model's fault)."""
        msgs = [{"role": m.role, "content": m.content, **({} if m.name is None else {"name": m.name})}
                for m in r.messages]
        try:
            return render_chat(router.tokenizer, msgs, advice_for="http")
        except NoTokenizerError:
            raise
        except InvalidRequestError as e:
            raise HTTPError(400, str(e), param=_bad_message(msgs)) from None

    # --- engine bridge ------------------------------------------------------------------------------------
    def _submit_all(prompts, params, r: CommonRequest | None = None) -> tuple[asyncio.Queue, list[tuple[Any, str]]]:
        """Validate every prompt, then queue them all (each r.n times: choice i * n + j is prompt i's j-th);
        outputs arrive on one asyncio queue as (choice index, output). A max_tokens the request sent explicitly
        must fit the context after the prompt (OpenAI's 400), unless it sent truncate_max_tokens: true (the
        extension cluster.Client sends); the default (16, or none for chat) stops at the context instead
        (finish_reason "length"), as LLM.generate does."""
        ctx = router.engine.kv_spec.max_seq_len
        explicit = (r is not None and not r.truncate_max_tokens
                    and bool({"max_tokens", "max_completion_tokens"} & r.model_fields_set))
        n = r.n if r is not None else 1
        stream = r is None or r.stream
        for ids, _ in prompts:
            try:
                router.engine.validate(ids, params)
            except InvalidRequestError as e:   # (the code as is: cluster.Client raises the error type it names)
                raise HTTPError(400, str(e), type(e).__name__, _engine_param(str(e), r)) from None
            if explicit and params.max_tokens is not None and len(ids) + params.max_tokens > ctx:
                raise HTTPError(400, f"this model's context is {ctx} tokens, but the prompt ({len(ids)} tokens) plus "
                                     f"max_tokens ({params.max_tokens}) would need {len(ids) + params.max_tokens}: lower "
                                     f"max_tokens to at most {ctx - len(ids)}, or leave it out (or send "
                                     "truncate_max_tokens: true to stop at the context)", param=max_tokens_field(r))
        if closing.is_set():   # (a request that came in as the server began to shut down)
            raise HTTPError(503, SHUTTING_DOWN, "server_shutting_down")
        loop = asyncio.get_running_loop()
        inbox = inboxes.get(loop)
        if inbox is None:
            inbox = inboxes[loop] = _Inbox(loop)
        q: asyncio.Queue = asyncio.Queue()
        handles = []
        inflight[id(handles)] = handles   # (until _collect / _stream end: drain() aborts them)
        per_choice = choices(params, n)
        try:
            for pi, (ids, text) in enumerate(prompts):
                for j, sp in enumerate(per_choice):
                    def cb(out: RequestOutput, i=pi * n + j):
                        metrics.on_tokens(len(out.delta_token_ids))
                        if out.finished:
                            metrics.on_finish(out)
                        inbox.put(q, (i, out))
                    # (a non-streaming request is told only its end: no snapshot, callback and handler wake-up a
                    # step; its tokens reach the metrics' counters then, all at once)
                    handles.append(router.submit(ids, sp, cb, prompt=text, stream=stream))
        except BaseException as e:   # a submission failed (its replica went down): the caller gets the error,
            _abort(handles)          # so nobody would read the ones already queued
            inflight.pop(id(handles), None)
            if isinstance(e, RequestFailedError):
                metrics.on_submit_failed()
            raise
        return q, handles

    def _abort(handles) -> None:
        for rep, rid in handles:
            rep.loop.abort(rid)

    inflight: dict[int, list] = {}   # the handles of the requests being answered
    closing = threading.Event()

    def drain() -> None:
        """The server is shutting down (Ctrl+C / SIGTERM: serve.py's _Server; ServerThread.stop): every request in
        flight is aborted and answered 503 "shutting down" (a stream: an error event, then [DONE]), and any new one
        refused so, instead of uvicorn cancelling the handlers as the loop closed (tracebacks in the log, and a
        non-streaming answer cut short). Any thread; idempotent."""
        closing.set()
        for handles in list(inflight.values()):
            _abort(handles)
    app.state.drain = drain

    async def _watch_disconnect(raw: Request, handles) -> None:
        """uvicorn does not cancel a handler whose client left: poll, and abort its requests (they then finish
        with "abort" and _collect returns)."""
        while not await raw.is_disconnected():
            await asyncio.sleep(0.5)
        _abort(handles)

    async def _collect(q: asyncio.Queue, n: int, handles, raw: Request | None = None) -> list[RequestOutput]:
        final: dict[int, RequestOutput] = {}
        watcher = asyncio.ensure_future(_watch_disconnect(raw, handles)) if raw is not None else None
        try:
            while len(final) < n:
                i, out = await q.get()
                if out.finish_reason == "error":   # the answer is this error whatever its siblings give: they are
                    _abort(handles)                # aborted now, as a stream's (they ran to their ends before)
                    raise RequestFailedError(out.error)
                if out.finish_reason == "abort" and closing.is_set():   # (drain(): not a short answer, a 503)
                    raise HTTPError(503, SHUTTING_DOWN, "server_shutting_down")
                if out.finished:
                    final[i] = out
        except asyncio.CancelledError:  # client went away
            _abort(handles)
            raise
        finally:
            inflight.pop(id(handles), None)
            if watcher is not None:
                watcher.cancel()
        return [final[i] for i in range(n)]

    def _usage(outs: list[RequestOutput], n: int = 1) -> dict:
        p = sum(len(o.prompt_token_ids) for o in outs[::n])   # a prompt counts once, whatever its n
        c = sum(len(o.token_ids) for o in outs)
        u = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if router.engine.prefix_caching:   # OpenAI's field: prompt tokens served from the cache
            u["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in outs[::n])}
        return u

    def _finish(o: RequestOutput) -> str | None:
        return None if not o.finished else ("stop" if o.finish_reason == "stop" else "length")

    async def _stream(q, n, handles, make_chunk, include_usage: bool, first_chunks=(),
                      per_prompt: int = 1) -> AsyncIterator[str]:
        done, outs = set(), {}
        try:
            for c in first_chunks:
                yield _sse(c)
            while len(done) < n:
                items = [await q.get()]
                while not q.empty():   # (outputs that queued while this handler waited its turn: one write for all)
                    items.append(q.get_nowait())
                parts = []
                for i, out in items:
                    down = out.finish_reason == "abort" and closing.is_set()   # (drain(): an error, not an end)
                    if out.finish_reason == "error" or down:
                        _abort(handles)
                        parts.append(_sse(_err_body(SHUTTING_DOWN, "server_shutting_down", "server_error") if down
                                          else _err_body(out.error or "request failed", "RequestFailedError",
                                                         "server_error")))
                        yield "".join(parts) + "data: [DONE]\n\n"   # (a stream ends so, whatever ended it)
                        return
                    parts.append(_sse(make_chunk(i, out)))
                    if out.finished:
                        done.add(i)
                        outs[i] = out
                yield "".join(parts)
            if include_usage:
                yield _sse(make_chunk(None, None, usage=_usage([outs[i] for i in sorted(outs)], per_prompt)))
            yield "data: [DONE]\n\n"
        finally:
            inflight.pop(id(handles), None)
            if len(done) < n:  # disconnected (or failed) mid-stream: stop generating for it
                _abort(handles)

    # --- endpoints ----------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(r: CompletionRequest, raw: Request):
        params = sampling_params(r, (name, router.model_name), defaults)
        prompts = await _off_loop(_completion_prompts, r)
        q, handles = _submit_all(prompts, params, r)
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        n = len(prompts) * r.n
        if r.stream:
            offsets: dict[int, int] = {}
            told: set[int] = set()   # choices whose prompt_token_ids a chunk carried

            def chunk(i, out, usage=None):
                if out is None:
                    return {"id": cid, "object": "text_completion", "created": created, "model": name,
                            "choices": [], "usage": usage}
                lp = _completion_logprobs(_delta_logprobs(out), offsets.get(i, 0))
                if lp is not None and lp["tokens"]:
                    offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                c = {"index": i, "text": out.delta_text or "", "logprobs": lp, "finish_reason": _finish(out),
                     "stop_reason": out.stop_reason, "token_ids": out.delta_token_ids}
                if lp is not None:   # (an extension: the same by token id, what Client.stream reports)
                    c["logprobs_by_id"] = logprobs_by_id(_delta_logprobs(out))
                # (an extension, as the non-streaming token_ids: what Client.stream reports) on a choice's first
                # chunk, as vLLM's, since the prompt is tokenised before its first token; and on its last, as before
                if i not in told or out.finished:
                    told.add(i)
                    c["prompt_token_ids"] = out.prompt_token_ids
                if out.finished:   # (and, known by then, how many of those the prefix cache served)
                    c["num_cached_tokens"] = out.num_cached_tokens
                body = {"id": cid, "object": "text_completion", "created": created, "model": name, "choices": [c]}
                if inc:   # OpenAI: with include_usage every chunk but the last carries "usage": null
                    body["usage"] = None
                return body
            inc = bool(r.stream_options and r.stream_options.include_usage)
            return StreamingResponse(_stream(q, n, handles, chunk, inc, per_prompt=r.n),
                                     media_type="text/event-stream")
        outs = await _collect(q, n, handles, raw)
        # (bodies as JSONResponse: json.dumps alone; a returned dict goes through FastAPI's jsonable_encoder first,
        # ~0.3-0.5 ms of Python a 128-token completion on the thread the engine loop shares the GIL with: 64
        # requests finishing together held it ~30 ms, session 65)
        return JSONResponse({
            "id": cid, "object": "text_completion", "created": created, "model": name,
            "choices": [{"index": i, "text": o.text or "", "logprobs": _completion_logprobs(o.logprobs, 0),
                         "finish_reason": _finish(o), "stop_reason": o.stop_reason, **_ended_extensions(o)}
                        for i, o in enumerate(outs)],
            "usage": _usage(outs, r.n)})

    @app.post("/v1/chat/completions")
    async def chat(r: ChatRequest, raw: Request):
        params = sampling_params(r, (name, router.model_name), defaults)
        ids, text = await _off_loop(_chat_prompt, r)
        q, handles = _submit_all([(ids, text)], params, r)
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        top = params.logprobs or 0
        if r.stream:
            def chunk(i, out, usage=None):
                base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": name}
                if out is None:
                    return {**base, "choices": [], "usage": usage}
                c = {"index": i, "delta": {"content": out.delta_text or ""},
                     "logprobs": _chat_logprobs(_delta_logprobs(out), top), "finish_reason": _finish(out),
                     "stop_reason": out.stop_reason, "token_ids": out.delta_token_ids}
                if out.logprobs is not None:   # (an extension, as a streamed completion chunk's: by token id)
                    c["logprobs_by_id"] = logprobs_by_id(_delta_logprobs(out))
                if out.finished:   # (as a streamed completion's last chunk; its first, the role chunk, below)
                    c["prompt_token_ids"] = out.prompt_token_ids
                    c["num_cached_tokens"] = out.num_cached_tokens
                return {**base, "choices": [c], **({"usage": None} if inc else {})}
            inc = bool(r.stream_options and r.stream_options.include_usage)
            # each choice's first chunk carries the rendered conversation's ids, as a streamed completion's does
            first = [{"id": cid, "object": "chat.completion.chunk", "created": created, "model": name,
                      "choices": [{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                   "finish_reason": None, "prompt_token_ids": ids}],
                      **({"usage": None} if inc else {})} for j in range(r.n)]
            return StreamingResponse(_stream(q, r.n, handles, chunk, inc, first, per_prompt=r.n),
                                     media_type="text/event-stream")
        outs = await _collect(q, r.n, handles, raw)
        return JSONResponse({   # (not a returned dict: see completions)
            "id": cid, "object": "chat.completion", "created": created, "model": name,
            "choices": [{"index": j, "message": {"role": "assistant", "content": o.text or ""},
                         "logprobs": _chat_logprobs(o.logprobs, top), "finish_reason": _finish(o),
                         "stop_reason": o.stop_reason, **_ended_extensions(o)} for j, o in enumerate(outs)],
            "usage": _usage(outs, r.n)})

    def _card() -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "mpk-runtime",
                "max_model_len": router.engine.kv_spec.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """OpenAI's retrieve (`client.models.retrieve(id)`): the served model's card, under either of its names."""
        if model_id in (name, router.model_name):
            return _card()
        return JSONResponse(_err_body(f"model {model_id!r} is not served here; this server serves {name!r}",
                                      "model_not_found", param="model"), status_code=404)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """Forget every replica's prefix cache (--enable-prefix-caching): the next prompts compute all their pages."""
        futs = [asyncio.wrap_future(r.loop.call(LLMEngine.reset_prefix_cache)) for r in router.replicas]
        pages = await asyncio.gather(*futs)
        return {"reset": bool(router.engine.prefix_caching), "cached_pages_dropped": sum(pages)}

    async def _stats() -> dict:
        # (off the event loop: a replica in an engine process answers through its pipe, and a busy one may be slow)
        return await asyncio.get_running_loop().run_in_executor(None, router.stats)

    @app.get("/health")
    async def health():
        stats = await _stats()
        up = {k: not v["dead"] for k, v in stats.items()}
        body = {"status": "ok" if any(up.values()) else "down", "replicas": up}
        stalled = {k: v["stalled_s"] for k, v in stats.items() if v.get("stalled_s", 0) > router.stall_after}
        if stalled:   # (up, but their engine loops have not gone round for this long: wedged, or one long step)
            body["stalled_s"] = stalled
        return JSONResponse(body, status_code=200 if any(up.values()) else 503)

    @app.get("/metrics")
    async def prom():
        return PlainTextResponse(metrics.render(await _stats()), media_type="text/plain; version=0.0.4")

    return app


# running the app (a background thread; the command line): cluster/serve.py, its names here as before
from .serve import ServerThread, build_parser, listen_socket, main  # noqa: E402,F401


if __name__ == "__main__":
    sys.exit(main())
