"""A request's output text, grown a token at a time: each new token costs a decode of the last few tokens, not of the
whole output (decoding everything each token was O(n^2): ~0.18 ms a token at 1024 output tokens with a byte-level
BPE tokenizer, ~11 ms of host time a decode step at 64 such requests).

The text of out[:read] is known; a token is added by decoding the window out[prefix:] and out[prefix:read], the
window starting where the text before `read` was last complete, and appending what the longer decode adds. Decoding
from `prefix` rather than `read` gives the tokenizer the left context it uses for spacing (SentencePiece's leading
space, cleanup of " ."), and a decode that ends in an incomplete UTF-8 sequence ("\ufffd" at its end) waits for the
next token, as a full decode shown token by token would. Stop strings are searched only where a new one can start:
the text before it held none.
"""
from __future__ import annotations

from typing import Callable

from .stop_strings import first_stop, held_back


def text_decoder(tok) -> Callable[[list[int]], str]:
    """ids -> text as tok.decode(ids, skip_special_tokens=True). A fast (Rust) tokenizer without the space cleanup is
    called directly: the same text without transformers' per-call argument handling (~6 of its ~7 us a call, twice a
    token). Anything else goes through tok.decode."""
    backend = getattr(tok, "_tokenizer", None)
    if getattr(tok, "clean_up_tokenization_spaces", True) is False and callable(getattr(backend, "decode", None)):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


class IncrementalText:
    def __init__(self):
        self.full = ""        # the decoded text of out[:read]
        self.prefix = 0       # the window's first token
        self.read = 0         # tokens whose text is in `full`
        self.searched = 0     # characters of `full` known to hold no stop string

    def add(self, decode: Callable[[list[int]], str], out: list[int], final: bool) -> bool:
        """Take out[read:] into `full` where it decodes to complete characters (always when final); decode: see
        text_decoder. True when `full` grew."""
        old = decode(out[self.prefix:self.read])
        new = decode(out[self.prefix:])
        if len(new) <= len(old) and not final:
            return False        # (a skipped special token: nothing to show yet)
        if new.endswith("\ufffd") and not final:
            return False        # an incomplete UTF-8 sequence: wait for the next token
        self.full += new[len(old):]
        self.prefix, self.read = self.read, len(out)
        return True

    def visible(self, stops: tuple[str, ...], include_stop: bool, final: bool) -> tuple[str, bool]:
        """engine text for the output so far (stop_strings.visible_text over `full`): cut at the first stop string
        (kept with include_stop), else all of it when final or without stops, else all but a tail that could still
        become one. Searches only the part of `full` a stop string could newly occupy."""
        if not stops:
            return self.full, False
        start = max(0, self.searched - max(len(s) for s in stops) + 1)
        hit = first_stop(self.full[start:], stops)
        self.searched = len(self.full)
        if hit is not None:
            i, s = hit
            i += start
            return (self.full[:i + len(s)] if include_stop else self.full[:i]), True
        if final:
            return self.full, False
        return self.full[:len(self.full) - held_back(self.full, stops)], False
