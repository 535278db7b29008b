"""`Client(address)`: the `LLM` interface (`generate`, `stream`, `chat`) over the HTTP server.

    from cluster import Client
    from mpk_runtime import SamplingParams
    c = Client("http://127.0.0.1:8000")
    outs = c.generate([[1, 2, 3], "hello"], SamplingParams(temperature=0, max_tokens=8))

Errors come back typed: a 4xx raises the engine's `InvalidRequestError` family (same class names), a 503
raises `RequestFailedError`, a 429 (the server's --max-concurrent-requests in flight) `ServerOverloadedError`, a
`RequestFailedError`: retry later. Called without SamplingParams, a call leaves the sampling fields a model's
generation_config.json may set to the server (the model's defaults, as LLM.generate(prompts) takes them), with
max_tokens 16.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import queue
import threading
import time
from typing import Iterator, Sequence

from mpk_runtime.engine.generation_config import SAMPLING_DEFAULT_FIELDS
from mpk_runtime.engine import errors as E
from mpk_runtime.engine.llm import normalize_prompts
from mpk_runtime.engine.request import RequestMetrics, RequestOutput, merge_completions
from mpk_runtime.engine.sampling import SamplingParams, completions

_ERRORS = {c.__name__: c for c in (E.InvalidRequestError, E.PromptTooLongError, E.NoTokenizerError,
                                   E.UnknownModelError, E.RequestFailedError)}


def _raise_for(status: int, body: dict | str):
    err = body.get("error", {}) if isinstance(body, dict) else {}
    msg = err.get("message") or str(body)
    code = err.get("code") or ""
    if status == 429:   # (the server's --max-concurrent-requests were in flight, or a proxy's rate limit)
        raise E.ServerOverloadedError(f"HTTP 429, the server is overloaded and queued nothing: {msg}")
    if code in _ERRORS:
        raise _ERRORS[code](msg)
    if status == 404:
        raise E.UnknownModelError(msg)
    if 400 <= status < 500:
        raise E.InvalidRequestError(msg)
    raise E.RequestFailedError(f"HTTP {status}: {msg}")


def _logprobs(rows) -> list[dict[int, float]] | None:
    """The server's logprobs_by_id extension ([[token id, logprob], ...] a position) as RequestOutput.logprobs."""
    return None if rows is None else [{int(t): float(v) for t, v in row} for row in rows]


def _json(r) -> dict | str:
    try:
        return r.json()
    except ValueError:  # not JSON: a proxy's error page, a non-mpk server, ...
        return r.text[:500]


class _ModelDefaults(SamplingParams):
    """The params of a call given none: SamplingParams() sent without the fields a model's generation_config.json
    may set (temperature, top_p, top_k, min_p, repetition_penalty), so that the server fills them from the model's
    defaults as LLM.generate(prompts) does (engine/generation_config.py); max_tokens 16, which the server caps at
    the model's max_new_tokens."""


def _run_all(fn, args: list[tuple], workers: int) -> list[cf.Future]:
    """fn(*a) for each a, at most `workers` at a time; a future cancelled before its turn does not run. (Not a
    ThreadPoolExecutor: leaving its `with` waits for every call in flight, so one failed request was raised only
    after all the others were generated; and its threads are joined at the interpreter's exit, so a program that
    stopped on the error would wait for them still. These are daemon threads that end when the calls run out.)"""
    futs = [cf.Future() for _ in args]
    jobs = iter(list(zip(futs, args)))
    lock = threading.Lock()

    def work():
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                return
            f, a = job
            if not f.set_running_or_notify_cancel():   # (cancelled: a request before it failed)
                continue
            try:
                f.set_result(fn(*a))
            except BaseException as e:   # noqa: BLE001  (the caller's: it reads the future)
                f.set_exception(e)

    for k in range(workers):
        threading.Thread(target=work, name=f"mpk-client-{k}", daemon=True).start()
    return futs


