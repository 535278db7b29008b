"""A request's mutable state inside the engine, and the immutable snapshots (`RequestOutput`) callers see."""
from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Sequence


from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # queued, or preempted (its pages taken back; it computes its tokens again when readmitted)
    RUNNING = "running"      # holds pages; prefilling or decoding
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float                 # time.monotonic() when accepted
    first_token_time: float | None      # when the first generated token was sampled
    finish_time: float | None
    num_prompt_tokens: int
    num_generated_tokens: int

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def per_token_latency(self) -> float | None:
        """Mean time between generated tokens after the first (None with fewer than two tokens)."""
        if self.finish_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated_tokens - 1)

    def to_dict(self) -> dict:
        return {"time_to_first_token": self.time_to_first_token, "per_token_latency": self.per_token_latency,
                "num_prompt_tokens": self.num_prompt_tokens, "num_generated_tokens": self.num_generated_tokens}


@dataclass(frozen=True)
class CompletionOutput:
    """One completion in vLLM's shape, `RequestOutput.outputs[0]`: code written against vLLM's LLM (`out.outputs[0].text`)
    reads the same here. logprobs as RequestOutput's: {token id: logprob} a token (vLLM's values are Logprob objects).
    error: why it failed (finish_reason "error"; the prompt's RequestOutput.error is completion 0's only)."""
    index: int
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    stop_reason: int | str | None = None   # vLLM's: the stop string or stop token id that ended it (EOS: None)

    @property
    def cumulative_logprob(self) -> float | None:
        """vLLM's: the sum of the generated tokens' logprobs (the sampled token's, each position's first entry);
        None without SamplingParams.logprobs."""
        if self.logprobs is None:
            return None
        return float(sum(next(iter(lp.values())) for lp in self.logprobs if lp))


@dataclass(frozen=True)
class RequestOutput:
    """A snapshot of one request. `token_ids`/`text` are everything so far; `delta_*` is what this update added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    delta_token_ids: list[int]
    delta_text: str | None
    finished: bool
    finish_reason: str | None           # "stop" | "length" | "abort" | "error"
    error: str | None
    metrics: RequestMetrics
    # SamplingParams.logprobs set: one {token id: logprob} per generated token (the sampled token first, then the
    # top ones); the delta's are the last len(delta_token_ids)
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0          # prompt tokens taken from the prefix cache (not computed for this request)
    index: int = 0                      # which of its prompt's SamplingParams.n completions this is
    # SamplingParams.n > 1 in LLM.generate / chat (and cluster.Client's): the prompt's n completions, in index order,
    # this output's own fields being completion 0's; None: this output is its one completion
    completions: tuple[CompletionOutput, ...] | None = None
    # finish_reason "stop": the stop string or stop_token_ids entry that ended it (vLLM's stop_reason); None for EOS
    # and every other ending
    stop_reason: int | str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return self.completion().cumulative_logprob

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's view of the prompt's completions (n of them for SamplingParams.n = n, else this one): each its
        index, text, token ids, finish reason and logprobs."""
        if self.completions is not None:
            return list(self.completions)
        return [self.completion()]

    def completion(self) -> CompletionOutput:
        """This output's own completion (vLLM's CompletionOutput)."""
        return CompletionOutput(self.index, self.text, self.token_ids, self.finish_reason, self.logprobs, self.error,
                                self.stop_reason)

    @classmethod
    def failed(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int], error: str) -> "RequestOutput":
        """The end of a request that never ran (its engine died, or refused it after it was queued)."""
        now = time.monotonic()
        return cls(request_id, prompt, list(prompt_token_ids), [], None, [], None, True, "error", error,
                   RequestMetrics(now, None, now, len(prompt_token_ids), 0))

    def to_dict(self) -> dict:
        d = {"request_id": self.request_id, "prompt": self.prompt, "prompt_token_ids": self.prompt_token_ids,
             "token_ids": self.token_ids, "text": self.text, "finished": self.finished,
             "finish_reason": self.finish_reason, "error": self.error, "metrics": self.metrics.to_dict(),
             "num_cached_tokens": self.num_cached_tokens}
        if self.stop_reason is not None:
            d["stop_reason"] = self.stop_reason
        if self.logprobs is not None:
            d["logprobs"] = logprobs_by_id(self.logprobs)
        if self.index:   # (a streamed snapshot of completion j > 0 of its prompt)
            d["index"] = self.index
        if self.completions is not None:   # (n > 1: the top-level fields are completion 0's)
            d["completions"] = [{"index": c.index, "token_ids": c.token_ids, "text": c.text,
                                 "finish_reason": c.finish_reason,
                                 **({} if c.stop_reason is None else {"stop_reason": c.stop_reason}),
                                 **({} if c.logprobs is None else {"logprobs": logprobs_by_id(c.logprobs)}),
                                 **({} if c.error is None else {"error": c.error})}
                                for c in self.completions]
        return d


