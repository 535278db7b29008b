"""`LLM`: the offline entry point. Build the workers, then `generate` (all at once) or `stream` (as produced).

    from mpk_runtime import LLM, SamplingParams
    llm = LLM("tiny-llama", dtype="float32")
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
"""
from __future__ import annotations

import dataclasses
import itertools
import numbers
import os
import threading
from typing import Any, Callable, Iterator, Sequence

from ..models import ConfigError, load_config
from ..runtime.executor import Executor, make_executor
from .engine import LLMEngine, check_decode_steps_arg, check_max_num_batched_tokens, check_step_timeout
from .errors import InvalidRequestError, NoTokenizerError, RequestFailedError, ShutDownError, UnknownModelError
from .request import RequestOutput, merge_completions
from .sampling import DEVICE_SAMPLING_MODES, SamplingParams, completions
from .tokenizer import _TOKENIZER_FILES, LazyTokenizer, has_tokenizer, model_eos_ids

Prompt = "str | list[int]"
# decode steps per engine step by default where the backend samples on the device. Session 49 (1x H200, LLM.generate
# through plan="auto", 128 new tokens, synchronous bursts): llama-3.2-1b B=1 1.441 -> 1.152 ms a token (k = 8; 1.247
# at 4, 1.126 at 16), B=32 2.428 -> 1.918, B=128 4.632 -> 3.931; qwen3-8b B=1 5.344 -> 4.854, B=8 6.256 -> 5.856: it
# was 8. With pipelined bursts (session 54, 1x H100, ms a decode step without the prefill steps) the length stops
# mattering: B=1 k = 2 / 4 / 8 1.265 / 1.263 / 1.272, B=128 1.991 / 2.034 / 2.065 (synchronous: 1.429 / 1.401 / 1.336,
# 2.643 / 2.521 / 2.259). 4 keeps twice k = 2's host slack a burst and halves 8's tokens computed past a stop, the
# granularity of streamed tokens and the burst an arrival waits behind.
DEFAULT_DECODE_STEPS = 4


def resolve_model(model: str):
    """The model's config, or an `UnknownModelError` that lists what would work."""
    if isinstance(model, os.PathLike):   # (a pathlib.Path of a model directory, as tokenizer= takes one)
        model = os.fspath(model)
    if not isinstance(model, str) or not model:
        raise UnknownModelError(f"model must be a preset name or a local model directory, got {model!r}")
    try:   # (load_config says which: an unknown name (listing the presets), a missing directory, a file)
        return load_config(model)
    except ConfigError as e:
        raise UnknownModelError(str(e)) from e


def _token_ids(p) -> list[int] | None:
    """p as a list of int token ids, or None when it is not one. numpy / other integer scalars (list(np.array(ids)))
    are the ints they stand for, as in SamplingParams; bools are not token ids."""
    if not isinstance(p, (list, tuple)):
        return None
    out = []
    for t in p:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            return None
        out.append(int(t))
    return out


def _prompt_dict(p: dict) -> str | list[int]:
    """vLLM's prompt dicts: {"prompt": text} (TextPrompt) or {"prompt_token_ids": ids} (TokensPrompt)."""
    other = sorted(set(p) - {"prompt", "prompt_token_ids"})
    if other or len(p) != 1:
        raise InvalidRequestError(f"a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids' (a list "
                                  f"of ints), as vLLM's TextPrompt / TokensPrompt; got the keys {sorted(p)}"
                                  + (f" ({other} are not supported here)" if other else ""))
    if "prompt" in p:
        if not isinstance(p["prompt"], str):
            raise InvalidRequestError(f"'prompt' must be a string (token ids go in 'prompt_token_ids'), got "
                                      f"{p['prompt']!r:.60}")
        return p["prompt"]
    ids = _token_ids(p["prompt_token_ids"])
    if ids is None:
        raise InvalidRequestError(f"'prompt_token_ids' must be a list of int token ids, got {p['prompt_token_ids']!r:.60}")
    return ids


