"""OpenAI-compatible request bodies (pydantic). Unknown fields are ignored; unsupported ones are rejected by the
server with a 400 that says what to send instead."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = 16
    max_completion_tokens: int | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: int = 1
    stream: bool = False
    stream_options: dict | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logprobs: Any = None
    # extensions (vLLM-style)
    top_k: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage]