class _Transport:
    """httpx.Client whose transport failures raise RequestFailedError (typed, with the address), not httpx's."""

    def __init__(self, address: str, timeout: float):
        import httpx
        self._httpx, self.address = httpx, address
        self._c = httpx.Client(base_url=address, timeout=timeout)

    def _wrap(self, e: Exception) -> E.RequestFailedError:
        h = self._httpx
        if isinstance(e, h.TimeoutException) and not isinstance(e, h.ConnectTimeout):
            return E.RequestFailedError(f"no answer from {self.address} within the client timeout ({e!r}); "
                                        "raise Client(timeout=...) or lower max_tokens")
        if isinstance(e, (h.ReadError, h.WriteError, h.RemoteProtocolError, h.CloseError)):
            # (the server answered, or took the connection: it runs at that address, and the connection broke)
            return E.RequestFailedError(f"the connection to {self.address} broke before the response was complete "
                                        f"({e!r}); the server (or a proxy before it) closed it: see its log")
        return E.RequestFailedError(f"cannot reach the mpk-runtime server at {self.address} ({e!r}); is it "
                                    "running (python -m cluster.server ...) and is the address right?")

    def get(self, *a, **k):
        try:
            return self._c.get(*a, **k)
        except self._httpx.TransportError as e:
            raise self._wrap(e) from e

    def post(self, *a, **k):
        try:
            return self._c.post(*a, **k)
        except self._httpx.TransportError as e:
            raise self._wrap(e) from e

    def stream(self, *a, **k):
        import contextlib

        @contextlib.contextmanager
        def cm():
            try:
                with self._c.stream(*a, **k) as r:
                    yield r
            except self._httpx.TransportError as e:
                raise self._wrap(e) from e
        return cm()

    def close(self) -> None:
        self._c.close()


