"""Sampling parameters; where a token is drawn (device or host); host-side sampling from fp32 logits.

Device sampling (the runner's graph draws the token: megakernel, pyvm and the conventional executor share one
definition, ir/sampling.py) is used by runners that support it for the requests `device_sampling` routes there;
the others use the host sampler below. Either way a request's draws do not depend on what else shares its batch,
given its logits: both hash (seed, position) for their uniform numbers. (The
logits themselves may: on the GPU the bf16 step differs with the batch size, its plan bucket and split counts, so a
near-tie can break differently in another batch; session 52 saw it with random weights.) The seed is
`SamplingParams.seed`, or derived from the engine seed and the request index. The host sampler draws as the device
ones do (sample(): the graph's top-C draw for 1 <= top_k <= 64, the full-vocabulary draw otherwise), so a seeded
request's tokens do not change when asking for logprobs moves it to the host (penalties, logit_bias and min_tokens
change the logits themselves), and the reference backend draws what the others draw, to their logits' rounding.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..ir.sampling import SAMPLE_CANDIDATES, seed_to_int64
from ..runtime.device_sampling import DeviceSampling
from .errors import InvalidRequestError


DEVICE_SAMPLING_MODES = ("auto", "on", "off")
# temperatures below this are greedy: logits / T overflows fp32 for T ~< 1e-37 (softmax -> NaN), and long before
# that the distribution is an argmax anyway (vLLM uses the same cut-off)
SAMPLING_EPS = 1e-5
MAX_LOGPROBS = 20    # top tokens a request may ask logprobs for (OpenAI's chat limit)
MAX_N = 64           # completions per prompt a request may ask for (SamplingParams.n)
_NONFINITE = ("the model produced NaN / inf logits (float16 overflow or broken weights?): try dtype='float32' or "
              "'bfloat16', and check the checkpoint")


def _as_number(v, kind: type, to: type):
    """A numpy / other numeric scalar of `kind` as the Python int / float it stands for; anything else as it is (bools
    too: the checks refuse them)."""
    return to(v) if isinstance(v, kind) and not isinstance(v, (bool, int, float)) else v


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. On device the candidate set is capped at C = SAMPLE_CANDIDATES (64) tokens:
    top_k must be <= C there, and with top_k disabled (0 / -1) the device samples from the top C tokens only
    (top_p's mass measured over those C), an approximation. Runners that draw from the whole vocabulary on the
    device (samples_full_on_device: the megakernel (at TP > 1 from the gathered vocab shards), pyvm, torch; runtime/full_sampling.py) take
    top_k = 0 and top_k > C there too, exactly. The engine's `device_sampling` mode decides: "auto" (default)
    sends greedy and 1 <= top_k <= C requests to the device, the others to the full-vocabulary draw where the
    runner has it, else to the host sampler (all exact); "on" sends everything to the device (without the full
    draw: the top-C cap for top_k = 0, top_k > C rejected); "off" samples everything on the host. Logprobs and
    penalties are host work ("auto" sends them there, "on" rejects them)."""

    temperature: float = 1.0          # 0 = greedy (argmax)
    top_k: int = 0                    # 0 or -1 = all tokens
    top_p: float = 1.0                # nucleus mass in (0, 1]
    max_tokens: int | None = 16       # None = until the context (max_seq_len) is full
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)   # (None: none)
    seed: int | None = None           # None = derived from the engine seed and the request id
    ignore_eos: bool = False          # keep going past the tokenizer's EOS token
    # stop strings (need a tokenizer): generation stops when the detokenized output contains one; the text ends
    # before it (or after it with include_stop_str_in_output); the token ids keep every generated token. While a
    # request runs, streamed text holds back a tail that could still become a stop string. A request that ends on
    # one of its stop_token_ids keeps that token in its token ids, and its text ends before the token's text (after
    # it with include_stop_str_in_output), as vLLM's.
    stop: tuple[str, ...] = field(default_factory=tuple)   # a string or several (None: none)
    include_stop_str_in_output: bool = False
    # log-probabilities: None = none; n >= 0 = each generated token's logprob plus the n most likely tokens', from
    # the model's own distribution (log-softmax of the fp32 logits, before penalties / temperature / top-k / top-p)
    logprobs: int | None = None
    # penalties (OpenAI / vLLM semantics): presence / frequency subtract from the logits of tokens already
    # generated (once / per occurrence), in [-2, 2]; repetition (> 0, 1 = off) divides positive and multiplies
    # negative logits of tokens in the prompt or the output. Applied before temperature and top-k / top-p.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # more logits processing, host work like the penalties (OpenAI / vLLM semantics): logit_bias {token id: bias in
    # [-100, 100]} added to the logits, before the penalties as in vLLM (kept as sorted (id, bias) pairs);
    # min_tokens: neither EOS nor stop_token_ids can end the request before it has this many generated tokens (their logits are -inf until then), nor can a
    # stop string in the text of those tokens (one that ends in later text does: vLLM's rule); min_p in [0, 1]: after temperature, tokens whose probability is below min_p x the most likely
    # token's are dropped (before top-k / top-p)
    logit_bias: dict[int, float] | tuple | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    # completions per prompt (vLLM's field), 1..MAX_N: LLM.generate / chat / stream and the HTTP server run a prompt
    # as n requests (completions(params): the j-th seeded with seed + j when seeded), one engine request each
    n: int = 1
    # vLLM's detokenizer switches, accepted at the one value this runtime implements (the text is
    # tokenizer.decode(ids, skip_special_tokens=True)): code written for vLLM that passes them runs, and asking for the
    # other value is an error that says so rather than a text that silently differs
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        # None = none, as vLLM's SamplingParams and the OpenAI API's null take it
        if self.stop_token_ids is None:
            object.__setattr__(self, "stop_token_ids", ())
        if self.stop is None:
            object.__setattr__(self, "stop", ())
        # numpy / other numeric scalars (np.float32(0.7), np.int64(5)) as the Python numbers they stand for: the
        # checks below take int / float only
        for name, kind, to in (("temperature", numbers.Real, float), ("top_p", numbers.Real, float),
                               ("min_p", numbers.Real, float), ("presence_penalty", numbers.Real, float),
                               ("frequency_penalty", numbers.Real, float), ("repetition_penalty", numbers.Real, float),
                               ("top_k", numbers.Integral, int), ("max_tokens", numbers.Integral, int),
                               ("seed", numbers.Integral, int), ("logprobs", numbers.Integral, int),
                               ("min_tokens", numbers.Integral, int), ("n", numbers.Integral, int)):
            v = getattr(self, name)
            if isinstance(v, kind) and not isinstance(v, (bool, int, float)):   # (np.bool_ is neither ABC)
                object.__setattr__(self, name, to(v))
        # ... and so the token ids of stop_token_ids and logit_bias (list(np.array(ids)) was refused as "must be a
        # list of non-negative ints, got [np.int64(1), ...]")
        if isinstance(self.stop_token_ids, (list, tuple)):
            object.__setattr__(self, "stop_token_ids", [_as_number(x, numbers.Integral, int)
                                                        for x in self.stop_token_ids])
        problems = []
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not t >= 0 or t == float("inf"):
            problems.append(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            problems.append(f"top_k must be an int >= 1, or 0 / -1 for no limit, got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0 < p <= 1:
            problems.append(f"top_p must be in (0, 1], got {p!r}")
        m = self.max_tokens
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            problems.append(f"max_tokens must be an int >= 1 (or None for 'until the context is full'), got {m!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in self.stop_token_ids):
            problems.append(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            problems.append(f"seed must be an int or None (any int: its low 64 bits are used), got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            problems.append(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            problems.append(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            problems.append(f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}")
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
            problems.append(f"logprobs must be None or an int in [0, {MAX_LOGPROBS}] (the number of top tokens "
                            f"reported beside the sampled one), got {lp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not -2.0 <= v <= 2.0:
                problems.append(f"{name} must be a number in [-2, 2] (0 = off), got {v!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, (int, float)) or isinstance(rp, bool) or not 0 < rp < float("inf"):
            problems.append(f"repetition_penalty must be a finite number > 0 (1 = off), got {rp!r}")
        lb = self.logit_bias
        if lb is not None:
            items = lb.items() if isinstance(lb, dict) else lb if isinstance(lb, (list, tuple)) else None
            try:
                pairs = tuple(sorted((_as_number(k, numbers.Integral, int), _as_number(v, numbers.Real, float))
                                     for k, v in items)) if items is not None else None
            except (TypeError, ValueError):
                pairs = None
            if pairs is None or len({k for k, _ in pairs}) != len(pairs) or not all(
                    isinstance(k, int) and not isinstance(k, bool) and k >= 0 and
                    isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100 for k, v in pairs):
                problems.append("logit_bias must map token ids (ints >= 0, each once) to biases in [-100, 100], got "
                                f"{lb!r:.120}")
            else:
                object.__setattr__(self, "logit_bias", tuple((k, float(v)) for k, v in pairs) or None)
        mt = self.min_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 0:
            problems.append(f"min_tokens must be an int >= 0, got {mt!r}")
        elif m is not None and isinstance(m, int) and mt > m:
            problems.append(f"min_tokens ({mt}) must not exceed max_tokens ({m})")
        mp = self.min_p
        if not isinstance(mp, (int, float)) or isinstance(mp, bool) or not 0 <= mp <= 1:
            problems.append(f"min_p must be a number in [0, 1] (0 = off), got {mp!r}")
        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            problems.append(f"n must be an int in [1, {MAX_N}] (completions per prompt), got {self.n!r}")
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if getattr(self, name) is not True:
                problems.append(f"{name}={getattr(self, name)!r} is not implemented: the text leaves special tokens "
                                f"out (vLLM's default, {name}=True); read token_ids for the special tokens")
        if problems:
            raise InvalidRequestError("invalid SamplingParams: " + "; ".join(problems))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processed(self) -> bool:
        """The host changes the logits before sampling (process_logits)."""
        return self.penalized or self.logit_bias is not None or self.min_tokens > 0

    @property
    def needs_logits(self) -> bool:
        """The host must see this request's logits (logprobs, penalties, logit_bias, min_tokens, min_p): the device
        samplers do none of them."""
        return self.logprobs is not None or self.processed or (self.min_p > 0 and not self.greedy)

    def device_exact(self) -> bool:
        """The device sampler follows these params exactly (no top-C cap involved)."""
        return not self.needs_logits and (self.greedy or 1 <= self.top_k <= SAMPLE_CANDIDATES)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """From a JSON-ish dict (jobs, HTTP); unknown keys are an error that lists the allowed ones."""
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - allowed
        if unknown:
            raise InvalidRequestError(f"unknown sampling fields {sorted(unknown)}; allowed: {sorted(allowed)}")
        lb = d.get("logit_bias")
        if isinstance(lb, dict):   # JSON object keys are strings: "1234" -> 1234
            d = {**d, "logit_bias": {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in lb.items()}}
        return cls(**d)


def completions(params: SamplingParams, n: int | None = None) -> list[SamplingParams]:
    """The params of the n engine requests that make a prompt's n completions (n: params.n when None), each with
    n=1: a seeded request's j-th draws with seed + j, so each completion is the one a single request with that seed
    gives; an unseeded one's differ already (each request's seed comes from its index)."""
    n = params.n if n is None else n
    one = params if params.n == 1 else dataclasses.replace(params, n=1)
    if n == 1 or params.seed is None:
        return [one] * n
    return [dataclasses.replace(one, seed=params.seed + j) for j in range(n)]


def request_seed(params: SamplingParams, engine_seed: int, request_index: int) -> int:
    return params.seed if params.seed is not None else engine_seed * 1_000_003 + request_index


def check_device_sampling(params: SamplingParams, mode: str, full: bool = False) -> None:
    """Raise InvalidRequestError for params the device cannot do in mode "on" (logprobs, penalties; top_k > C unless
    the runner draws full-vocabulary rows: `full`)."""
    if mode == "on" and params.needs_logits:
        raise InvalidRequestError(
            "logprobs, presence / frequency / repetition penalties, logit_bias, min_tokens and min_p need the logits "
            "on the host, and this LLM "
            "samples every request on the device (device_sampling='on'): create it with device_sampling='auto' "
            "(the default) or 'off', or leave those fields out")
    if mode == "on" and not full and not params.greedy and params.top_k > SAMPLE_CANDIDATES:
        raise InvalidRequestError(
            f"top_k={params.top_k} exceeds the on-device sampling limit of {SAMPLE_CANDIDATES} candidates: use "
            f"top_k <= {SAMPLE_CANDIDATES}, or create the LLM with device_sampling='auto' (host sampling for such "
            "requests) or 'off'")


def device_sampling_for(params: SamplingParams, mode: str, seed: int, full: bool = False) -> DeviceSampling | None:
    """The DeviceSampling a request's chunk carries under `mode` (None: sample on the host). full: the runner draws
    rows from the whole vocabulary (samples_full_on_device): requests the graph's top-C sampler cannot follow
    exactly (top_k 0 or > C) get DeviceSampling(full=True) instead of the host (mode "auto") or the cap ("on")."""
    if mode == "off" or params.needs_logits and mode == "auto":
        return None
    if params.greedy:
        return DeviceSampling(0.0, 0, 1.0, 0)
    k = params.top_k if params.top_k > 0 else 0
    exact = params.device_exact()
    if not exact and full:
        return DeviceSampling(float(params.temperature), k, float(params.top_p), seed, full=True)
    if mode == "auto" and not exact:
        return None
    return DeviceSampling(float(params.temperature), k, float(params.top_p), seed)


def process_logits(logits: torch.Tensor, params: SamplingParams, output_ids: list[int], prompt_ids: list[int],
                   eos_ids=()) -> torch.Tensor:
    """The logits (vocab,) as the request's sampler sees them (a new fp32 tensor; `logits` is not changed):
    logit_bias added, then the penalties (apply_penalties), as vLLM orders them (its logit_bias processor runs
    before the penalties: a repetition penalty divides or multiplies the biased logit; it was the other way round
    here), then, while fewer than min_tokens are generated, the tokens that would end it (its stop_token_ids, and
    eos_ids unless ignore_eos) at -inf."""
    x = logits.float().clone()
    if params.logit_bias is not None:
        ids, bias = zip(*params.logit_bias)
        x[torch.tensor(ids, dtype=torch.long)] += torch.tensor(bias, dtype=x.dtype)
    x = _penalized(x, params, output_ids, prompt_ids)
    if len(output_ids) < params.min_tokens:
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        ends = [t for t in ends if 0 <= t < x.numel()]
        if ends:
            x[torch.tensor(ends, dtype=torch.long)] = float("-inf")
    return x


def apply_penalties(logits: torch.Tensor, params: SamplingParams, output_ids: list[int],
                    prompt_ids: list[int]) -> torch.Tensor:
    """The logits (vocab,) with the request's penalties applied (a new fp32 tensor; `logits` is not changed):
    repetition over the prompt and output tokens, then frequency and presence over the output tokens."""
    return _penalized(logits.float().clone(), params, output_ids, prompt_ids)


def _penalized(x: torch.Tensor, params: SamplingParams, output_ids: list[int], prompt_ids: list[int]) -> torch.Tensor:
    """apply_penalties on x, an fp32 copy of the caller's (changed in place, or replaced: use the result)."""
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(x.numel(), dtype=torch.bool)
        seen[torch.tensor(prompt_ids + output_ids, dtype=torch.long)] = True
        rp = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=x.numel()).float()
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return x


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> dict[int, float]:
    """{token: logprob} for the sampled token first, then the `top` most likely tokens (log-softmax of the fp32
    logits; a top token equal to the sampled one appears once)."""
    lp = torch.log_softmax(logits.float(), -1)
    out = {token: float(lp[token])}
    if top:
        vals, ids = torch.topk(lp, top)
        for v, i in zip(vals.tolist(), ids.tolist()):
            out.setdefault(i, v)
    return out


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, pos: int) -> int:
    """One token id from fp32 logits (vocab,), on the host, drawn as the device samplers draw it: the same token for
    the same logits, seed and position (pos: the position of the row's last token, the token drawn goes at pos + 1).
    So a seeded request's text does not change when it asks for logprobs (which moves it from the device's draw to
    this one), a preempted request continues as it would have, and the reference backend draws what pyvm / torch /
    the megakernel draw up to their logits' rounding. Exact: temperature, then min_p (tokens below min_p x the
    largest probability dropped), then top-k (the k largest logits), then top-p (the smallest prefix of the
    remaining tokens, most likely first, whose mass before each token is < top_p), then one draw from what is left,
    renormalised: 1 <= top_k <= SAMPLE_CANDIDATES by the graph's sampler (ir/sampling.py; tasks/ops/argmax.py
    sample_row, sample_logits' token for one row), any other top_k by the full-vocabulary sampler
    (runtime/full_sampling.py draw_row, its torch form's token for one row). ~0.3 ms a plain row at V = 152k on a
    2-core host (session 73; tests/engine/test_host_sampler_exact.py holds it to the batched forms token for token).
    (Logits on another device are drawn from a CPU copy.)"""
    if params.greedy:
        tok = int(torch.argmax(logits))
        if not bool(torch.isfinite(logits[tok])):   # argmax lands on a NaN (or +inf) when there is one
            raise ValueError(_NONFINITE)
        return tok
    # (a row holding NaN, or whose largest logit is +-inf, fails: here where min_p needs the largest logit, else
    # where the draw finds it: sample_row and draw_row return -1 for such a row; torch's max propagates NaN)
    x = logits.float().reshape(-1).contiguous().cpu()
    T = float(params.temperature)
    if params.min_p > 0:   # p < min_p * p_max  <=>  x / T < x_max / T + log(min_p)  <=>  x < x_max + T log(min_p)
        top = x.max()
        if not math.isfinite(float(top)):
            raise ValueError(_NONFINITE)
        x = _min_p_mask(x, top + T * math.log(params.min_p))
    if 1 <= params.top_k <= SAMPLE_CANDIDATES:
        from ..runtime.host_draw import sample_row
        tok = sample_row(x, T, params.top_k, float(params.top_p), seed_to_int64(seed), pos, SAMPLE_CANDIDATES)
    else:
        from ..runtime.full_sampling import draw_row
        tok = draw_row(x, T, max(0, params.top_k), float(params.top_p), seed, pos)
    if not 0 <= tok < x.shape[0]:
        raise ValueError(_NONFINITE)
    return tok


_min_p_work = threading.local()


def _min_p_mask(x: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """x.masked_fill(x < thr, -inf) for x (V,) fp32 (no NaN, no +inf) and thr a 0-dim fp32, into a buffer kept per
    thread (read before this thread's next call): x < thr <=> not x > (the fp32 below thr), which torch.threshold
    keeps (x's bits as they are, -0.0 too), ~25 us here against ~250 us for masked_fill / where with a mask of the
    row. A threshold below the normal range goes the masked_fill way (flush-to-zero modes compare denormals as 0)."""
    below = float(np.nextafter(np.float32(float(thr)), np.float32(-np.inf)))
    if not abs(below) >= 2.0 ** -126:   # (a denormal, or 0; -inf stays -inf: nothing below it)
        return x.masked_fill(x < thr, float("-inf"))
    w = getattr(_min_p_work, "w", None)
    if w is None or w.numel() != x.numel():
        w = _min_p_work.w = torch.empty_like(x)
    return torch.nn.functional.threshold_(w.copy_(x), below, float("-inf"))
