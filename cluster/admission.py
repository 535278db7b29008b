"""The server's admission limit (--max-concurrent-requests): generation requests past N in flight are answered 429
at once, as TGI's overload answer, instead of queued without bound; and the OpenAI error body every error uses."""
from __future__ import annotations

from .metrics import Metrics


def _err_body(message: str, code: str, etype: str = "invalid_request_error", param: str | None = None) -> dict:
    return {"error": {"message": message, "type": etype, "code": code, "param": param}}


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")   # the requests the admission limit counts
RETRY_AFTER_S = 1   # the Retry-After of a 429 for overload


class _AdmissionLimit:
    """ASGI middleware: counts the generation requests (POST to GENERATION_PATHS, streaming or not) from their arrival
    until the app is done with them: the response sent in full, a stream's client gone, a 4xx or 503 answered, an
    error raised. With a `limit`, one that arrives while `limit` are in flight is answered 429 at once (its body
    unread, nothing queued in the engine; TGI's --max-concurrent-requests). Other requests pass uncounted, never
    refused. (Runs on the server's event loop: the check and the count are one step, no await between.)"""

    def __init__(self, app, metrics: Metrics, limit: int | None):
        self.app, self.metrics, self.limit = app, metrics, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if path not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        m = self.metrics
        if self.limit is not None and m.in_flight >= self.limit:
            m.on_overloaded()
            from starlette.responses import JSONResponse
            msg = (f"the server is overloaded: {self.limit} generation requests are in flight, as many as it admits "
                   f"(--max-concurrent-requests {self.limit}); nothing was queued. Retry later (after the Retry-After "
                   "seconds), or start the server with a larger --max-concurrent-requests")
            await JSONResponse(_err_body(msg, "overloaded", "rate_limit_error"), status_code=429,
                               headers={"Retry-After": str(RETRY_AFTER_S)})(scope, receive, send)
            return
        m.on_admit()
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                m.on_release()

        async def send_last_releases(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()   # (before it goes out: a client holding its whole answer never finds its slot taken)
            await send(message)
        try:
            await self.app(scope, receive, send_last_releases)
        finally:   # (a stream whose client left, an error raised before any answer)
            release()


MAX_REQUEST_BYTES = 64 << 20   # a request body's default limit (--max-request-bytes): ~16M prompt tokens as JSON ids


class BodyTooLarge(Exception):
    """A request body passed the server's limit while it was read (_BodyLimit)."""

    def __init__(self, limit: int):
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-request-bytes): send less, or start the server with a larger --max-request-bytes")


class _BodyLimit:
    """ASGI middleware: a request body past `limit` bytes is refused 413 before it is held whole: at once when its
    Content-Length says so, else (chunked) by BodyTooLarge once the bytes read pass it, which FastAPI's body parsing
    turns into its 400 "error parsing the body" with this as the cause (the server's handler answers 413), or which
    reaches here (answered 413 if no response has started)."""

    def __init__(self, app, metrics: Metrics, limit: int):
        self.app, self.metrics, self.limit = app, metrics, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(scope, receive, send)
        seen, started = 0, False

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise BodyTooLarge(self.limit)
            return message

        async def watched(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)
        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, receive, send)

    async def _refuse(self, scope, receive, send) -> None:
        self.metrics.on_reject()
        await too_large(BodyTooLarge(self.limit))(scope, receive, send)


def too_large(e: BodyTooLarge):
    """The 413 answer to a body past the limit (here, and the server's handler of FastAPI's wrapped error)."""
    from starlette.responses import JSONResponse
    return JSONResponse(_err_body(str(e), "request_too_large"), status_code=413, headers={"Connection": "close"})

