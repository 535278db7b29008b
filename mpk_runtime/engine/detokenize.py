"""A request's output text, grown a token at a time: each new token costs a decode of the last few tokens, not of the
whole output (decoding everything each token was O(n^2): ~0.18 ms a token at 1024 output tokens with a byte-level
BPE tokenizer, ~5 ms of host time a decode step at 64 such requests; bench/results/s51).

The text of out[:read] is known; a token is added by decoding the window out[prefix:] and out[prefix:read], the
window starting where the text before `read` was last complete, and appending what the longer decode adds. Decoding
from `prefix` rather than `read` gives the tokenizer the left context it uses for spacing (SentencePiece's leading
space), and a decode that ends in an incomplete UTF-8 sequence ("\ufffd" at its end) waits for the next token, as a
full decode shown token by token would; so does a run of byte-fallback tokens (Llama-2, Mistral), which decodes as
a whole. Windows are decoded without transformers' space cleanup (" ." -> "."), which
is not local to a window; where the tokenizer's decode applies it, it is applied to the whole text instead
(text_decoder finds out which, by a probe). A tokenizer that cannot be told apart that way is decoded whole each
token, as before. Stop strings are searched only where a new one can start: the text before it held none.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .stop_strings import first_stop, held_back

# text holding every pattern of transformers' clean_up_tokenization, to see whether a tokenizer's decode applies it
_PROBE = "a . b , c ! d ? e ' f n't g 'm h 's i 've j 're k"
# the proper prefixes of those patterns (" .", " ' ", " n't", ...): a text ending in one may still be rewritten
_OPEN = frozenset(p[:k] for p in (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")
                  for k in range(1, len(p)))


def _settled(raw: str) -> int:
    """Length of raw's longest prefix not ending in a proper prefix of a cleanup pattern: no text appended after it
    changes its cleanup (patterns start with a space and the cleanup only removes spaces)."""
    end = len(raw)
    while True:
        for k in (3, 2, 1):
            if end >= k and raw[end - k:end] in _OPEN:
                end -= k
                break
        else:
            return end


@dataclass(frozen=True)
class TextDecoder:
    raw: Callable[[list[int]], str]                 # ids -> text without space cleanup (windows concatenate)
    clean: Callable[[str], str] | None = None       # the cleanup tok.decode applies to a whole text, if any
    whole: Callable[[list[int]], str] | None = None   # set: decode the whole output each token (no window)
    in_run: Callable[[list[int]], bool] | None = None   # ids end in a byte-fallback run (its text may still change)


def text_decoder(tok) -> TextDecoder:
    """How tok.decode(ids, skip_special_tokens=True) is reproduced incrementally. A fast (Rust) tokenizer's decode is
    called directly: the same text without transformers' per-call argument handling (~6 of its ~7 us a call). A
    tokenizer that is not a transformers one is decoded whole each token (nothing known of how it joins pieces)."""
    def whole(ids):
        return tok.decode(ids, skip_special_tokens=True)
    if not hasattr(tok, "clean_up_tokenization_spaces"):
        return TextDecoder(whole, whole=whole)
    backend = getattr(tok, "_tokenizer", None)
    run = None
    if callable(getattr(backend, "decode", None)):
        def raw(ids):
            return backend.decode(ids, skip_special_tokens=True)
        run = _byte_run(backend)
    else:
        def raw(ids):
            return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if not tok.clean_up_tokenization_spaces:
        return TextDecoder(raw, in_run=run)
    clean = getattr(tok, "clean_up_tokenization", None)
    if clean is None:
        return TextDecoder(raw, whole=whole, in_run=run)
    try:   # the flag is set; transformers 5 ignores it for BPE models: see what decode does with every pattern
        ids = tok.encode(_PROBE, add_special_tokens=False)
        r, d = raw(ids), whole(ids)
    except Exception:   # noqa: BLE001 - an odd tokenizer: decode whole, as before
        return TextDecoder(raw, whole=whole, in_run=run)
    if clean(r) == r:       # the probe lost its patterns: cannot tell
        return TextDecoder(raw, whole=whole, in_run=run)
    if d == r:
        return TextDecoder(raw, in_run=run)
    if d == clean(r):
        return TextDecoder(raw, clean=clean, in_run=run)
    return TextDecoder(raw, whole=whole, in_run=run)


def _byte_run(backend) -> Callable[[list[int]], bool] | None:
    """For a decoder with ByteFallback (Llama-2, Mistral): a test whether ids end in a run of byte tokens (<0x0A>),
    skipped special / unknown ids aside. Such a run decodes as a whole, every byte "\ufffd" if it is not valid
    UTF-8, so text a complete character of it showed can still turn into "\ufffd"s: it waits for the run's end."""
    try:
        if b'"ByteFallback"' not in backend.decoder.__getstate__():
            return None
        byte_ids = frozenset(i for t, i in backend.get_vocab(with_added_tokens=False).items()
                             if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t))
        skipped = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    except Exception:   # noqa: BLE001 - no decoder, or one that cannot be read: as before
        return None
    if not byte_ids:
        return None

    def in_run(ids):
        for i in reversed(ids):
            if i in byte_ids:
                return True
            if i not in skipped and backend.id_to_token(i) is not None:
                return False
        return False
    return in_run


class IncrementalText:
    def __init__(self, decoder: TextDecoder):
        self.dec = decoder
        self.full = ""        # the decoded text of out[:read] (before any cleanup)
        self.prefix = 0       # the window's first token
        self.read = 0         # tokens whose text is in `full`
        self.searched = 0     # characters of the text known to hold no stop string
        self.stop_floor = 0   # a stop string counts only where it ends after this many characters (min_tokens)
        self.stop_hit: str | None = None   # the stop string that ended the text (visible found it)

    @property
    def text(self) -> str:
        """The output's text as tok.decode(out[:read], skip_special_tokens=True) gives it."""
        return self.dec.clean(self.full) if self.dec.clean is not None else self.full

    def add(self, out: list[int], final: bool) -> bool:
        """Take out[read:] into the text where it decodes to complete characters (always when final). True when the
        text changed."""
        if not final and self.dec.in_run is not None and self.dec.in_run(out):
            return False        # a byte-fallback run: its text is known when it ends
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
        one (with the space cleanup, also a tail the cleanup may still rewrite: " '" before "s"). Where the text only grows at its end, searches only the part a stop string could newly occupy."""
        text = self.text
        shown = text   # what may be streamed: with the cleanup, only the part later tokens cannot rewrite
        if self.dec.clean is not None and not final:
            shown = self.dec.clean(self.full[:_settled(self.full)])
        if not stops:
            return shown, False
        grows = self.dec.whole is None and self.dec.clean is None
        start = max(0, self.searched - max(len(s) for s in stops) + 1) if grows else 0
        hit = first_stop(text, stops, start, self.stop_floor)
        self.searched = len(text)
        if hit is not None:
            i, s = hit
            self.stop_hit = s
            return (text[:i + len(s)] if include_stop else text[:i]), True
        if final:
            return text, False
        return shown[:len(shown) - held_back(shown, stops)], False