def normalize_prompts(prompts: Any) -> list[str | list[int]]:
    """One prompt (str, list[int], or vLLM's {"prompt": str} / {"prompt_token_ids": list[int]}) or a list of
    them -> a list of prompts (str or list[int])."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, dict):
        return [_prompt_dict(prompts)]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise InvalidRequestError("no prompts given: pass a string, a list of token ids, or a list of those")
        if not any(isinstance(t, (str, list, tuple, dict)) for t in prompts):
            ids = _token_ids(prompts)
            if ids is not None:
                return [ids]
        out = []
        for p in prompts:
            ids = None if isinstance(p, str) else _token_ids(p)
            if isinstance(p, dict):
                out.append(_prompt_dict(p))
            elif isinstance(p, str):
                out.append(p)
            elif ids is not None:
                out.append(ids)
            else:
                raise InvalidRequestError(f"each prompt must be a str, a list of int token ids or a prompt dict "
                                          f"({{'prompt': ...}} / {{'prompt_token_ids': ...}}); got {p!r:.80}")
        return out
    raise InvalidRequestError(f"prompts must be a str, a list[int] or a list of those; got {type(prompts).__name__}")


# vLLM's LLM keywords that are ours under another name: (vLLM's, ours, our default)
VLLM_ARGS = (("tensor_parallel_size", "tp", 1), ("max_model_len", "max_seq_len", None), ("max_num_seqs", "max_batch", 8))


class LLM:
    def __init__(self, model: str, backend: str = "reference", tp: int = 1, executor: str | Executor = "inprocess",
                 seed: int = 0, dtype: str | None = None, max_batch: int = 8, max_seq_len: int | None = None,
                 page_size: int = 16, num_pages: int | None = None, tokenizer: Any = None,
                 max_num_batched_tokens: int | None = None, step_timeout: float | None = None,
                 executor_kwargs: dict | None = None, device_sampling: str = "auto", decode_steps: int | None = None,
                 enable_prefix_caching: bool | None = None, async_bursts: bool | None = None,
                 kv_allocation: str = "lazy", generation_config: str | os.PathLike | None = "auto",
                 **runner_kwargs: Any):
        """model: preset name or local HF directory. backend: runner registry name ("reference", "pyvm",
        "torch", "megakernel"). tp: ranks per replica (vLLM's tensor_parallel_size; max_model_len and max_num_seqs
        are taken as max_seq_len and max_batch too). executor: "inprocess", "ray" (after `import cluster`)
        or an Executor instance (not yet initialised). tokenizer: None = from the model directory if present,
        a path, or a tokenizer object. device_sampling: "auto" | "on" | "off", which requests the runner samples
        on device (see SamplingParams). decode_steps: up to this many decode steps per engine step while every
        running request is sampled on the device and no waiting one could be admitted (the tokens stay on the GPU between them; fewer
        host round trips, tokens arrive in bursts; LLMEngine's doc); None = DEFAULT_DECODE_STEPS where the backend
        samples on the device and device_sampling is not "off", else 1. enable_prefix_caching: pages of computed
        tokens stay cached by content, and a prompt that starts with cached pages (a shared system prompt, a chat's
        earlier turns) takes them instead of computing them again (engine/prefix_cache.py; backends that keep K/V
        only in the engine's pages: pyvm, torch, megakernel; None, the default: on where the backend does that).
        async_bursts: the next burst of decode steps is queued on the workers before the engine reads the last
        one's tokens (engine/bursts.py; needs decode_steps > 1; None, the default: on wherever decode_steps > 1). kv_allocation: "lazy" (default: a request takes KV pages as its tokens need
        them; when they run out the request admitted last is preempted and later computed again) or "reserve" (its
        whole length, prompt + max_tokens, at admission; never preempted): engine/scheduler.py. Other keywords go to
        the runner; among them `plan` (backends pyvm and megakernel): "auto" = the planner's plan per decode batch
        bucket (megakernel at tp > 1: one whole-step megakernel per bucket, runtime/tp_buckets.py), None = one task
        graph / megakernel for max_batch rows; not given: "auto" for the megakernel backend, else None
        (runtime/executor.default_plan). generation_config: where the sampling defaults of a call without
        SamplingParams come from (get_default_sampling_params): "auto" (default, as vLLM's) = the model directory's
        generation_config.json (the maker's temperature / top_p / top_k / min_p / repetition_penalty /
        max_new_tokens), "vllm" = none (SamplingParams()), or a directory holding such a file
        (engine/generation_config.py)."""
        # vLLM's names for three of ours (tensor_parallel_size=2 is tp=2 here), taken as those
        ours = {"tp": tp, "max_seq_len": max_seq_len, "max_batch": max_batch}
        for theirs, name, default in VLLM_ARGS:
            if theirs in runner_kwargs:
                v = runner_kwargs.pop(theirs)
                if ours[name] != default and ours[name] != v:
                    raise InvalidRequestError(f"{theirs}={v!r} and {name}={ours[name]!r} disagree: {theirs} (vLLM's "
                                              f"name) is {name} here; give one of them")
                ours[name] = v
        tp, max_seq_len, max_batch = ours["tp"], ours["max_seq_len"], ours["max_batch"]
        if device_sampling not in DEVICE_SAMPLING_MODES:
            raise InvalidRequestError(f"device_sampling must be one of {DEVICE_SAMPLING_MODES}, got {device_sampling!r}")
        if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):
            seed = int(seed)   # (np.int64 as the int it stands for, as SamplingParams takes it)
        else:   # (None / a float failed inside the runner's weights as a TypeError; True ran as seed 1)
            raise InvalidRequestError(f"seed must be an int (the engine seed: a preset's random weights and the "
                                      f"requests' sampling seeds; any int), got {seed!r}")
        check_decode_steps_arg(decode_steps, none_ok=True)
        check_max_num_batched_tokens(max_num_batched_tokens)
        check_step_timeout(step_timeout)
        from .scheduler import KV_ALLOCATION_MODES
        if kv_allocation not in KV_ALLOCATION_MODES:
            raise InvalidRequestError(f"kv_allocation must be one of {KV_ALLOCATION_MODES}, got {kv_allocation!r}")
        for name, v in (("enable_prefix_caching", enable_prefix_caching), ("async_bursts", async_bursts)):
            if v is not None and not isinstance(v, bool):
                raise InvalidRequestError(f"{name} must be True, False or None (automatic), got {v!r}")
        if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)) and not all(
                callable(getattr(tokenizer, m, None)) for m in ("encode", "decode")):
            # (an int / other object was taken for a tokenizer, and generate failed with an AttributeError)
            raise InvalidRequestError(f"tokenizer must be None (the model directory's), a path to a directory "
                                      f"holding a tokenizer, or a tokenizer object (with encode and decode: a Hugging "
                                      f"Face tokenizer), got {type(tokenizer).__name__} {tokenizer!r:.60}")
        if isinstance(tokenizer, (str, os.PathLike)) and not has_tokenizer(os.fspath(tokenizer)):
            # (a tokenizer asked for by path that holds none was silently no tokenizer: text prompts then failed)
            raise InvalidRequestError(
                f"tokenizer={os.fspath(tokenizer)!r}: not a directory holding a tokenizer (one of {list(_TOKENIZER_FILES)}); "
                f"give such a directory (a model's own is used when tokenizer is None) or a tokenizer object")
        if isinstance(model, os.PathLike):   # (the runners, the tokenizer and the EOS ids take it as a str)
            model = os.fspath(model)
        self.model = model
        # request id -> the inbox of the call (generate / stream) that added it: request id -> the update it has not
        # taken yet (the updates of several steps merged into one). The calls of one LLM share its engine and any of
        # them steps it (a stream() suspended while a generate() runs, two streams consumed in turn), so a step's
        # outputs go to their own call (each call took every output as its own or dropped it: generate() ended on
        # another call's request with a KeyError, a stream lost updates and its final output)
        self._inboxes: dict[str, dict[str, RequestOutput]] = {}
        # calls from several threads take turns at the engine (not thread-safe): its steps, adds and aborts, and the
        # inboxes, run under this lock (two threads' generate() stepped it at once and failed inside a step)
        self._lock = threading.RLock()
        self.config = resolve_model(model)
        from .generation_config import log_defaults, sampling_defaults
        self.default_sampling = sampling_defaults(model, generation_config)   # (before any worker starts)
        log_defaults(self.default_sampling, f"LLM({model!r})")
        if not isinstance(tp, int) or tp < 1:
            raise InvalidRequestError(f"tp must be an int >= 1, got {tp!r}")
        from ..ir.shard import check_tp
        try:   # before any executor exists: a Ray one would first wait for tp bundles (60 s when they do not fit)
            check_tp(self.config, tp)
        except ConfigError as e:
            raise InvalidRequestError(str(e)) from None
        from ..runtime.base import runner_params
        known = runner_params(backend) if isinstance(backend, str) else None
        unknown = sorted(set(runner_kwargs) - known) if known is not None else []
        if unknown:   # a typo (max_seqlen=) or a sampling option (temperature=) would otherwise do nothing
            raise InvalidRequestError(f"unknown keyword argument(s) {unknown} for LLM(backend={backend!r}); "
                                      f"the {backend!r} runner takes {sorted(known)}; sampling options go in "
                                      "SamplingParams")
        if isinstance(executor, str):
            executor = make_executor(executor, tp, **(executor_kwargs or {}))
        elif executor.world_size != tp:
            raise InvalidRequestError(f"the executor has world_size {executor.world_size} but tp={tp}")
        self.executor = executor
        self.runner_kwargs = dict(model=model, seed=seed, dtype=dtype, max_batch=max_batch, max_seq_len=max_seq_len,
                                  page_size=page_size, num_pages=num_pages, **runner_kwargs)
        try:
            executor.init_workers(backend, **self.runner_kwargs)
            kv_spec = executor.collective_rpc("kv_spec")[0]
            if kv_spec.max_seq_len < 2:   # (every request failed as "shorten it to at most 0 tokens")
                raise InvalidRequestError(f"max_seq_len={kv_spec.max_seq_len} leaves no room for a generated token "
                                          "after a prompt of at least one: use max_seq_len >= 2")
            on_device = device_sampling != "off" and executor.collective_rpc("samples_on_device")[0]
            full = on_device and executor.collective_rpc("samples_full_on_device")[0]
            shares = executor.collective_rpc("shares_kv_pages")[0]
            if enable_prefix_caching is None:
                enable_prefix_caching = bool(shares)
            if enable_prefix_caching and not shares:
                raise InvalidRequestError(
                    f"enable_prefix_caching needs a backend that keeps K/V only in the engine's pages; {backend!r} "
                    "keeps a cache per sequence: use backend 'pyvm', 'torch' or 'megakernel', or leave prefix "
                    "caching off")
            if decode_steps is None:
                decode_steps = DEFAULT_DECODE_STEPS if on_device else 1
            elif decode_steps > 1 and not on_device:
                raise InvalidRequestError(
                    f"decode_steps={decode_steps} keeps the drawn tokens on the device between steps, and "
                    + (f"backend {backend!r} does not sample on the device" if device_sampling != "off" else
                       "device_sampling='off' samples every token on the host")
                    + ": use decode_steps=1, or backend 'megakernel' / 'torch' / 'pyvm' with device_sampling 'auto'")
            if async_bursts is None:   # (engine/bursts.py: pipelined bursts gained at every measured size)
                async_bursts = decode_steps > 1
            if async_bursts and decode_steps < 2:
                raise InvalidRequestError(f"async_bursts overlaps bursts of decode steps; decode_steps={decode_steps} "
                                          "runs none: leave decode_steps out (4 where the backend samples on the "
                                          "device) or set it > 1")
        except BaseException as e:
            executor.shutdown()
            if isinstance(e.__cause__, ValueError):  # a bad argument (backend name, tp, sizes): the caller's to fix
                raise InvalidRequestError(str(e)) from e
            raise
        src = tokenizer if tokenizer is not None else model
        self.engine = LLMEngine(executor, kv_spec, self.config.vocab_size, LazyTokenizer(src), seed=seed,
                                max_num_batched_tokens=max_num_batched_tokens, step_timeout=step_timeout,
                                device_sampling=device_sampling, eos_ids=model_eos_ids(model),
                                decode_steps=decode_steps, full_sampling=full,
                                prefix_caching=enable_prefix_caching, async_bursts=async_bursts,
                                kv_allocation=kv_allocation)

    @property
    def tokenizer(self):
        """The Hugging Face tokenizer (loaded on first use), or None when the model has none."""
        return self.engine.tokenizer.get()

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a generate / chat / stream call given none (vLLM's method): SamplingParams() with
        the model's generation_config.json defaults (LLM's generation_config; empty for a preset)."""
        return SamplingParams(**self.default_sampling)

    def get_tokenizer(self):
        """vLLM's name for `tokenizer`."""
        return self.tokenizer

    def _add_all(self, prompts, sampling_params, stream: bool = True,
                 rendered: list[tuple[list[int], str]] | None = None
                 ) -> tuple[list[str], dict[str, RequestOutput], list[list[str]]]:
        """Queue a call's requests: SamplingParams.n of them a prompt (sampling.completions). Their ids, the call's
        inbox (_step puts their outputs there), and the ids of each prompt's completions in index order. rendered:
        instead of prompts, (token ids, text) pairs already tokenised (chat prompts: the text is what the outputs
        report as their prompt)."""
        if getattr(self, "_shut_down", False):   # (each request failed as "the model workers failed ... retry it")
            raise ShutDownError("this LLM has been shut down (LLM.shutdown(), or its with-block ended): create a new "
                                "LLM to generate again")
        prompts = normalize_prompts(prompts) if rendered is None else rendered
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError(f"{len(params)} sampling params for {len(prompts)} prompts: pass one, or one per prompt")
        # Tokenize and validate everything before queueing anything: a bad prompt rejects the whole call.
        staged = []
        for p, sp in zip(prompts, params):
            if rendered is not None:
                ids, text = p
            else:
                ids, text = (self.engine.tokenize(p), p) if isinstance(p, str) else (p, None)
            self.engine.validate(ids, sp)
            staged.append((ids, sp, text))
        inbox: dict[str, RequestOutput] = {}
        groups: list[list[str]] = []
        with self._lock:
            try:
                for ids, sp, text in staged:
                    groups.append([])
                    for one in completions(sp):
                        groups[-1].append(self.engine.add_request(ids, one, prompt=text, stream=stream))
            except BaseException:   # (the engine went down meanwhile: none of this call's requests stays queued)
                for r in itertools.chain.from_iterable(groups):
                    self.engine.abort(r)
                raise
            rids = list(itertools.chain.from_iterable(groups))
            boxes = self._inboxes
            for r in rids:
                boxes[r] = inbox
        return rids, inbox, groups

    def _take(self, inbox: dict[str, RequestOutput]) -> list[RequestOutput]:
        """The outputs waiting in a call's inbox, taken."""
        with self._lock:
            got = list(inbox.values())
            inbox.clear()
        return got

    def _advance(self, inbox: dict[str, RequestOutput]) -> bool:
        """One engine step for a call whose inbox is empty (none when another thread's step filled it meanwhile);
        False when nothing is left to run."""
        with self._lock:
            if inbox:
                return True
            if not self.engine.has_unfinished():
                return False
            self._step()
            return True

    def _step(self) -> None:
        """One engine step; each output goes to the inbox of the call that owns its request (others: dropped)."""
        boxes = self._inboxes
        for o in self.engine.step():
            box = boxes.get(o.request_id)
            if box is None:
                continue
            old = box.get(o.request_id)
            if old is not None:   # not taken yet: one update with both deltas
                o = dataclasses.replace(o, delta_token_ids=old.delta_token_ids + o.delta_token_ids,
                                        delta_text=None if o.delta_text is None else
                                        (old.delta_text or "") + o.delta_text)
            box[o.request_id] = o

    def _close(self, rids) -> None:
        """The end of a call: abort its requests still running (interrupted, an engine error, a stream stopped
        early) and forget their inbox."""
        with self._lock:
            boxes = self._inboxes
            for r in rids:
                if boxes.pop(r, None) is not None:
                    self.engine.abort(r)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, on_output: Callable[[int, RequestOutput], None] | None = None
                 ) -> list[RequestOutput]:
        """Outputs in prompt order. Raises `RequestFailedError` when the workers failed during the call, after every
        request has ended. on_output(index, output): called in prompt order as soon as a request and every one before
        it have ended (a failed one too), so a caller keeps what finished when a later request fails or ^C stops
        the call."""
        # stream=False: the engine reports them only at their end (a snapshot a step of each would be wasted)
        return self._run(*self._add_all(prompts, sampling_params, stream=False), use_tqdm, on_output)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False, on_output: Callable[[int, RequestOutput], None] | None = None
             ) -> list[RequestOutput]:
        """vLLM's LLM.chat: messages is one conversation (a list of {"role": ..., "content": ...} dicts) or a list
        of conversations. Each is rendered with the model tokenizer's chat template (add_generation_prompt=True;
        engine/chat.py `render_chat`, as the HTTP server's /v1/chat/completions renders it), then generated as
        `generate` generates prompts: one RequestOutput per conversation, in order, whose `prompt` is the rendered
        text and `prompt_token_ids` its tokens. sampling_params: one for all, or one per conversation (None:
        get_default_sampling_params(): max_tokens 16 unless the model's generation config says otherwise). Roles are
        OpenAI's (system, developer, user, assistant, tool, function); content a string (None for an assistant turn),
        or a list of {"type": "text", "text": ...} parts (joined); other message keys are
        dropped. Every conversation is checked before any is queued: InvalidRequestError for a bad one (named by
        its index when there are several) or one the template refuses; NoTokenizerError when the model has no
        tokenizer or no chat template."""
        from .chat import conversations, render_chat
        convs = conversations(messages)
        tok = self.tokenizer
        rendered = []
        for i, conv in enumerate(convs):
            try:
                rendered.append(render_chat(tok, conv, "llm"))
            except InvalidRequestError as e:
                if len(convs) == 1 or isinstance(e, NoTokenizerError):
                    raise
                raise type(e)(f"conversation {i}: {e}") from None
        return self._run(*self._add_all(None, sampling_params, stream=False, rendered=rendered), use_tqdm,
                         on_output)

    def _run(self, rids: list[str], inbox: dict[str, RequestOutput], groups: list[list[str]], use_tqdm: bool,
             on_output: Callable[[int, RequestOutput], None] | None) -> list[RequestOutput]:
        """generate's loop: step until the call's requests have ended; an output a prompt, in order (its n
        completions merged: request.merge_completions)."""
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(rids) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(rids), desc="generate", unit="req")
        told = 0
        try:
            while True:
                for o in self._take(inbox):
                    if o.finished:
                        final[o.request_id] = o
                        if bar is not None:
                            bar.update(1)
                while on_output is not None and told < len(groups) and all(r in final for r in groups[told]):
                    on_output(told, merge_completions([final[r] for r in groups[told]]))
                    told += 1
                if len(final) == len(rids):
                    break
                if not self._advance(inbox):   # (not expected: every request ends with an output)
                    raise RequestFailedError(f"{len(rids) - len(final)} of {len(rids)} requests ended without a "
                                             "final output")
        finally:
            if bar is not None:
                bar.close()
            self._close(rids)   # interrupted (KeyboardInterrupt, an engine error): do not leave our requests queued
        errors = [o for o in final.values() if o.finish_reason == "error"]
        if errors:
            raise RequestFailedError(f"{len(errors)} of {len(rids)} requests failed: {errors[0].error}")
        return [merge_completions([final[r] for r in g]) for g in groups]

    def stream(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[RequestOutput]:
        """Yields a snapshot each time a request gains tokens (delta_token_ids / delta_text) and when it ends.
        Requests of one call interleave; tell them apart by request_id: "i" for prompt i (its place in `prompts`),
        "i-j" for the j-th of its SamplingParams.n completions (whose `index` is j), as cluster.Client.stream names
        them. Other calls of this LLM (a generate(), another stream) may run while this one is suspended: the steps
        they run keep this call's updates for it."""
        rids, inbox, groups = self._add_all(prompts, sampling_params)
        # (the engine's ids are numbers across every call: a caller could not tell which prompt a snapshot is of)
        named = {r: (str(i) if j == 0 else f"{i}-{j}", j) for i, g in enumerate(groups) for j, r in enumerate(g)}
        left = set(rids)
        try:
            while left:
                got = self._take(inbox)
                if not got:
                    if not self._advance(inbox):   # (not expected: every request ends with an output)
                        raise RequestFailedError(f"{len(left)} of {len(rids)} requests ended without a final output")
                    continue
                for o in got:
                    if o.finish_reason == "error":
                        raise RequestFailedError(o.error)
                    if o.finished:
                        left.discard(o.request_id)
                    rid, j = named[o.request_id]
                    yield dataclasses.replace(o, request_id=rid, index=j)
        finally:  # the caller stopped early: do not leave its requests running
            self._close(rids)

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache (enable_prefix_caching): the pages it held; see LLMEngine.reset_prefix_cache."""
        with self._lock:
            return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the workers (idempotent); later generate / stream calls raise ShutDownError."""
        self._shut_down = True
        self.executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
