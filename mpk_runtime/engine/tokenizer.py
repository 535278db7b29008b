"""Lazy tokenizer loading: a model directory with tokenizer files gets a `transformers.AutoTokenizer`."""
from __future__ import annotations

import os
import threading

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def model_eos_ids(model) -> set[int]:
    """EOS ids a Hugging Face directory declares outside its tokenizer: generation_config.json (what HF's
    `generate` stops on, e.g. Llama-3 Instruct's [128001, 128008, 128009]) and config.json."""
    import json
    out: set[int] = set()
    if not isinstance(model, str) or not os.path.isdir(model):
        return out
    for fn in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model, fn)) as f:
                e = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        for x in (e if isinstance(e, (list, tuple)) else [e]):
            if isinstance(x, int) and not isinstance(x, bool) and x >= 0:
                out.add(x)
    return out


def has_tokenizer(model: str) -> bool:
    return os.path.isdir(model) and any(os.path.exists(os.path.join(model, f)) for f in _TOKENIZER_FILES)


class LazyTokenizer:
    """Loads on first use (importing transformers costs seconds); `get()` returns None when there is none."""

    def __init__(self, source):
        if isinstance(source, os.PathLike):   # a pathlib.Path is a path too, not a tokenizer object
            source = os.fspath(source)
        self._source = source  # a path, a ready tokenizer object, or None
        self._tok = None if isinstance(source, (str, type(None))) else source
        self._loaded = self._tok is not None or source is None or not has_tokenizer(source)
        self._lock = threading.Lock()

    def get(self):
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    from transformers import AutoTokenizer
                    try:
                        self._tok = AutoTokenizer.from_pretrained(self._source)
                    except Exception as e:   # (a damaged tokenizer.json was a bare JSONDecodeError from transformers,
                        # for token-id prompts too: the engine asks for the tokenizer's EOS and output text)
                        from .errors import NoTokenizerError
                        raise NoTokenizerError(
                            f"cannot load the tokenizer in {self._source} ({type(e).__name__}: {str(e)[:300]}): its "
                            "tokenizer files are damaged, incomplete or need a package that is not installed; "
                            "download them again, or pass tokenizer=<a directory or tokenizer object that loads>"
                        ) from e
                    self._loaded = True
        return self._tok

    @property
    def available(self) -> bool:
        return self._tok is not None or (not self._loaded)

    def eos_token_ids(self) -> set[int]:
        tok = self.get()
        if tok is None or tok.eos_token_id is None:
            return set()
        e = tok.eos_token_id
        return set(e) if isinstance(e, (list, tuple)) else {int(e)}
