"""`LLMEngine`: requests in, tokens out, one `step()` at a time, over any `Executor`.

The engine owns scheduling, page allocation and sampling; the executor's workers own compute and KV storage.
It calls workers only through `executor.collective_rpc` ("execute", "free", "health").
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Callable, Sequence

from ..runtime.base import KVSpec, SeqChunk
from ..runtime.executor import Executor
from .block_allocator import BlockAllocator
from .bursts import BurstsMixin
from .checks import RequestChecks
from .recovery import RecoveryMixin
from .prefix_cache import PrefixCachingAllocator
from .errors import InvalidRequestError, RequestFailedError
from .request import Request, RequestOutput, Status
from ..runtime.device_sampling import StepOutput
from ..ir.sampling import PAD_INDEX
from .sampling import (DEVICE_SAMPLING_MODES, SamplingParams, process_logits,
                       device_sampling_for, request_seed, sample, token_logprobs, _NONFINITE)
from .scheduler import Scheduler
from .step_stats import new_step_stats
from .detokenize import IncrementalText, text_decoder
from .tokenizer import LazyTokenizer

log = logging.getLogger(__name__)


def check_step_timeout(v) -> None:
    """step_timeout: None (wait as long as a step takes) or seconds > 0. (0, a negative or a string timeout failed
    every request at its first step as a worker fault to retry.)"""
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v < math.inf):
        raise InvalidRequestError(f"step_timeout must be None (no limit) or a number of seconds > 0 that one engine "
                                  f"step may take before its workers count as failed, got {v!r}")


def check_decode_steps_arg(v, none_ok: bool = False) -> None:
    if v is None and none_ok:
        return
    if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 64:
        raise InvalidRequestError(f"decode_steps must be {'None (automatic) or ' if none_ok else ''}an int in "
                                  f"[1, 64], got {v!r}")


# The tokens an engine step computes at most by default: a longer prompt is prefilled in chunks of this many. Without a
# bound a prompt was one chunk, and the conventional prefill's attention holds a (g * T, L) mask per sequence (g query
# heads a KV head, T the chunk's tokens, L its keys): 8 GiB at a 32k-token llama-3.2-1b prompt and 128 GiB at 128k,
# where a prompt of the model's context failed for memory. 4096 rows is also the largest prefill bucket captured as a
# CUDA graph (ConventionalPrefill.capture_tokens); a chunk streams the weights once (~0.5 ms at llama-3.2-1b on an
# H200 against ~10 ms of its 4096 tokens' matmuls), so chunking costs a long prompt a few percent of its prefill.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 4096


def step_token_budget(max_num_batched_tokens: int | None, kv_spec: KVSpec) -> int:
    """The scheduler's token budget a step: the caller's as given, or DEFAULT_MAX_NUM_BATCHED_TOKENS raised to
    max_batch. Decodes come first and are never cut by it (each running row decodes a token a step even where the
    caller's budget is below max_batch); prompt chunks take what is left. (It was min(max_seq_len, 4096) until session 64: a server
    of max_seq_len 256 admitted ~200 prompt tokens a step, so 4-24-token prompts arrived ~13 a step and the last one
    of each step was cut, its rest prefilled in the next step on the grouped path.)"""
    check_max_num_batched_tokens(max_num_batched_tokens)
    if max_num_batched_tokens is None:
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, kv_spec.max_batch)
    return max_num_batched_tokens


def check_max_num_batched_tokens(v) -> None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
        raise InvalidRequestError(f"max_num_batched_tokens must be None (automatic) or an int >= 1, got {v!r}")


class LLMEngine(BurstsMixin, RecoveryMixin, RequestChecks):
    def __init__(self, executor: Executor, kv_spec: KVSpec, vocab_size: int, tokenizer: LazyTokenizer | None = None,
                 seed: int = 0, max_num_batched_tokens: int | None = None, step_timeout: float | None = None,
                 device_sampling: str = "auto", eos_ids: set[int] | frozenset = frozenset(), decode_steps: int = 1,
                 full_sampling: bool = False, prefix_caching: bool = False, async_bursts: bool = False,
                 kv_allocation: str = "lazy"):
        """device_sampling: "auto" | "on" | "off": which requests the runner samples on device (SamplingParams
        doc); runners without device sampling always return logits, and the host samples. eos_ids: end-of-sequence
        ids beyond the tokenizer's (a model directory's generation_config.json / config.json). decode_steps: up to
        this many decode steps per engine step when every running row is sampled on the device and no waiting
        request could be admitted (none waits, or the batch is full) (ModelRunner.decode_steps: the drawn tokens stay on the device between the steps, one host
        round trip for all of them); the tokens past a row's stop are computed and dropped. full_sampling: the
        runner draws full-vocabulary rows (samples_full_on_device): top_k 0 / > 64 requests are sampled there.
        prefix_caching: computed pages stay cached by content and a prompt that starts with cached pages takes them
        instead of computing them (prefix_cache.py; the runner must keep K/V only in the pages: shares_kv_pages).
        async_bursts: the next burst of decode steps is queued before the engine reads the last one (bursts.py;
        needs decode_steps > 1). kv_allocation: "lazy" (pages taken as tokens need them,
        the newest request preempted and recomputed later when they run out) or "reserve" (a request's whole length
        at admission, never preempted): scheduler.py."""
        if device_sampling not in DEVICE_SAMPLING_MODES:
            raise InvalidRequestError(f"device_sampling must be one of {DEVICE_SAMPLING_MODES}, got {device_sampling!r}")
        check_decode_steps_arg(decode_steps)
        check_step_timeout(step_timeout)
        self.decode_steps = decode_steps
        self.async_bursts = bool(async_bursts)
        self._inflight = None   # bursts.Burst submitted and not read yet (async_bursts)
        self.device_sampling = device_sampling
        self.full_sampling = bool(full_sampling)
        self.executor = executor
        self.kv_spec = kv_spec
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer or LazyTokenizer(None)
        self._decode = None   # detokenize.text_decoder of the tokenizer, made at the first output text
        self.seed = seed
        self.model_eos = frozenset(t for t in eos_ids if 0 <= t < vocab_size)
        self.step_timeout = step_timeout
        # called with the failed requests' outputs as soon as a step fails, before the workers are rebuilt (which
        # can take many seconds): a caller that streams outputs (EngineLoop) tells its users now; _on_failure then
        # returns only the outputs it did not hand over
        self.on_failed_outputs: Callable[[list[RequestOutput]], None] | None = None
        self.prefix_caching = bool(prefix_caching)
        self.allocator = (PrefixCachingAllocator if self.prefix_caching else BlockAllocator)(kv_spec.num_pages,
                                                                                           kv_spec.page_size)
        self.scheduler = Scheduler(self.allocator, kv_spec.max_batch,
                                   step_token_budget(max_num_batched_tokens, kv_spec), kv_allocation)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self.dead: str | None = None  # set when the workers failed and could not be recovered
        # counters for /metrics
        self.stats = {"steps": 0, "tokens_generated": 0, "prompt_tokens": 0, "requests_finished": 0,
                      "requests_failed": 0, "recoveries": 0, "last_batch_size": 0, "max_batch_size_seen": 0,
                      "sequences_scheduled": 0,  # / steps = mean batch occupancy
                      "multi_steps": 0, "device_steps_in_multi": 0,   # engine steps running several decode steps
                      "async_bursts": 0,     # bursts submitted before the last one was read (async_bursts)
                      # requests by where their tokens are drawn: the step graph's sampler (greedy, top_k <= 64),
                      # the full-vocabulary draw on the device, the host sampler
                      "sampled_graph": 0, "sampled_full": 0, "sampled_host": 0,
                      # prefix caching: prompt tokens looked up at admission / found cached / cached pages evicted
                      "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0, "prefix_cache_evictions": 0,
                      "prefix_cache_held": 0,   # requests held back until a running one computed their prompt's pages
                      # lazy pages (scheduler.py): requests preempted, and their tokens computed again on readmission
                      "preemptions": 0, "recomputed_tokens": 0,
                      **new_step_stats()}        # where each step's time goes (step_stats.py; load_test prints it)

    # --- admission (validate / tokenize: checks.RequestChecks) -------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    prompt: str | None = None, stream: bool = True) -> str:
        """Queue a request; its id. stream=False: step() reports it only when it finishes (its last output's delta
        then holds every token), not after every step (a snapshot copies its tokens; the server's non-streaming
        requests need only the end)."""
        if self.dead:
            raise RequestFailedError(f"the engine is down ({self.dead}); create a new LLM / restart the server")
        prompt_token_ids = list(prompt_token_ids)
        max_total = self.validate(prompt_token_ids, params)
        if params.n != 1:
            raise InvalidRequestError(f"an engine request is one completion, and these params ask for n={params.n}: "
                                      "LLM.generate / chat / stream run n (or add one request for each of "
                                      "mpk_runtime.engine.sampling.completions(params))")
        idx = next(self._ids)
        rid = request_id if request_id is not None else str(idx)
        k = 0
        while request_id is None and rid in self._requests:   # (a caller's own id took this number)
            k += 1
            rid = f"{idx}-{k}"
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        req = Request(request_id=rid, seq_id=idx, prompt=prompt, prompt_token_ids=prompt_token_ids, params=params,
                      max_total_len=max_total,
                      output_logprobs=None if params.logprobs is None else [], stream=stream)
        if self._has_tokenizer():
            req.text = ""
        self._requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        if req is None or req.finished:
            return None
        if self._abort_inflight(req):   # (its pages are released after the burst in flight)
            return req.snapshot()
        was_running = req.status is Status.RUNNING
        self.scheduler.release(req)
        req.finish("abort")
        self._forget(req, free_on_workers=was_running)
        return req.snapshot()

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache (LLM(enable_prefix_caching=True)): later prompts compute every page again (a cold
        measurement, or weights changed under the same engine). Returns the pages that were cached (0 without it).
        Running requests keep their pages; their pages computed later are cached again."""
        return self.allocator.drop_cache() if self.prefix_caching else 0

    # --- stepping -----------------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def num_unfinished(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def step(self, outputs: str = "all") -> list[RequestOutput]:
        """Run one batch; returns a snapshot for every request that produced a token or finished
        (outputs="finished": only for the requests that finished: generate() needs no others, and a snapshot copies
        the request's tokens)."""
        if outputs not in ("all", "finished"):
            raise ValueError(f"outputs must be 'all' or 'finished', got {outputs!r}")
        if self._inflight is not None:   # a burst in flight (async_bursts): read it before scheduling anything
            return self._read_inflight(outputs == "all")
        t0 = time.perf_counter()
        c0 = time.thread_time()
        sched = self.scheduler.schedule()
        if self.scheduler.preempted:
            self._on_preempted()
        if self.prefix_caching:
            a, st = self.allocator, self.stats
            st["prefix_cache_query_tokens"], st["prefix_cache_hit_tokens"] = a.query_tokens, a.hit_tokens
            st["prefix_cache_evictions"], st["prefix_cache_held"] = a.evictions, a.held
        if not sched:
            if self.scheduler.waiting and not self.scheduler.running:
                # nothing runs and the head of the queue can never be admitted: fail loudly instead of letting
                # generate() spin forever
                raise RequestFailedError(
                    f"cannot admit request {self.scheduler.waiting[0].request_id!r}: max_batch="
                    f"{self.scheduler.max_batch}, {self.allocator.num_free} of {self.allocator.num_pages} KV pages "
                    "free; create the LLM with max_batch >= 1 and enough num_pages")
            return []
        chunks = []
        n_prompt = 0  # prompt chunks (a prompt, or a preempted request's tokens, computed); the rest decode rows
        for s in sched:
            r = s.request
            last = r.num_computed + s.num_tokens >= r.num_tokens   # this chunk yields the next token
            ds = self._device_sampling(r) if last else None
            if not r.decoding:
                n_prompt += 1
            chunks.append(SeqChunk(seq_id=r.seq_id, start_pos=r.num_computed, block_table=list(r.block_table),
                                   token_ids=r.token_slice(r.num_computed, r.num_computed + s.num_tokens),
                                   sampling=ds, wants_logits=last and ds is None))
        t1 = time.perf_counter()
        k = self._steps_for(sched, chunks)
        if k > 1:
            return self._step_many(sched, chunks, k, outputs == "all", t0, t1, c0)
        try:
            logits = self.executor.collective_rpc("execute", (chunks,), timeout=self.step_timeout)[0]
        except Exception as e:  # a worker died, hung or raised: fail what ran, keep what waits
            return self._on_failure(e)
        t2 = time.perf_counter()
        timing = getattr(self.executor, "last_timing", None)
        dev_tokens = None
        if isinstance(logits, StepOutput):
            logits, dev_tokens = logits.logits, logits.tokens.tolist()
        self._count_step(len(chunks))
        if logits is not None:
            self.stats["logits_bytes"] += logits.numel() * logits.element_size()
        now = time.monotonic()
        want_all = outputs == "all"
        outputs, done = [], []
        for i, s in enumerate(sched):
            r = s.request
            a, b = r.num_computed, r.num_computed + s.num_tokens
            if r.computed_high:   # preempted before: the positions it had computed are computed again
                again = max(0, min(b, r.computed_high) - a)
                self.stats["recomputed_tokens"] += again
                a += again
            self.stats["prompt_tokens"] += max(0, min(b, len(r.prompt_token_ids)) - a)
            r.num_computed += s.num_tokens
            self.allocator.commit(r)
            if r.num_computed < r.num_tokens:
                continue  # a prompt chunk that is not the last: nothing to sample yet
            try:
                if dev_tokens is not None and chunks[i].sampling is not None and (dev_tokens[i] >= 0 or logits is None):
                    tok = int(dev_tokens[i])   # (-1 or PAD_INDEX: the draw found no distribution: _bad_token)
                elif logits is None:
                    raise RuntimeError(f"the runner returned no logits and no device-sampled token for request "
                                       f"{r.seq_id}")
                else:
                    lg = logits[i]
                    if r.params.processed:
                        lg = process_logits(lg, r.params, r.output_token_ids, r.prompt_token_ids, self._eos_ids())
                    # (the device's draw for this seed and position: r.num_tokens - 1 is the row's last token)
                    tok = sample(lg, r.params, request_seed(r.params, self.seed, r.seq_id), r.num_tokens - 1)
                    if r.output_logprobs is not None:
                        r.output_logprobs.append(token_logprobs(logits[i], tok, r.params.logprobs))
                if not 0 <= tok < self.vocab_size:
                    raise RuntimeError(self._bad_token(tok))
            except Exception as e:  # one request's bad numbers fail that request only: never leave it RUNNING with
                log.exception("sampling failed for request %s", r.request_id)   # no token (nothing would ever
                r.finish("error", error=f"sampling failed for this request ({type(e).__name__}: {e})")   # resume it)
                self.stats["requests_failed"] += 1
                done.append(r)
                outputs.append(r.snapshot())
                continue
            reason = self._accept(r, tok, now)
            if reason:
                done.append(r)
            if reason or (want_all and r.stream):
                outputs.append(r.snapshot())
        self._finish_step(done, n_prompt, len(chunks) - n_prompt, t0, t1, t2, c0, timing)
        return outputs

    def _count_step(self, rows: int) -> None:
        st = self.stats
        st["steps"] += 1
        st["last_batch_size"] = rows
        st["sequences_scheduled"] += rows
        st["max_batch_size_seen"] = max(st["max_batch_size_seen"], rows)

    def _bad_token(self, tok: int) -> str:
        if tok == -1 or tok == PAD_INDEX:   # the samplers' mark of a row with no distribution (ir/sampling.py step 6)
            return _NONFINITE
        return (f"the runner produced token id {tok}, outside the vocabulary [0, {self.vocab_size}) (NaN / inf "
                "logits? try dtype='float32' or 'bfloat16' instead of 'float16', and check the weights)")

    def _accept(self, r: Request, tok: int, now: float) -> str | None:
        """Append a generated token; finish the request when it stops it (the reason, else None)."""
        r.output_token_ids.append(tok)
        self.stats["tokens_generated"] += 1
        if r.first_token_time is None:
            r.first_token_time = now
        reason = self._stop_reason(r, tok)
        # a stop token (stop_token_ids or EOS) ends the text before its own text, unless include_stop_str_in_output:
        # as a stop string's, and as vLLM does (the token stays in token_ids; a real EOS is special and has no text)
        cut = reason == "stop" and not r.params.include_stop_str_in_output
        if self._detokenize(r, final=bool(reason), drop_last=cut):
            reason = "stop"   # a stop string (the text ends before it)
            r.stop_reason = r.detok.stop_hit   # (vLLM's: a stop string found in the text wins over a stop token)
        elif reason == "stop" and tok in r.params.stop_token_ids:
            r.stop_reason = tok   # (EOS: None, as vLLM's)
        if reason:
            r.finish(reason)
        return reason

    def _finish_step(self, done: list[Request], n_prompt: int, n_decode: int, t0: float, t1: float, t2: float,
                     c0: float, timing: dict | None, defer_to=None) -> None:
        """defer_to: the burst in flight (bursts.Burst) that still writes the finished rows' pages: they are
        released after it returns."""
        for r in done:
            if defer_to is None:
                self.scheduler.release(r)
            if r.finish_reason != "error":
                self.stats["requests_finished"] += 1
        t3 = time.perf_counter()
        if done and defer_to is not None:
            for r in done:
                self._requests.pop(r.request_id, None)
            defer_to.deferred.extend(done)
        elif done:
            self._forget_many(done)
        self._account_step(n_prompt, n_decode, t0, t1, t2, t3, time.perf_counter(), time.thread_time() - c0, timing)

    def _account_step(self, n_prompt: int, n_decode: int, t0: float, t1: float, t2: float, t3: float, t4: float,
                      cpu: float, timing: dict | None) -> None:
        """Add one finished step to the phase totals (step_stats.py): t0 start, t1 chunks built, t2 executor
        returned, t3 outputs made, t4 end (after freeing finished sequences on the workers)."""
        st = self.stats
        kind = "prefill" if n_prompt else "decode"
        st[kind + "_steps"] += 1
        st["prompt_chunks"] += n_prompt
        st["decode_rows"] += n_decode
        if n_prompt:
            st["decode_rows_in_prefill_steps"] += n_decode
        st["t_step_s"] += t4 - t0
        st[f"t_step_{kind}_s"] += t4 - t0
        st["t_step_cpu_s"] += cpu
        st["t_schedule_s"] += t1 - t0
        st["t_execute_s"] += t2 - t1
        st[f"t_execute_{kind}_s"] += t2 - t1
        st["t_output_s"] += t3 - t2
        st["t_free_s"] += t4 - t3
        if timing:
            st["timed_steps"] += 1
            for k in ("dispatch", "wait", "to_worker", "worker", "from_worker"):
                st[f"t_exec_{k}_s"] += timing[k + "_s"]
            st[f"t_exec_worker_{kind}_s"] += timing["worker_s"]

    def _device_sampling(self, r: Request):
        """The request's DeviceSampling (or None: host sampling), fixed for its life: made once."""
        if r.device_sampling is None:
            ds = device_sampling_for(r.params, self.device_sampling, request_seed(r.params, self.seed, r.seq_id),
                                     self.full_sampling)
            r.device_sampling = (ds,)
            self.stats["sampled_host" if ds is None else "sampled_full" if ds.full else "sampled_graph"] += 1
        return r.device_sampling[0]

    def _stop_reason(self, r: Request, tok: int) -> str | None:
        if tok in r.params.stop_token_ids:
            return "stop"
        if not r.params.ignore_eos and tok in self._eos_ids():
            return "stop"
        if r.num_tokens >= r.max_total_len:
            return "length"
        return None

    def _eos_ids(self) -> set[int]:
        if not hasattr(self, "_eos_cache"):
            self._eos_cache = (self.tokenizer.eos_token_ids() if self.tokenizer.available else set()) | self.model_eos
        return self._eos_cache

    def _detokenize(self, r: Request, final: bool, drop_last: bool = False) -> bool:
        """Update r.text from the output tokens (detokenize.py: the new token's text from a window of the last few);
        True when a stop string ended the request. drop_last: the text ends before the newest token (a stop token's).
        Stop strings are searched only in text after the first min_tokens tokens' (vLLM's rule: min_tokens holds
        off every way to stop; an occurrence that ends in later text counts)."""
        if r.text is None:
            return False
        if r.detok is None:
            if self._decode is None:
                self._decode = text_decoder(self.tokenizer.get())
            r.detok = IncrementalText(self._decode)
        p = r.params
        ids = r.output_token_ids[:-1] if drop_last else r.output_token_ids
        changed = r.detok.add(ids, final)
        if p.stop and len(r.output_token_ids) <= p.min_tokens:
            r.detok.stop_floor = len(r.detok.text)
        if not changed and not final:
            return False
        text, hit = r.detok.visible(p.stop, p.include_stop_str_in_output, final)
        if len(text) >= len(r.text) or hit:   # a held-back tail never takes back text already shown
            r.text = text
        return hit
