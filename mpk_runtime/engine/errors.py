"""Typed engine errors. The ValueError subclasses are the caller's fault (HTTP 4xx); the message says what
to change. `RequestFailedError` is the runtime's fault (a worker died or hung): retrying later may succeed."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request or its sampling parameters are invalid."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit the context or the KV cache."""


class NoTokenizerError(InvalidRequestError):
    """Text was given (or text output/chat asked for) but the model has no tokenizer."""


class UnknownModelError(ValueError):
    """The model name is neither a preset nor a local Hugging Face directory."""


class RequestFailedError(RuntimeError):
    """The request was accepted but the runtime failed while running it (worker died or hung, ...)."""


class ShutDownError(RuntimeError):
    """The LLM was shut down (LLM.shutdown, or its `with` block ended): its workers are gone; make a new LLM."""


class ServerOverloadedError(RequestFailedError):
    """The server refused the request because it already had as many in flight as it admits (HTTP 429: its
    --max-concurrent-requests); nothing was queued. Retry later, or start the server with a larger limit."""
