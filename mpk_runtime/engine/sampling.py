"""Sampling parameters; where a token is drawn (device or host); host-side sampling from fp32 logits.

Device sampling (the runner's graph draws the token: megakernel, pyvm and the conventional executor share one
definition, ir/sampling.py) is used by runners that support it for the requests `device_sampling` routes there;
the others use the host sampler below. Either way a request's tokens do not depend on what else shares its
batch: the host sampler has a `torch.Generator` per request, the device one hashes (seed, position). The seed is
`SamplingParams.seed`, or derived from the engine seed and the request index. The two samplers draw different
(equally distributed) streams for the same seed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..ir.sampling import SAMPLE_CANDIDATES
from ..runtime.device_sampling import DeviceSampling
from .errors import InvalidRequestError


DEVICE_SAMPLING_MODES = ("auto", "on", "off")
# temperatures below this are greedy: logits / T overflows fp32 for T ~< 1e-37 (softmax -> NaN), and long before
# that the distribution is an argmax anyway (vLLM uses the same cut-off)
SAMPLING_EPS = 1e-5
_NONFINITE = ("the model produced NaN / inf logits (float16 overflow or broken weights?): try dtype='float32' or "
              "'bfloat16', and check the checkpoint")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. On device the candidate set is capped at C = SAMPLE_CANDIDATES (64) tokens:
    top_k must be <= C there, and with top_k disabled (0 / -1) the device samples from the top C tokens only
    (top_p's mass measured over those C), an approximation. The engine's `device_sampling` mode decides:
    "auto" (default) sends greedy and 1 <= top_k <= C requests to the device (exact) and the rest to the host
    sampler (exact); "on" sends everything to the device, accepting the top-C cap for top_k = 0 and rejecting
    top_k > C; "off" samples everything on the host."""

    temperature: float = 1.0          # 0 = greedy (argmax)
    top_k: int = 0                    # 0 or -1 = all tokens
    top_p: float = 1.0                # nucleus mass in (0, 1]
    max_tokens: int | None = 16       # None = until the context (max_seq_len) is full
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None           # None = derived from the engine seed and the request id
    ignore_eos: bool = False          # keep going past the tokenizer's EOS token

    def __post_init__(self) -> None:
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
        if problems:
            raise InvalidRequestError("invalid SamplingParams: " + "; ".join(problems))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def device_exact(self) -> bool:
        """The device sampler follows these params exactly (no top-C cap involved)."""
        return self.greedy or 1 <= self.top_k <= SAMPLE_CANDIDATES

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        """From a JSON-ish dict (jobs, HTTP); unknown keys are an error that lists the allowed ones."""
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - allowed
        if unknown:
            raise InvalidRequestError(f"unknown sampling fields {sorted(unknown)}; allowed: {sorted(allowed)}")
        return cls(**d)


def request_seed(params: SamplingParams, engine_seed: int, request_index: int) -> int:
    return params.seed if params.seed is not None else engine_seed * 1_000_003 + request_index


def make_generator(params: SamplingParams, engine_seed: int, request_index: int) -> torch.Generator | None:
    if params.greedy:
        return None
    # any int is a valid seed: use its low 64 bits, as the device sampler does (manual_seed rejects >= 2**64)
    return torch.Generator().manual_seed(request_seed(params, engine_seed, request_index) & 0xFFFF_FFFF_FFFF_FFFF)


def check_device_sampling(params: SamplingParams, mode: str) -> None:
    """Raise InvalidRequestError for params the device cannot do in mode "on" (top_k > C)."""
    if mode == "on" and not params.greedy and params.top_k > SAMPLE_CANDIDATES:
        raise InvalidRequestError(
            f"top_k={params.top_k} exceeds the on-device sampling limit of {SAMPLE_CANDIDATES} candidates: use "
            f"top_k <= {SAMPLE_CANDIDATES}, or create the LLM with device_sampling='auto' (host sampling for such "
            "requests) or 'off'")


def device_sampling_for(params: SamplingParams, mode: str, seed: int) -> DeviceSampling | None:
    """The DeviceSampling a request's chunk carries under `mode` (None: sample on the host)."""
    if mode == "off" or (mode == "auto" and not params.device_exact()):
        return None
    if params.greedy:
        return DeviceSampling(0.0, 0, 1.0, 0)
    k = params.top_k if params.top_k > 0 else 0
    return DeviceSampling(float(params.temperature), k, float(params.top_p), seed)


def sample(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    """One token id from fp32 logits (vocab,), on the host."""
    if params.greedy:
        tok = int(torch.argmax(logits))
        if not bool(torch.isfinite(logits[tok])):   # argmax lands on a NaN (or +inf) when there is one
            raise ValueError(_NONFINITE)
        return tok
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, -1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (torch.cumsum(probs, -1) - probs) >= params.top_p
        x = x.clone()
        x[idx[drop]] = float("-inf")
    probs = torch.softmax(x, -1)
    if not bool(torch.isfinite(probs).all()):   # (softmax is O(V) already)
        raise ValueError(_NONFINITE)
    return int(torch.multinomial(probs, 1, generator=gen))
