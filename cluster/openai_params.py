"""OpenAI request bodies -> the engine's SamplingParams: what the server checks before it queues anything (a 4xx
names what to send instead)."""
from __future__ import annotations

import json

from mpk_runtime.engine import InvalidRequestError, SamplingParams
from mpk_runtime.engine.sampling import MAX_N, completions as choices   # (the server's n: LLM.generate's rule)

from .protocol import ChatRequest, CommonRequest



_ABSENT = (None, {}, [], "", "none", {"type": "text"})
# request fields this server does not implement -> the values that ask for nothing, which clients that always send a
# field send (vLLM's defaults); any other value is a 400 naming the field, not an answer as if it were absent
NOOP_VALUES = {
    **dict.fromkeys(("suffix", "tools", "tool_choice", "functions", "function_call", "response_format",
                     "guided_json", "guided_regex", "guided_choice"), _ABSENT),
    "echo": (None, False), "best_of": (None, 1), "use_beam_search": (None, False), "prompt_logprobs": (None,),
    "allowed_token_ids": (None,), "bad_words": (None, []), "guided_grammar": (None,), "structured_outputs": (None,),
    "logits_processors": (None, []), "truncate_prompt_tokens": (None,), "skip_special_tokens": (None, True),
    "add_special_tokens": (None,), "return_tokens_as_token_ids": (None, False), "prompt_embeds": (None,),
    "chat_template": (None,), "chat_template_kwargs": (None, {}), "add_generation_prompt": (None, True),
    "continue_final_message": (None, False), "documents": (None, []), "modalities": (None, [], ["text"]),
    "audio": (None,), "web_search_options": (None,), "reasoning_effort": (None,),
}


def _json(v) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


class HTTPError(Exception):
    """param: the request field at fault (OpenAI's error.param), where one is."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def sampling_params(r: CommonRequest, served: tuple[str, ...], defaults: dict | None = None) -> SamplingParams:
    """The SamplingParams of an OpenAI request body (HTTPError 400 / 404 for what cannot be served; `served`: the
    model names this server answers to). defaults: the model's generation_config.json sampling defaults
    (generation_config.sampling_defaults), taken by the fields the request leaves out or sends as null; its
    max_tokens caps the request's, as vLLM's server caps it (min of the two)."""
    if r.model is not None and r.model not in served:   # (first, as vLLM's: a request for another model is a 404
        # whatever else it asks for)
        raise HTTPError(404, f"model {r.model!r} is not served here; this server serves {served[0]!r}",
                        "model_not_found", param="model")
    if not isinstance(r.n, int) or not 1 <= r.n <= MAX_N:
        raise HTTPError(400, f"n must be an int in [1, {MAX_N}] (completions per prompt), got {r.n!r}", param="n")
    if r.stream_options is not None and not r.stream:
        raise HTTPError(400, "stream_options is only allowed with stream: true (include_usage adds a usage chunk to "
                             "a stream; a response without stream always has usage)", param="stream_options")
    chat = isinstance(r, ChatRequest)
    if chat:   # chat: logprobs is a bool, top_logprobs how many alternatives
        if r.logprobs is not None and not isinstance(r.logprobs, bool):   # (1 == True: not `in (True, False)`)
            raise HTTPError(400, f"chat logprobs must be true or false, got {r.logprobs!r}; set top_logprobs "
                                 "for the number of alternatives", param="logprobs")
        if r.top_logprobs and not r.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (r.top_logprobs or 0) if r.logprobs else None
    else:      # completions: logprobs is the number of alternatives (0 = the sampled token's only)
        if r.top_logprobs is not None:
            raise HTTPError(400, "top_logprobs is a chat field; completions take logprobs=<int>", param="top_logprobs")
        logprobs = None if r.logprobs is False else r.logprobs
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)):
            raise HTTPError(400, f"logprobs must be an int (top tokens per position), got {r.logprobs!r}",
                            param="logprobs")
    bias = None
    if r.logit_bias:
        try:
            bias = {int(k): v for k, v in r.logit_bias.items()}
        except (TypeError, ValueError):
            raise HTTPError(400, "logit_bias keys must be token ids (integers as strings), e.g. "
                                 f"{{\"1234\": -100}}; got {list(r.logit_bias)[:5]}", param="logit_bias") from None
    for field, noop in NOOP_VALUES.items():
        if field == "add_special_tokens":   # (what the server does: a prompt gets them, a chat template writes its own)
            noop = (None, not chat)
        if getattr(r, field, None) not in noop:
            raise HTTPError(400, f"{field}={_json(getattr(r, field))} is not supported by this server; leave it out",
                            param=field)
    if r.stream_options is not None and r.stream_options.continuous_usage_stats not in (None, False):
        raise HTTPError(400, "stream_options.continuous_usage_stats is not supported by this server: send "
                             "include_usage for one usage chunk at the end",
                        param="stream_options.continuous_usage_stats")
    for i, m in enumerate(r.messages if chat else ()):
        for field in ("tool_calls", "function_call"):   # (the chat template is given role and content only)
            if getattr(m, field) not in (None, []):
                raise HTTPError(400, f"messages[{i}].{field}: tool and function calls are not supported by this "
                                     "server; send the turn's content only", param=f"messages[{i}].{field}")
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    defaults = defaults or {}
    if defaults.get("max_tokens") is not None:
        max_tokens = defaults["max_tokens"] if max_tokens is None else min(max_tokens, defaults["max_tokens"])
    try:
        return _sampling_params(r, max_tokens, logprobs, bias, defaults)
    except InvalidRequestError as e:   # a value out of range: the 400 names the field (OpenAI's error.param)
        raise HTTPError(400, str(e), type(e).__name__, _field_at_fault(r, str(e))) from None


def max_tokens_field(r: CommonRequest) -> str:
    """The request field max_tokens came from: max_completion_tokens where given, as sampling_params takes it."""
    return "max_completion_tokens" if r.max_completion_tokens is not None else "max_tokens"


def _field_at_fault(r: CommonRequest, message: str) -> str | None:
    """The request field a SamplingParams error names first ("invalid SamplingParams: top_p must be ..."), as the
    request spells it; None where it names none."""
    words = message.split(":", 1)[-1].split()
    first = words[0] if words else ""
    if first == "max_tokens":
        return max_tokens_field(r)
    if first == "logprobs" and isinstance(r, ChatRequest):
        return "top_logprobs"
    return first if first in type(r).model_fields else None


def _sampling_params(r: CommonRequest, max_tokens, logprobs, bias, defaults: dict) -> SamplingParams:
    def given(name: str, builtin):   # the request's value, else the model's default, else SamplingParams'
        v = getattr(r, name)
        return v if v is not None else defaults.get(name, builtin)
    return SamplingParams(temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
                          top_k=given("top_k", 0) or 0, max_tokens=max_tokens,
                          stop_token_ids=tuple(r.stop_token_ids or ()), seed=r.seed, ignore_eos=r.ignore_eos,
                          stop=() if r.stop is None else r.stop, include_stop_str_in_output=r.include_stop_str_in_output,
                          logprobs=logprobs, presence_penalty=r.presence_penalty or 0.0,
                          frequency_penalty=r.frequency_penalty or 0.0,
                          repetition_penalty=given("repetition_penalty", 1.0),
                          logit_bias=bias, min_p=given("min_p", 0.0) or 0.0, min_tokens=r.min_tokens or 0)