def merge_completions(outs: Sequence[RequestOutput]) -> RequestOutput:
    """One prompt's n finished completions (index order) as one RequestOutput: completion 0's fields, and all n
    in `completions` (vLLM's outputs[j])."""
    if len(outs) == 1:
        return outs[0]
    return dataclasses.replace(outs[0], completions=tuple(dataclasses.replace(o, index=j).completion()
                                                         for j, o in enumerate(outs)))


def logprobs_by_id(lps: list[dict[int, float]]) -> list[list[list]]:
    """RequestOutput.logprobs in JSON form (its keys would become strings): [[token id, logprob], ...] a token."""
    return [[[t, v] for t, v in lp.items()] for lp in lps]


@dataclass(eq=False)
class Request:
    request_id: str
    seq_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_len: int                  # prompt + generated never exceeds this (max_tokens and context)
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0               # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    stop_reason: int | str | None = None   # RequestOutput.stop_reason
    text: str | None = None             # detokenized output so far (when a tokenizer exists)
    device_sampling: tuple | None = None   # (DeviceSampling or None,) once the engine decided (engine._device_sampling)
    output_logprobs: list[dict[int, float]] | None = None   # SamplingParams.logprobs set: one dict a generated token
    num_cached_tokens: int = 0          # prompt tokens whose K/V came from the prefix cache (prefix_cache.py)
    block_keys: list[bytes] = field(default_factory=list)   # prefix-cache keys of its full computed pages
    prompt_keys: list[bytes] = field(default_factory=list)  # keys of its prompt's first pages (admission retries)
    pending_keys: list[bytes] = field(default_factory=list)  # prompt pages it computes that others wait for
    was_held: bool = False              # its admission waited for another request's pending prompt page
    detok: Any = None                   # detokenize.IncrementalText once it has output text
    num_preemptions: int = 0            # times its pages were taken back for an older request (scheduler.py)
    computed_high: int = 0              # the most tokens it had computed before its last preemption
    stream: bool = True                 # reported after every step that gives it a token (else only at its end)
    _sent_tokens: int = 0               # how much of the output the last snapshot already reported
    _sent_text: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def decoding(self) -> bool:
        """Running with every token but the newest computed: its next chunk is that one token."""
        return bool(self.output_token_ids) and self.num_computed == self.num_tokens - 1

    def token_slice(self, a: int, b: int) -> list[int]:
        """all_token_ids[a:b] without building the whole list (a decode step reads one token of a long sequence)."""
        n = len(self.prompt_token_ids)
        if a >= n:
            return self.output_token_ids[a - n:b - n]
        if b <= n:
            return self.prompt_token_ids[a:b]
        return self.prompt_token_ids[a:] + self.output_token_ids[:b - n]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status, self.finish_reason, self.error = Status.FINISHED, reason, error
        self.finish_time = time.monotonic()

    def snapshot(self) -> RequestOutput:
        """The output so far, with the part not yet reported as the delta (advances the reported mark)."""
        delta = self.output_token_ids[self._sent_tokens:]
        self._sent_tokens = len(self.output_token_ids)
        delta_text = None
        if self.text is not None:
            delta_text = self.text[self._sent_text:]
            self._sent_text = len(self.text)
        # (the prompt's list is shared by every snapshot, not copied: the engine never changes it, and a long
        # prompt's copy a streamed update was most of a snapshot's cost)
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            token_ids=list(self.output_token_ids), text=self.text, delta_token_ids=delta,
            delta_text=delta_text, finished=self.finished, finish_reason=self.finish_reason, error=self.error,
            metrics=RequestMetrics(self.arrival_time, self.first_token_time, self.finish_time,
                                   len(self.prompt_token_ids), len(self.output_token_ids)),
            logprobs=None if self.output_logprobs is None else list(self.output_logprobs),
            num_cached_tokens=self.num_cached_tokens, stop_reason=self.stop_reason)
