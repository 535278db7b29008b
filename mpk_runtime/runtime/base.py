"""The seam between the engine and whatever computes the model: runners, workers, executors.

A `ModelRunner` computes one rank's shard of the model on one device (CPU pyvm, conventional torch, or the
GPU megakernel). It owns the paged KV cache storage; the engine owns page *allocation* and tells the runner
which pages each sequence uses. One call, `step`, runs a mixed batch: sequences with one new token decode,
sequences with several tokens prefill (the runner routes them to the right path).

A `Worker` wraps one rank's runner; an `Executor` calls every worker by method name (`collective_rpc`), so the
in-process, multi-process and Ray backends share one interface (the vLLM v1 executor/worker split).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..models.config import ModelConfig


class RuntimeError_(RuntimeError):
    """Base class of runtime failures (kernel timeout, lost rank, ...)."""


class KernelTimeout(RuntimeError_):
    """A spin-wait ran past its bound: the message names the SM, the task and the event it waited on."""


@dataclass(frozen=True)
class KVSpec:
    page_size: int      # tokens per KV page
    num_pages: int      # pages available to the engine's allocator (per rank; all ranks identical)
    max_batch: int      # most sequences in one step
    max_seq_len: int    # longest sequence (prompt + generated) a slot may hold


@dataclass
class SeqChunk:
    """Work for one sequence in one step."""

    seq_id: int                 # engine's id for the sequence (stable across steps)
    token_ids: list[int]        # the tokens to run: a prompt chunk, or the single newest token when decoding
    start_pos: int              # position of token_ids[0] in the sequence
    block_table: list[int]      # KV page ids covering positions [0, start_pos + len(token_ids))
    sampling: Any = None        # runtime.device_sampling.DeviceSampling: sample the next token on device
    wants_logits: bool = True   # False: the engine will not read this chunk's logits (a prompt chunk that is not the
    #                             last, or a device-sampled one), so a runner may skip copying them to the host

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("SeqChunk.token_ids is empty")


class ModelRunner(abc.ABC):
    """One rank's compute. `step` returns fp32 logits (len(chunks), vocab) of each chunk's last token
    on every rank (vocab-parallel shards are gathered before returning); runners that sample on device return a
    runtime.device_sampling.StepOutput (logits + tokens) when some chunk carries `sampling`."""

    config: ModelConfig
    rank: int = 0
    world_size: int = 1
    samples_on_device = False   # `step` draws the tokens of chunks that carry `sampling` (StepOutput.tokens)
    samples_full_on_device = False   # ... also DeviceSampling.full rows (top_k 0 / > 64: runtime/full_sampling.py)
    shares_kv_pages = False   # K/V live only in the engine's pages (nothing kept per sequence), so sequences can share
    #                           pages: the engine's prefix cache (engine/prefix_cache.py) needs it

    @abc.abstractmethod
    def kv_spec(self) -> KVSpec: ...

    @abc.abstractmethod
    def step(self, chunks: list[SeqChunk]) -> torch.Tensor: ...

    def decode_steps(self, chunks: list[SeqChunk], num_steps: int, resume: bool = False) -> torch.Tensor:
        """num_steps decode steps of the same rows, each feeding the token drawn for a row to its next step:
        the drawn tokens (n, num_steps) int64. Every chunk is one token with device sampling, and its block table
        covers start_pos + num_steps - 1. resume: the rows are the last call's, in its order, and each one's token
        is the last one drawn for it there (the chunks' token ids are ignored: the engine has not read them yet).
        This default runs `step` once a step (the tokens pass through the host); a runner overrides it to keep them
        on the device between the steps."""
        check_decode_steps(chunks, num_steps)
        from .device_sampling import StepOutput
        if resume:
            last = getattr(self, "_last_drawn", {})
            if [c.seq_id for c in chunks] != list(last):
                raise ValueError("decode_steps(resume=True) continues the last call's rows, in its order")
            chunks = [SeqChunk(c.seq_id, [last[c.seq_id]], c.start_pos, c.block_table, c.sampling, False)
                      for c in chunks]
        drawn = []
        for j in range(num_steps):
            out = self.step(chunks)
            if not isinstance(out, StepOutput):
                raise ValueError(f"{type(self).__name__} did not sample on the device: decode_steps needs a runner "
                                 "that does (samples_on_device)")
            drawn.append(out.tokens)
            chunks = [SeqChunk(c.seq_id, [int(t)], c.start_pos + 1, c.block_table, c.sampling, False)
                      for c, t in zip(chunks, out.tokens.tolist())]
        out = torch.stack(drawn, 1)
        self._last_drawn = {c.seq_id: int(t) for c, t in zip(chunks, out[:, -1].tolist())}
        return out

    def launch_steps(self, chunks: list[SeqChunk], num_steps: int, resume: bool = False) -> "Pending":
        """decode_steps queued without waiting for it: the caller may queue the next burst (resume=True) before
        it reads this one (Pending.wait), so a device runs the two back to back (engine/bursts.py). Bursts are
        read in the order they were launched. This default runs decode_steps now; a GPU runner overrides it to
        return once its launches are queued."""
        return Pending(value=self.decode_steps(chunks, num_steps, resume))

    def shutdown(self) -> None:  # pragma: no cover - default no-op
        pass


class Pending:
    """A launched burst's drawn tokens: wait() returns them (n, num_steps) int64 on the CPU, once (the first call
    waits for the device and raises what the burst raised; later calls return the same tokens)."""

    def __init__(self, wait: Callable[[], torch.Tensor] | None = None, value: torch.Tensor | None = None):
        if (wait is None) == (value is None):
            raise ValueError("Pending takes either a wait function or a value")
        self._wait, self._value, self._error = wait, value, None

    def wait(self) -> torch.Tensor:
        if self._wait is not None:
            fn, self._wait = self._wait, None
            try:
                self._value = fn()
            except BaseException as e:
                self._error = e
                raise
        if self._error is not None:
            raise self._error
        return self._value


def check_decode_steps(chunks: list[SeqChunk], num_steps: int) -> None:
    """decode_steps' contract: one token a chunk, sampled on the device (the pages of all num_steps positions are
    checked by the worker: worker.check_pages)."""
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
    for c in chunks:
        if len(c.token_ids) != 1 or c.sampling is None:
            raise ValueError(f"decode_steps runs decode rows sampled on the device; sequence {c.seq_id} has "
                             f"{len(c.token_ids)} tokens and sampling={c.sampling!r}")


def check_sizes(cfg: ModelConfig, max_batch, max_seq_len, page_size, num_pages) -> int:
    """Validate a runner's cache sizes (every backend the same way); returns max_seq_len. num_pages None = derive."""
    for name, v in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("page_size", page_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if num_pages is not None and (not isinstance(num_pages, int) or isinstance(num_pages, bool) or num_pages < 1):
        raise ValueError(f"num_pages must be an int >= 1 (or None: enough for max_batch full sequences, or what fits the GPU), got {num_pages!r}")
    if max_seq_len > cfg.max_position_embeddings:
        raise ValueError(f"max_seq_len={max_seq_len} exceeds {cfg.name}'s max_position_embeddings "
                         f"({cfg.max_position_embeddings}); pass a smaller max_seq_len")
    return max_seq_len


def runner_device(backend: str, device, cpu_only: bool = False) -> torch.device:
    """`device` as a torch.device, or a ValueError naming what to pass: torch raises a bare RuntimeError for a bad
    string ('cuda:-1', 'gpu'), and a CUDA device where none is visible failed deep inside weight loading.
    cpu_only: the backend runs on the CPU alone (compared by type: torch.device("cpu") != "cpu")."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"backend {backend!r}: device={device!r} is not a device ({e}); pass 'cpu', 'cuda' or "
                         "'cuda:N'") from None
    if cpu_only and dev.type != "cpu":
        raise ValueError(f"the {backend} backend runs on the CPU (device={device!r}); use backend='megakernel' for GPUs")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise ValueError(f"backend {backend!r}: device={device!r} but no GPU is visible here; pass device='cpu'")
        if dev.index is not None and dev.index >= n:
            raise ValueError(f"backend {backend!r}: device={device!r} is not one of the {n} visible GPUs "
                             f"(cuda:0 .. cuda:{n - 1})")
    return dev


# --- backend registry ---------------------------------------------------------------------------------------
RunnerFactory = Callable[..., ModelRunner]
_RUNNERS: dict[str, RunnerFactory] = {}


def register_runner(name: str):
    def deco(fn: RunnerFactory) -> RunnerFactory:
        _RUNNERS[name] = fn
        return fn
    return deco


def make_runner(backend: str, **kwargs: Any) -> ModelRunner:
    """Create a runner by backend name. Keyword arguments: model (preset or HF dir), rank, world_size,
    comm (communicator for world_size > 1), seed, dtype, device, max_batch, max_seq_len, page_size, ..."""
    from . import backends  # noqa: F401  (registers the built-in backends)
    if backend not in _RUNNERS:
        raise ValueError(f"unknown backend {backend!r}; known backends: {', '.join(sorted(_RUNNERS))}")
    return _RUNNERS[backend](**kwargs)


def runner_params(backend: str) -> set[str] | None:
    """The keyword arguments a backend's runner takes by name (None: unknown backend, or it takes anything)."""
    import inspect
    from . import backends  # noqa: F401
    fn = _RUNNERS.get(backend)
    if fn is None:
        return None
    sig = inspect.signature(fn.__init__ if isinstance(fn, type) else fn)
    names = {n for n, p in sig.parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return names - {"self"} or None


def known_backends() -> list[str]:
    from . import backends  # noqa: F401
    return sorted(_RUNNERS)
