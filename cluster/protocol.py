"""OpenAI-compatible request bodies (pydantic). Unknown fields are ignored; unsupported ones are rejected by the
server with a 400 that says what to send instead. Types are strict, as OpenAI's JSON schema: a bool is not an int
(`"n": true`), a float is not an int (`"n": 2.0`), a string is not a number or a bool (`"temperature": "0"`,
`"stream": "true"`); only an int where a float goes is taken (JSON cannot tell 1 from 1.0). A null is the default
of a field OpenAI's schema makes nullable (n, stream and echo, as the optional numbers and strings)."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, StrictInt, field_validator

from mpk_runtime.engine.chat import CHAT_ROLES  # noqa: F401  (OpenAI's message roles: one list, the engine's)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: Any = None   # vLLM's usage in every chunk: not implemented (400 unless null / false)


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = 16
    max_completion_tokens: int | None = None
    # sampling fields a request leaves out (or sends null) are the model's generation_config.json defaults where it
    # sets them (engine/generation_config.py, as vLLM's), else SamplingParams' (openai_params.sampling_params)
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logprobs: Any = None
    # extensions (vLLM-style)
    top_k: int | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    include_stop_str_in_output: bool = False
    top_logprobs: int | None = None   # chat: with logprobs=true, how many top tokens a position reports
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict | None = None    # OpenAI: {"token id": bias in [-100, 100]}
    # an explicit max_tokens / max_completion_tokens past the context stops at the context (finish_reason "length"),
    # as LLM.generate and vLLM's offline engine do, instead of OpenAI's 400; cluster.Client sends it (true)
    truncate_max_tokens: bool = False
    # OpenAI fields this server does not implement: declared so that a request using them gets a 400 (the server
    # checks them) instead of being served as if they were absent
    response_format: dict | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list | None = None
    # vLLM's extensions this server does not implement: as above, each is a 400 unless it has the value that asks
    # for nothing (openai_params.NOOP_VALUES), instead of being served as if absent
    use_beam_search: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    logits_processors: Any = None
    truncate_prompt_tokens: Any = None
    skip_special_tokens: Any = None
    add_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None

    @field_validator("n", "stream", mode="before")
    @classmethod
    def _null_is_default(cls, v, info):
        """OpenAI's schema has these nullable, null meaning the default (the openai SDK sends null for an argument
        passed as None): not a 400."""
        return cls.model_fields[info.field_name].default if v is None else v


class CompletionRequest(CommonRequest):
    # token ids are JSON integers: strict, so [true, false] or [1.0, 2.0] is a 400, not ids [1, 0] / [1, 2]
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    prompt_embeds: Any = None   # (vLLM's; not implemented)

    @field_validator("echo", mode="before")
    @classmethod
    def _null_echo(cls, v):
        return False if v is None else v   # (nullable in OpenAI's schema, as n and stream)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[dict] | None = None
    name: Any = None   # the participant's name, for the chat template (engine/chat.py checks it is a string)
    # an assistant turn's calls: the chat template gets role and content only (engine/chat.py), so a turn with
    # calls is a 400 rather than rendered as an empty message (openai_params)
    tool_calls: Any = None
    function_call: Any = None


class ChatRequest(CommonRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None   # OpenAI's chat: no default limit (the context stops it)
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    # not implemented (400 unless the value that asks for nothing): vLLM's chat template controls (the template is
    # rendered as is, with add_generation_prompt), its chat echo and documents; OpenAI's audio output, web search and
    # reasoning effort (a template that reads it would render another prompt)
    chat_template: Any = None
    chat_template_kwargs: Any = None
    add_generation_prompt: Any = None
    continue_final_message: Any = None
    echo: Any = None
    documents: Any = None
    modalities: Any = None
    audio: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
