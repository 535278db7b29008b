"""Requests, scheduling, sampling and the `LLM` entry point (see `llm.py`)."""
from .chat import CHAT_ROLES, render_chat
from .engine import LLMEngine
from .errors import (InvalidRequestError, NoTokenizerError, PromptTooLongError, RequestFailedError,
                     ServerOverloadedError, ShutDownError, UnknownModelError)
from .llm import LLM
from .request import CompletionOutput, RequestMetrics, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "RequestMetrics", "InvalidRequestError",
           "PromptTooLongError", "NoTokenizerError", "UnknownModelError", "RequestFailedError",
           "ServerOverloadedError", "ShutDownError", "render_chat", "CHAT_ROLES"]
