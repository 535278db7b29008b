"""`RequestChecks`: a request's validation and a prompt's tokenisation, from what an engine declares of itself
(vocab_size, kv_spec, device_sampling, full_sampling, tokenizer, allocator.pages_for). `LLMEngine` inherits them;
so does the HTTP process's view of an engine that runs in another process (engine_process.EngineView), which
refuses a bad request before it crosses the pipe.
"""
from __future__ import annotations

from typing import Sequence

from .errors import InvalidRequestError, NoTokenizerError, PromptTooLongError
from .sampling import SamplingParams, check_device_sampling


class RequestChecks:
    def tokenize(self, prompt: str) -> list[int]:
        tok = self.tokenizer.get()
        if tok is None:
            raise NoTokenizerError("a text prompt needs a tokenizer, and this model has none: pass token ids "
                                   "(list[int]) instead, or use a model directory that contains tokenizer files")
        return list(tok.encode(prompt, add_special_tokens=True))

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> int:
        """Check a request before it is queued; returns its max total length (prompt + generated)."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids must be ints in [0, {self.vocab_size}); got e.g. {bad[:3]}")
        check_device_sampling(params, self.device_sampling, self.full_sampling)
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop_token_ids must be < vocab size {self.vocab_size}; got {bad_stop}")
        if params.stop and not self._has_tokenizer():
            raise NoTokenizerError("stop strings need a tokenizer to turn the output into text, and this model has "
                                   "none: use stop_token_ids, or a model directory that contains tokenizer files")
        bad_bias = [t for t, _ in params.logit_bias or () if t >= self.vocab_size]
        if bad_bias:
            raise InvalidRequestError(f"logit_bias token ids must be < vocab size {self.vocab_size}; got {bad_bias[:5]}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidRequestError(f"logprobs={params.logprobs} exceeds the vocabulary ({self.vocab_size} tokens)")
        ctx = self.kv_spec.max_seq_len
        if n >= ctx:
            raise PromptTooLongError(f"the prompt has {n} tokens but the context holds {ctx} (prompt + generated); "
                                     f"shorten it to at most {ctx - 1} tokens or create the LLM with a larger "
                                     "max_seq_len (--max-seq-len for the server and the jobs)")
        max_total = ctx if params.max_tokens is None else min(ctx, n + params.max_tokens)
        pages = self.allocator.pages_for(max(1, max_total - 1))
        if pages > self.kv_spec.num_pages:
            raise PromptTooLongError(f"the request needs {pages} KV pages (prompt {n} + up to "
                                     f"{max_total - n} generated tokens) but the cache has only "
                                     f"{self.kv_spec.num_pages}; "
                                     + ("lower max_tokens, or " if params.max_tokens is not None else
                                        "set max_tokens, or ")
                                     + f"create the LLM with num_pages >= {pages} (--num-pages for the server and the jobs)")
        return max_total


    def _has_tokenizer(self) -> bool:
        return self.tokenizer.available and self.tokenizer.get() is not None
