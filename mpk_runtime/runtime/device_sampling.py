"""Per-sequence sampling parameters travelling from the engine to a runner, and the step result with the
tokens the runner's graph sampled on "device" (the sampler is the graph's `argmax` op; ir/sampling.py).

A `SeqChunk` may carry `sampling` (a `DeviceSampling`); a runner that supports device sampling writes those into
the graph's `sample.*` io tensors before the step and returns a `StepOutput` whose `tokens[i]` is the token drawn
for chunk i (-1 where chunk i had no `sampling`). Runners that do not support it ignore the field and return
plain logits: the engine then samples on the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ir.sampling import SAMPLE_CANDIDATES, TENSORS, seed_to_int64


@dataclass(frozen=True)
class DeviceSampling:
    temperature: float     # 0 = greedy (exact argmax)
    top_k: int             # 1..SAMPLE_CANDIDATES; 0 = SAMPLE_CANDIDATES (the documented cap); with full: any k >= 0,
    #                        0 = the whole vocabulary
    top_p: float           # (0, 1]
    seed: int              # any int (its low 64 bits are used)
    full: bool = False     # drawn again after the step from the whole vocabulary, exactly (full_sampling.py); only
    #                        runners with samples_full_on_device get such rows

    def __post_init__(self) -> None:
        if self.full and (self.temperature <= 0 or self.top_k < 0):
            raise ValueError(f"full-vocabulary sampling needs temperature > 0 and top_k >= 0, got {self}")
        if not self.full and not 0 <= self.top_k <= SAMPLE_CANDIDATES:
            raise ValueError(f"device sampling supports top_k in [0, {SAMPLE_CANDIDATES}], got {self.top_k}")


@dataclass
class StepOutput:
    """What a runner's `step` returns when some chunk asked for device sampling."""

    logits: torch.Tensor | None   # (n, vocab) fp32, as a plain step returns; None when every chunk was sampled
    #                               on the device (host_logits_needed false: no host copy)
    tokens: torch.Tensor   # (n,) int64: the device-sampled token of chunk i, -1 where not requested


def has_sampling_tensors(mem) -> bool:
    return all(n in mem.tensors for n in TENSORS)


def fill_sampling(mem, rows: list[DeviceSampling | None]) -> None:
    """Write rows' params into a RankMemory's sample.* tensors (rows past len(rows), and None rows: greedy).
    The values are built as lists and copied once per tensor; a step whose rows equal the previous step's (the
    usual decode step) copies nothing."""
    if not has_sampling_tensors(mem):
        return
    B = mem.t("sample.temperature").shape[0]
    key = tuple(rows)
    if getattr(mem, "_sampling_rows", None) == key:
        return
    for name, v, dt in zip(TENSORS, sampling_lists(rows, B), (torch.float32, torch.int64, torch.float32, torch.int64)):
        mem.t(name).copy_(torch.tensor(v, dtype=dt))
    mem._sampling_rows = key
    set_full_rows(mem, rows)


def sampling_lists(rows: list[DeviceSampling | None], B: int) -> tuple[list, list, list, list]:
    """The graph's sample.* values (temperature, top_k, top_p, seed; TENSORS' order) of B rows as lists: rows past
    len(rows), None rows and full rows (their graph draw is overwritten) greedy."""
    if len(rows) > B:
        raise ValueError(f"{len(rows)} sampling rows for a graph of batch {B}")
    temp, top_k, top_p, seed = [0.0] * B, [0] * B, [1.0] * B, [0] * B
    for i, s in enumerate(rows):
        if s is not None and not s.full:   # (a full row's graph draw is overwritten: greedy, the cheapest)
            temp[i], top_k[i], top_p[i], seed[i] = float(s.temperature), int(s.top_k), float(s.top_p), \
                seed_to_int64(int(s.seed))
    return temp, top_k, top_p, seed


def set_full_rows(mem, rows: list) -> None:
    """mem's FullRows for draw_full after the step (None when no row is full)."""
    from .full_sampling import full_rows
    mem._full_rows = full_rows(list(rows), mem.t("next_tokens").device, mem.graph.config.vocab_size)


def draw_full(mem, logits: torch.Tensor, pos, graph: bool = False) -> None:
    """After a step ran: draw the full-vocabulary rows that fill_sampling last wrote (DeviceSampling.full) from
    logits (n, V) of the whole vocabulary, over mem's next_tokens[:n]. pos: the positions (n,) of the rows' last
    tokens (a tensor on the logits' device, or a list). No-op when no row is full. graph: pos is a view of a tensor
    that stays put (a decode step's): the draw may replay as a CUDA graph (runtime/draw_graphs.py)."""
    fr = getattr(mem, "_full_rows", None)
    if fr is None:
        return
    n = logits.shape[0]
    if not isinstance(pos, torch.Tensor):
        pos, graph = torch.tensor(list(pos), dtype=torch.int64), False
    pos, out = pos.to(logits.device), mem.t("next_tokens")[:n]
    from .draw_graphs import DrawGraphs, enabled
    from .triton_support import runs_on
    if not (enabled() and runs_on(logits)):
        fr.draw(logits, pos, out)
        return
    dg = getattr(mem, "_draw_graphs", None)
    if dg is None:
        dg = mem._draw_graphs = DrawGraphs()
    dg.draw(fr, logits, pos, out, graph)


def graph_greedy(rows) -> bool:
    """Every row's graph draw is an argmax (greedy rows, and full rows: their token is drawn after the graph):
    a plan may replay its all-greedy graph (StepCtx.greedy)."""
    return all(s is None or s.temperature <= 0 or s.full for s in (rows or []))


def any_full(rows) -> bool:
    """Some row is drawn after the step from the fp32 logits (which the step must then write: StepCtx.logits_unread
    false)."""
    return any(s is not None and s.full for s in (rows or []))


def wants_sampling(chunks) -> bool:
    return any(getattr(c, "sampling", None) is not None for c in chunks)


def host_logits_needed(chunks) -> bool:
    """Some chunk's logits will be read on the host (SeqChunk.wants_logits and no device sampling); else the engine
    reads only the drawn tokens and a runner may return StepOutput(logits=None)."""
    return any(getattr(c, "sampling", None) is None and getattr(c, "wants_logits", True) for c in chunks)


def step_output(chunks, logits: torch.Tensor | None, tokens: list[int | None]):
    """logits alone when no chunk asked for device sampling (the classic return), else a StepOutput (logits may
    be None when not host_logits_needed(chunks))."""
    if logits is None and host_logits_needed(chunks):
        raise ValueError("step_output without logits: some chunk wants logits and was not sampled on the device")
    if not wants_sampling(chunks):
        return logits
    t = torch.tensor([tok if (tok is not None and getattr(c, "sampling", None) is not None) else -1
                      for c, tok in zip(chunks, tokens)], dtype=torch.int64)
    return StepOutput(logits, t)
