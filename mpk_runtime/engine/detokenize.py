"""A request's output text, grown a token at a time: each new token costs a decode of the last few tokens, not of the
whole output (decoding everything each token was O(n^2): ~0.18 ms a token at 1024 output tokens with a byte-level
BPE tokenizer, ~5 ms of host time a decode step at 64 such requests; bench/results/s51).

The text of out[:read] is known; a token is added by decoding the window out[prefix:] and out[prefix:read], the
window starting where the text before `read` was last complete, and appending what the longer decode adds. Decoding
from `prefix` rather than `read` gives the tokenizer the left context it uses for spacing (SentencePiece's leading
space), and a decode that ends in an incomplete UTF-8 sequence ("\ufffd" at its end) waits for the next token, as a
full decode shown token by token would. Windows are decoded without transformers' space cleanup (" ." -> "."), which
is not local to a window; where the tokenizer's decode applies it, it is applied to the whole text instead
(text_decoder finds out which, by a probe). A tokenizer that cannot be told apart that way is decoded whole each
token, as before. Stop strings are searched only where a new one can start: the text before it held none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .stop_strings import first_stop, held_back

# text holding every pattern of transformers' clean_up_tokenization, to see whether a tokenizer's decode applies it
_PROBE = "a . b , c ! d ? e ' f n't g 'm h 's i 've j 're k"


@dataclass(frozen=True)
class TextDecoder:
    raw: Callable[[list[int]], str]                 # ids -> text without space cleanup (windows concatenate)
    clean: Callable[[str], str] | None = None       # the cleanup tok.decode applies to a whole text, if any
    whole: Callable[[list[int]], str] | None = None   # set: decode the whole output each token (no window)


def text_decoder(tok) -> TextDecoder:
    """How tok.decode(ids, skip_special_tokens=True) is reproduced incrementally. A fast (Rust) tokenizer's decode is
    called directly: the same text without transformers' per-call argument handling (~6 of its ~7 us a call). A
    tokenizer that is not a transformers one is decoded whole each token (nothing known of how it joins pieces)."""
    def whole(ids):
        return tok.decode(ids, skip_special_tokens=True)
    if not hasattr(tok, "clean_up_tokenization_spaces"):
        return TextDecoder(whole, whole=whole)
    backend = getattr(tok, "_tokenizer", None)
    if callable(getattr(backend, "decode", None)):
        def raw(ids):
            return backend.decode(ids, skip_special_tokens=True)
    else:
        def raw(ids):
            return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if not tok.clean_up_tokenization_spaces:
        return TextDecoder(raw)
    clean = getattr(tok, "clean_up_tokenization", None)
    if clean is None:
        return TextDecoder(raw, whole=whole)
    try:   # the flag is set; transformers 5 ignores it for BPE models: see what decode does with every pattern
        ids = tok.encode(_PROBE, add_special_tokens=False)
        r, d = raw(ids), whole(ids)
    except Exception:   # noqa: BLE001 - an odd tokenizer: decode whole, as before
        return TextDecoder(raw, whole=whole)
    if clean(r) == r:       # the probe lost its patterns: cannot tell
        return TextDecoder(raw, whole=whole)
    if d == r:
        return TextDecoder(raw)
    if d == clean(r):
        return TextDecoder(raw, clean=clean)
    return TextDecoder(raw, whole=whole)


class IncrementalText:
    def __init__(self, decoder: TextDecoder):
        self.dec = decoder
        self.full = ""        # the decoded text of out[:read] (before any cleanup)
        self.prefix = 0       # the window's first token
        self.read = 0         # tokens whose text is in `full`
        self.searched = 0     # characters of the text known to hold no stop string

    @property
    def text(self) -> str:
        """The output's text as tok.decode(out[:read], skip_special_tokens=True) gives it."""
        return self.dec.clean(self.full) if self.dec.clean is not None else self.full

    def add(self, out: list[int], final: bool) -> bool:
        """Take out[read:] into the text where it decodes to complete characters (always when final). True when the
        text changed."""
        if self.dec.whole is not None:
            new = self.dec.whole(out)
            if new.endswith("\ufffd") and not final:
                return False
            changed, self.full, self.read = new != self.full, new, len(out)
            return changed or final
        old = self.dec.raw(out[self.prefix:self.read])
        new = self.dec.raw(out[self.prefix:])
        if len(new) <= len(old) and not final:
            return False        # (a skipped special token: nothing to show yet)
        if new.endswith("\ufffd") and not final:
            return False        # an incomplete UTF-8 sequence: wait for the next token
        self.full += new[len(old):]
        self.prefix, self.read = self.read, len(out)
        return True

    def visible(self, stops: tuple[str, ...], include_stop: bool, final: bool) -> tuple[str, bool]:
        """The engine's text for the output so far (stop_strings.visible_text): cut at the first stop string (kept
        with include_stop), else all of it when final or without stops, else all but a tail that could still become
        one. Where the text only grows at its end, searches only the part a stop string could newly occupy."""
        text = self.text
        if not stops:
            return text, False
        grows = self.dec.whole is None and self.dec.clean is None
        start = max(0, self.searched - max(len(s) for s in stops) + 1) if grows else 0
        hit = first_stop(text[start:], stops)
        self.searched = len(text)
        if hit is not None:
            i, s = hit
            i += start
            return (text[:i + len(s)] if include_stop else text[:i]), True
        if final:
            return text, False
        return text[:len(text) - held_back(text, stops)], False