class Client:
    def __init__(self, address: str, timeout: float = 300.0, model: str | None = None, max_parallel: int = 16):
        self.address = address.rstrip("/")
        if not self.address.startswith("http"):
            self.address = "http://" + self.address
        if self.address.endswith("/v1"):   # an OpenAI client's base_url: the paths below carry /v1 themselves
            self.address = self.address[:-3]
        if max_parallel < 1:
            raise ValueError(f"max_parallel must be >= 1 (requests in flight at once), got {max_parallel}")
        self._http = _Transport(self.address, timeout)
        self.max_parallel = max_parallel
        if model is None:
            r = self._http.get("/v1/models")
            body = _json(r)
            if r.status_code != 200 or not isinstance(body, dict) or not body.get("data"):
                raise E.RequestFailedError(f"{self.address}/v1/models answered HTTP {r.status_code} {str(body)[:200]}; "
                                           "is this an mpk-runtime (OpenAI-compatible) server?")
            model = body["data"][0]["id"]
        self.model = model

    def _body(self, prompt, sp: SamplingParams, stream: bool) -> dict:
        # truncate_max_tokens: max_tokens past the context stops at the context (finish_reason "length"), as
        # LLM.generate does, not the 400 a plain OpenAI request gets
        return {"prompt": prompt, **self._sampling(sp, stream)}

    def _sampling(self, sp: SamplingParams, stream: bool) -> dict:
        """The body's fields but the prompt / messages: the SamplingParams as the server's request fields (a call
        given none, _ModelDefaults: those the model's generation config may set are left out, for the server's)."""
        body = {"model": self.model, "max_tokens": sp.max_tokens, "truncate_max_tokens": True,
                "temperature": sp.temperature,
                "top_p": sp.top_p, "top_k": sp.top_k, "seed": sp.seed, "stop_token_ids": list(sp.stop_token_ids),
                "ignore_eos": sp.ignore_eos, "stream": stream, "stop": list(sp.stop) or None,
                "include_stop_str_in_output": sp.include_stop_str_in_output, "logprobs": sp.logprobs,
                "presence_penalty": sp.presence_penalty, "frequency_penalty": sp.frequency_penalty,
                "repetition_penalty": sp.repetition_penalty, "min_p": sp.min_p, "min_tokens": sp.min_tokens,
                "logit_bias": {str(t): b for t, b in sp.logit_bias} if sp.logit_bias else None}
        if isinstance(sp, _ModelDefaults):
            for f in SAMPLING_DEFAULT_FIELDS:
                if f != "max_tokens":   # (sent: 16, the server caps it at the model's max_new_tokens)
                    del body[f]
        return body

    def _one(self, prompt, sp: SamplingParams, rid: str, index: int = 0) -> RequestOutput:
        out = self._answer("/v1/completions", self._body(prompt, sp, False), rid,
                           prompt if isinstance(prompt, str) else None)
        return dataclasses.replace(out, index=index) if index else out

    def _answer(self, path: str, body: dict, rid: str, prompt: str | None) -> RequestOutput:
        """POST one non-streaming request; its first choice as a RequestOutput (a completion's text, or a chat's
        message content), with the server's extensions: token ids, the prompt's, the timings (metrics: first token
        and finish on this client's clock), logprobs by token id."""
        t0 = time.monotonic()
        r = self._http.post(path, json=body)
        body = _json(r)
        if r.status_code != 200 or not isinstance(body, dict):
            _raise_for(r.status_code, body)
        c = body["choices"][0]
        text = c["text"] if "text" in c else (c["message"].get("content") or "")
        toks = list(c.get("token_ids") or [])
        m = c.get("metrics") or {}
        ttft, tpot, n = m.get("time_to_first_token"), m.get("per_token_latency"), len(toks)
        first = None if ttft is None else t0 + ttft
        finish = None if first is None else first + (tpot or 0.0) * max(0, n - 1)
        return RequestOutput(request_id=rid, prompt=prompt, prompt_token_ids=list(c.get("prompt_token_ids") or []),
                             token_ids=toks, text=text, delta_token_ids=toks, delta_text=text, finished=True,
                             finish_reason=c["finish_reason"], error=None,
                             metrics=RequestMetrics(t0, first, finish, body["usage"]["prompt_tokens"], n),
                             logprobs=_logprobs(c.get("logprobs_by_id")),
                             num_cached_tokens=c.get("num_cached_tokens") or 0, stop_reason=c.get("stop_reason"))

    @staticmethod
    def _fan_out(items: list, params: list[SamplingParams]) -> tuple[list[tuple], list[list[int]]]:
        """The call's requests, SamplingParams.n a prompt / conversation as LLM runs them (sampling.completions:
        the j-th seeded with seed + j), as (item, params, request id, index) - request id "i" for prompt i's first
        completion, "i-j" for its j-th - and the positions of each item's completions in that list."""
        jobs, groups = [], []
        for i, (item, sp) in enumerate(zip(items, params)):
            groups.append([])
            for j, one in enumerate(completions(sp)):
                groups[-1].append(len(jobs))
                jobs.append((item, one, str(i) if j == 0 else f"{i}-{j}", j))
        return jobs, groups

    def _validated(self, prompts, sampling_params):
        prompts = normalize_prompts(prompts)
        sp = sampling_params if sampling_params is not None else _ModelDefaults()
        params = list(sp) if isinstance(sp, (list, tuple)) else [sp] * len(prompts)
        if len(params) != len(prompts):
            raise E.InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise E.InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(p).__name__}")
        return prompts, params

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Sends the prompts concurrently (so the server batches them); outputs in prompt order. The first request
        that fails is raised at once: the prompts not sent yet are not sent, and the requests in flight are not
        waited for (daemon threads finish them in the background, within the client's timeout, and drop their
        answers; a program that ends on the error does not wait for them)."""
        prompts, params = self._validated(prompts, sampling_params)
        jobs, groups = self._fan_out(prompts, params)
        outs = self._all(self._one, jobs, use_tqdm, "generate")
        return [merge_completions([outs[k] for k in g]) for g in groups]

    def _all(self, fn, args: list[tuple], use_tqdm: bool, desc: str) -> list[RequestOutput]:
        """fn(*a) for each a, up to max_parallel at once; results in order. The first failure is raised at once."""
        futs = _run_all(fn, args, min(self.max_parallel, len(args)))
        try:
            done = cf.as_completed(futs)
            if use_tqdm:
                from tqdm.auto import tqdm
                done = tqdm(done, total=len(futs), desc=desc, unit="req")
            for f in done:
                if f.exception() is not None:
                    raise f.exception()
            return [f.result() for f in futs]
        finally:   # (all done on success; on an error or Ctrl-C: the requests not sent yet are not sent)
            for f in futs:
                f.cancel()

    def _chat_one(self, messages: list, sp: SamplingParams, rid: str, index: int = 0) -> RequestOutput:
        body = {"messages": messages, **self._sampling(sp, False)}
        # chat's logprobs is a bool and top_logprobs the alternatives a position reports (the server maps them to
        # SamplingParams.logprobs = top_logprobs): logprobs=n as logprobs: true, top_logprobs: n
        body["logprobs"] = None if sp.logprobs is None else True
        body["top_logprobs"] = sp.logprobs
        out = self._answer("/v1/chat/completions", body, rid, None)
        return dataclasses.replace(out, index=index) if index else out

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """LLM.chat over the server's POST /v1/chat/completions: messages is one conversation (a list of
        {"role": ..., "content": ...} dicts) or a list of conversations; one RequestOutput per conversation, in
        order. The server renders each with the model's chat template, as LLM.chat does (the same checks: a bad
        message raises InvalidRequestError, a model without a tokenizer or chat template NoTokenizerError). The
        conversations of a call are sent concurrently, as generate sends prompts (the first failure is raised at
        once, the rest not sent). The same sampling fields as generate are sent, with truncate_max_tokens: a
        max_tokens past the context stops at the context; None (SamplingParams(max_tokens=None)) runs until the
        context is full (SamplingParams()'s default is 16, not the server's chat default of none).
        Each output carries, as Client.generate's, the generated token_ids, the rendered conversation's
        `prompt_token_ids` and the server's timings in `metrics` (first_token_time, finish_time on the client's
        clock, as generate reads them): the chat response's token_ids, prompt_token_ids and metrics extensions. Its
        `prompt` is None: the response does not carry the rendered text (LLM.chat or render_chat give it).
        SamplingParams(logprobs=n) is sent as the chat request's logprobs: true, top_logprobs: n, and each output's
        `logprobs` (one {token id: logprob} a generated token, the sampled one first, as Client.generate's) is read
        from the chat choice's logprobs_by_id extension (OpenAI's chat logprobs name tokens by text, not id)."""
        from mpk_runtime.engine.chat import conversations
        convs = conversations(messages)
        sp = sampling_params if sampling_params is not None else _ModelDefaults()
        params = list(sp) if isinstance(sp, (list, tuple)) else [sp] * len(convs)
        if len(params) != len(convs):
            raise E.InvalidRequestError(f"{len(params)} sampling params for {len(convs)} conversations: pass one, "
                                        "or one per conversation")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise E.InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(p).__name__}")
        jobs, groups = self._fan_out(convs, params)
        outs = self._all(self._chat_one, jobs, use_tqdm, "chat")
        return [merge_completions([outs[k] for k in g]) for g in groups]

    def _stream_one(self, prompt, sp: SamplingParams, rid: str, index: int = 0, stop: threading.Event | None = None
                    ) -> Iterator[RequestOutput]:
        """One prompt's SSE stream as RequestOutput snapshots (cumulative token_ids / text / logprobs, and the
        deltas). With `stop`: checked between SSE lines; once set, the response is closed (the server then aborts
        the request) and nothing more is yielded."""
        t0 = time.monotonic()
        toks: list[int] = []
        lps: list[dict[int, float]] | None = None if sp.logprobs is None else []
        text = ""
        first = None
        pids = [] if isinstance(prompt, str) else list(prompt)   # (a string's ids come with its first chunk)
        done = False
        cached = 0
        with self._http.stream("POST", "/v1/completions", json=self._body(prompt, sp, True)) as r:
            if r.status_code != 200:
                r.read()
                _raise_for(r.status_code, _json(r))
            for line in r.iter_lines():
                if stop is not None and stop.is_set():
                    return   # (leaving the `with` closes the connection)
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    _raise_for(503, ev)
                if not ev.get("choices"):
                    continue
                c = ev["choices"][0]
                toks = toks + c.get("token_ids", [])
                if lps is not None:
                    lps = lps + (_logprobs(c.get("logprobs_by_id")) or [])
                text += c.get("text", "")
                first = first or time.monotonic()
                done = c.get("finish_reason") is not None
                now = time.monotonic()
                pids = c.get("prompt_token_ids") or pids
                cached = c.get("num_cached_tokens") or cached   # (the server tells it on the last chunk)
                yield RequestOutput(rid, prompt if isinstance(prompt, str) else None, pids, list(toks), text,
                                    c.get("token_ids", []), c.get("text", ""), done, c.get("finish_reason"),
                                    None, RequestMetrics(t0, first, now if done else None, len(pids), len(toks)),
                                    logprobs=lps, num_cached_tokens=cached, index=index,
                                    stop_reason=c.get("stop_reason"))
        if not done:   # (a proxy's read timeout, a server gone between chunks: not a whole answer)
            raise E.RequestFailedError(f"the stream from {self.address} ended before its last chunk (no "
                                       f"finish_reason after {len(toks)} tokens): the answer is cut short")

    def stream(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Yields a snapshot each time a request gains tokens (delta_token_ids / delta_text) and when it ends, as
        LLM.stream: the requests of one call run concurrently (up to max_parallel streams in flight, so the
        server batches them) and their snapshots interleave; tell them apart by request_id (the prompt's index;
        "i-j" for the j-th of its SamplingParams.n completions, whose `index` is j). The first request that
        fails is raised at once, and the prompts not sent yet are not sent. A caller that stops early (break,
        close(), an exception) ends the streams in flight (each closes its connection at its next SSE line, and
        the server aborts its request) and sends no more."""
        prompts, params = self._validated(prompts, sampling_params)
        jobs, _ = self._fan_out(prompts, params)
        workers = min(self.max_parallel, len(jobs))
        if workers <= 1:   # (one stream at a time: read in the caller's thread, closed when the caller stops)
            for job in jobs:
                yield from self._stream_one(*job)
            return
        # Daemon threads (not a ThreadPoolExecutor, whose threads are joined at the interpreter's exit: see _run_all),
        # each reading one stream at a time onto `q`; `stop` ends them (the caller stopped, or a request failed),
        # `gone` says the caller's generator ended (nobody reads `q` any more).
        q: queue.Queue = queue.Queue(maxsize=64 * workers)   # (bounded: a slow reader holds the streams back)
        stop, gone = threading.Event(), threading.Event()
        todo = iter(jobs)
        lock = threading.Lock()

        def put(item, until: threading.Event = stop) -> bool:
            while not until.is_set():
                try:
                    q.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    pass
            return False

        def work():
            while not stop.is_set():
                with lock:
                    job = next(todo, None)
                if job is None:
                    return
                try:
                    for out in self._stream_one(*job, stop=stop):
                        if not put((None, out)):
                            return
                    put((None, None))   # (one request done)
                except BaseException as e:   # noqa: BLE001  (the caller's: raised from the generator)
                    stop.set()   # (first: the others take no new prompt, and end their streams)
                    put((e, None), until=gone)
                    return

        for k in range(workers):
            threading.Thread(target=work, name=f"mpk-client-stream-{k}", daemon=True).start()
        left = len(jobs)
        try:
            while left:
                err, out = q.get()
                if err is not None:
                    raise err
                if out is None:
                    left -= 1
                    continue
                yield out
        finally:   # (all done; or an error, or the caller stopped: the workers stop and close their streams)
            stop.set()
            gone.set()

    def health(self) -> dict:
        return self._http.get("/health").json()

    def metrics(self) -> str:
        return self._http.get("/metrics").text

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
