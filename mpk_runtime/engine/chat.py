"""Chat messages -> a prompt, with the model tokenizer's chat template: one function for `LLM.chat`, `cluster.Client`
and the HTTP server's /v1/chat/completions, so that a conversation is checked and rendered the same way everywhere.

    ids, text = render_chat(tokenizer, [{"role": "user", "content": "hi"}])

A bad conversation is the caller's fault (`InvalidRequestError`, saying what to send); a model without a tokenizer
or without a chat template is `NoTokenizerError`, saying what to use instead."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import InvalidRequestError, NoTokenizerError

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")   # OpenAI's message roles

# what to use instead when there is no tokenizer / no chat template, by caller: (no tokenizer, no chat template)
_ADVICE = {
    "llm": ("use LLM.generate with token ids (or a prompt you render yourself), or load a model directory that "
            "contains a tokenizer (or pass LLM(tokenizer=...))",
            "use LLM.generate with a prompt you render yourself, or pass LLM(tokenizer=...) a tokenizer that has one"),
    "http": ("use /v1/completions with token ids, or serve a model directory with a tokenizer",
             "use /v1/completions"),
}


def conversations(messages: Any) -> list[list]:
    """One conversation (a list of {"role", "content"} dicts) or a list of conversations -> a list of conversations.
    Only the shape is checked here (render_chat checks the messages)."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts (one "
                                  f"conversation) or a list of those; got {type(messages).__name__}")
    if not messages:
        raise InvalidRequestError("messages is empty: give at least one {'role': 'user', 'content': ...} message")
    if all(isinstance(c, (list, tuple)) for c in messages):
        return [list(c) for c in messages]
    return [list(messages)]


def _content(i: int, role: str, content: Any) -> str:
    if content is None:   # OpenAI's: only an assistant turn (one that made tool calls) may have none
        if role == "assistant":
            return ""
        raise InvalidRequestError(f"messages[{i}].content is missing or null; a {role} message needs its text (a "
                                  "string, or a list of {'type': 'text', 'text': <string>} parts)")
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):   # OpenAI content parts: the text ones; anything else is refused
        if not content:
            raise InvalidRequestError(f"messages[{i}].content is an empty list; give at least one {{'type': 'text', "
                                      "'text': <string>} part, or the text as a string")
        texts = []
        for part in content:
            if (not isinstance(part, Mapping) or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)):
                raise InvalidRequestError(f"unsupported message content part {str(part)[:80]}: chat takes only "
                                          "{'type': 'text', 'text': <string>} parts")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"messages[{i}].content must be a string or a list of {{'type': 'text', 'text': "
                              f"<string>}} parts, got {type(content).__name__} {str(content)[:80]}")


def check_messages(messages: Any) -> list[dict[str, str]]:
    """One conversation's messages as the chat template takes them: [{"role", "content" (str)[, "name"]}], text
    content parts joined, an assistant turn's None content as "" (any other role's None, a missing content or an
    empty parts list refused, as OpenAI refuses them), a participant's `name` (OpenAI's; a string) kept for templates that
    render it, as vLLM passes it. Other keys of a message are dropped (as the server's request body drops them).
    InvalidRequestError for an empty conversation, a role outside CHAT_ROLES, or content that is not text."""
    if not isinstance(messages, (list, tuple)):
        raise InvalidRequestError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts; got "
                                  f"{type(messages).__name__}")
    if not messages:
        raise InvalidRequestError("messages is empty: give at least one {'role': 'user', 'content': ...} message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be a dict with a 'role' and a 'content', got "
                                      f"{type(m).__name__} {str(m)[:80]}")
        role = m.get("role")
        if not isinstance(role, str):
            raise InvalidRequestError(f"messages[{i}] needs a 'role' string (one of {', '.join(CHAT_ROLES)}), got "
                                      f"{role!r}")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(f"message role {role!r} is not one of {', '.join(CHAT_ROLES)}")
        out.append({"role": role, "content": _content(i, role, m.get("content"))})
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise InvalidRequestError(f"messages[{i}].name must be a string (the participant's name), got "
                                          f"{type(name).__name__} {str(name)[:40]}")
            out[-1]["name"] = name
    return out


def render_chat(tokenizer: Any, messages: Any, advice_for: str = "llm") -> tuple[list[int], str]:
    """One conversation -> (prompt token ids, prompt text): the tokenizer's chat template with
    add_generation_prompt=True, then the text encoded without special tokens added (the template wrote them).
    NoTokenizerError when tokenizer is None or has no chat template (advice_for: "llm" or "http", whose ways
    round that the message names); InvalidRequestError for bad messages (check_messages) and for a template that
    refuses them (jinja2's TemplateError: "roles must alternate", ...). A template that does not parse
    (jinja2.TemplateSyntaxError) is the model's fault, not the request's: raised as is."""
    no_tok, no_template = _ADVICE[advice_for]
    if tokenizer is None:
        raise NoTokenizerError(f"chat needs a tokenizer with a chat template and this model has none; {no_tok}")
    if not getattr(tokenizer, "chat_template", None):
        raise NoTokenizerError(f"this model's tokenizer has no chat template; {no_template}")
    msgs = check_messages(messages)
    import jinja2   # (apply_chat_template's own dependency)
    try:
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateSyntaxError:   # the model's template is broken: not the request's fault
        raise
    except jinja2.TemplateError as e:    # the template refused these messages (raise_exception in it)
        raise InvalidRequestError(f"the model's chat template refused the messages: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=False)), text
