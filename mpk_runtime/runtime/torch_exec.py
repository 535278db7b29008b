"""The conventional path: run a Graph op by op with torch, in program order.

Ops with a whole-op version (conventional_ops: embed, linear without TP push, qkv_rope, attention) run as
batched torch kernels with the task kinds' numerics; the rest run their task kinds' semantics with one coarse
tile, so every op has exactly one definition of what it computes. Ranks of a TP group are interleaved task by
task (their decompositions are identical, and every cross-rank producer precedes its consumer in that order).
Values every layer needs (positions, RoPE tables, KV slots, attention masks) are built once per step, inside
run() (a CUDA graph capture records them; see conventional_ops). Used for prefill chunks and as the CPU
"torch" backend; on a GPU the same ops run as torch kernels.

Compiled (`compile=True`, or MPK_CONV_COMPILE=1 for the executors of conventional plan segments): run() goes through
torch.compile (Inductor, no CUDA graphs of its own: the caller captures the step), which fuses the elementwise
work around the matmuls (RMSNorm, RoPE, SiLU-mul, residual adds, the argmax merge) into a few generated kernels.
Inductor keeps intermediates in fp32 inside a fused kernel, so the results agree with the eager ops to bf16
tolerance, not bit for bit (emulate_precision_casts rounds where the eager ops round, which keeps them close);
the first run compiles (seconds to a minute), and a new StepCtx shape or static field compiles again.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..envflags import env_flag, env_removed
from ..ir.graph import Graph
from ..ir.sampling import conv_bf16_argmax
from ..tasks.build import decompose
from ..tasks.ops import get_task_kind
from ..tasks.ops.argmax import greedy_fast
from ..tasks.tiling import Tiling
from .conventional_fused import inductor_options, recompiles_allowed
from .conventional_ops import OPS as WHOLE_OPS, runs_whole
from .memory import RankMemory, StepCtx

def compile_segments() -> bool:
    """MPK_CONV_COMPILE=1: conventional plan segments run through torch.compile (see the module doc)."""
    return env_flag("MPK_CONV_COMPILE")


COARSE = Tiling(num_sms=1, linear_cols=1 << 30, allreduce_cols=1 << 30, argmax_tasks=1)


class ConventionalExecutor:
    """`graphs`/`mems`: the ranks held by this process. With a `comm` (ranks in separate processes), this
    process holds one rank and the symmetric slots of the other ranks are filled by an all-gather right before
    each task that reads them (allreduce, argmax_reduce), so the reductions are the same rank-ordered sums."""

    def __init__(self, graphs: list[Graph], mems: list[RankMemory], comm=None, compile: bool = False):
        self.mems, self.comm = mems, comm
        self.compile, self._compiled = compile, None
        # ops with a batched whole-op version run as one pseudo-task; the rest as their coarse tiles
        self.tasks = []
        for g in graphs:
            ts = []
            for op in g.ops:
                if runs_whole(op):
                    ts.append(_WholeOp(op))
                else:
                    ts.extend(decompose(g.subgraph([op.name]), COARSE))
            self.tasks.append(ts)
        self.consts = [{} for _ in self.tasks]   # per rank, kept across steps: views of weights (conventional_ops._wt)
        env_removed("MPK_CONV_FUSE_ADD_NORM", "the residual add fused with the next RMSNorm measured no gain in "
                    "session 19, -1.2..+0.5%", allowed=("0",))
        self.kernels = {t.kind: (WHOLE_OPS[t.op.kind][0] if isinstance(t, _WholeOp) else get_task_kind(t.kind))
                        for ts in self.tasks for t in ts}
        self.bf16_logits = [_argmax_only_outputs(ts) for ts in self.tasks]   # MPK_CONV_BF16_ARGMAX candidates
        if comm is not None and comm.world_size > 1:
            if len(mems) != 1:
                raise ValueError("with a communicator each process holds exactly one rank")
            for kind, sym_param in (("allreduce", "part"), ("argmax_reduce", "part")):
                if kind in self.kernels:   # a segment without that op (e.g. attention only) has nothing to wrap
                    self.kernels[kind] = self._gathering(self.kernels[kind], sym_param)

    def _gathering(self, kernel, sym_param):
        def run(task, mem, ctx):
            buf = mem.sym(task.params[sym_param], ctx.parity)  # (W * k, ...): k slots per rank, rank-major
            k = buf.shape[0] // self.comm.world_size
            buf.copy_(self.comm.all_gather(buf[mem.rank * k:(mem.rank + 1) * k].contiguous(), dim=0))
            kernel(task, mem, ctx)
        return run

    def new_step(self) -> list[dict]:
        """Fresh per-step value dicts, one per rank held (conventional_ops: row positions, RoPE tables, KV slots,
        attention masks, computed by the first op that needs them), carrying this executor's weight views."""
        return [{"const": c} for c in self.consts]

    def run(self, ctxs: list[StepCtx], steps: list[dict] | None = None) -> None:
        # per-step values shared by the layers, one dict per rank; fresh every step (never reused across steps:
        # a captured graph must recompute them from the pos / block_tables of the step it replays). A caller
        # running several conventional segments in one step (PlanExecutor) passes the same `steps` to each, so
        # the values are computed once per step, not once per segment.
        steps = steps if steps is not None else self.new_step()
        if self.compile:
            if self._compiled is None:
                self._compiled = torch.compile(self._run, dynamic=False, options=inductor_options())
            with recompiles_allowed():   # every segment and StepCtx variant is a graph of the same code (_run)
                self._compiled(ctxs, steps)
        else:
            self._run(ctxs, steps)

    def _run(self, ctxs: list[StepCtx], steps: list[dict]) -> None:
        for r, c in enumerate(ctxs):   # MPK_CONV_BF16_ARGMAX: whose LM head keeps its bf16 product this step
            keep = self.bf16_logits[r] if c.greedy and c.logits_unread and not self.compile and conv_bf16_argmax() \
                and greedy_fast() else frozenset()
            steps[r]["bf16_names"], steps[r]["bf16_logits"] = keep, {}
        n = max(len(ts) for ts in self.tasks)
        for i in range(n):
            for r, ts in enumerate(self.tasks):
                if i < len(ts):
                    t = ts[i]
                    if isinstance(t, _WholeOp):
                        self.kernels[t.kind](t.op, self.mems[r], ctxs[r], steps[r])
                    elif t.kind == "argmax_partial" and t.params["logits"] in steps[r]["bf16_logits"]:
                        self.kernels[t.kind](t, self.mems[r], ctxs[r],
                                             logits=steps[r]["bf16_logits"][t.params["logits"]])
                    else:
                        self.kernels[t.kind](t, self.mems[r], ctxs[r])


def _argmax_only_outputs(ts: list) -> frozenset:
    """Outputs of whole linear ops (the LM head) that later in `ts` only argmax_partial tasks read, and at least one
    does: the logits whose fp32 copy a greedy step with StepCtx.logits_unread may skip (MPK_CONV_BF16_ARGMAX). A
    plan that cuts between the LM head and its argmax, or anything else that reads the logits, keeps the copy."""
    out = set()
    for i, t in enumerate(ts):
        if not (isinstance(t, _WholeOp) and t.op.kind == "linear"):
            continue
        name = t.op.attrs["out"]
        readers = [u for u in ts[i + 1:]
                   if (name in u.op.inputs if isinstance(u, _WholeOp) else any(rg.tensor == name for rg in u.reads))]
        if readers and all(not isinstance(u, _WholeOp) and u.kind == "argmax_partial" for u in readers):
            out.add(name)
    return frozenset(out)


class _WholeOp:
    """An op run whole (conventional_ops) in the executor's program order."""

    def __init__(self, op):
        self.op, self.kind = op, "whole:" + op.kind    # apart from the task kind (a TP linear runs as tasks)


# --- batched prefill of unequal chunks -----------------------------------------------------------------------
def pow2(n: int, lo: int = 1) -> int:
    """The smallest power of two >= max(n, lo) (lo a power of two)."""
    p = lo
    while p < n:
        p *= 2
    return p


@dataclass
class PrefillGroup:
    """Prompt chunks run as one prefill graph of (B sequences, T tokens), left-padded (StepCtx.pad): chunk j of
    the group is chunks[idx[j]]; sequences past len(idx) are inactive (pos -1). Host tensors."""

    idx: list[int]
    B: int
    T: int
    tokens: torch.Tensor    # (B * T,)
    pos: torch.Tensor       # (B,) start position of each chunk; -1 inactive
    pad: torch.Tensor       # (B,) leading padding rows
    tables: torch.Tensor    # (B, width)
    sampling: list
    kv_cap: int = 0         # keys attention gathers at most: a power of two (>= 16, <= max_seq_len) covering
    #                         every chunk's end, so a GPU step's shapes repeat (StepCtx.kv_len_cap)
    packed: tuple | None = None   # (row_pos, row_seq, last_rows) host tensors of a packed group (packed_group)


def _check_ends(chunks, max_seq_len: int) -> None:
    for toks, start, _, _ in chunks:
        if start + len(toks) > max_seq_len:
            raise ValueError(f"prompt chunk ends at position {start + len(toks)} > max_seq_len {max_seq_len}")


def prefill_groups(chunks, max_seq_len: int, width: int) -> list[PrefillGroup]:
    """chunks: (tokens, start_pos, block table, sampling) of one step, grouped by power-of-two length (>= 16,
    <= max_seq_len), each group's sequence count a power of two: few graph shapes, < 2x padding per dimension."""
    _check_ends(chunks, max_seq_len)
    by_len: dict[int, list[int]] = {}
    for i, (toks, *_rest) in enumerate(chunks):
        by_len.setdefault(min(pow2(len(toks), 16), max_seq_len), []).append(i)
    out = []
    for T, idx in sorted(by_len.items()):
        B, free = pow2(len(idx)), pow2(len(idx)) - len(idx)
        # (each array built as one list and converted once: an element or row written into a tensor is a torch call,
        # which lets go of the GIL, and in a server whose HTTP thread is busy each one waits ~1-5 ms to get it back)
        tok = torch.tensor([x for i in idx for x in [0] * (T - len(chunks[i][0])) + list(chunks[i][0])] +
                           [0] * (free * T), dtype=torch.int64)
        pos = torch.tensor([chunks[i][1] for i in idx] + [-1] * free, dtype=torch.int64)
        pad = torch.tensor([T - len(chunks[i][0]) for i in idx] + [T] * free, dtype=torch.int64)
        tab = torch.tensor([list(chunks[i][2]) + [0] * (width - len(chunks[i][2])) for i in idx] +
                           [[0] * width] * free, dtype=torch.int64)
        end = max(chunks[i][1] + len(chunks[i][0]) for i in idx)
        out.append(PrefillGroup(idx, B, T, tok, pos, pad, tab, [chunks[i][3] for i in idx],
                                min(pow2(end, 16), max_seq_len)))
    return out


def packed_group(chunks, max_seq_len: int, width: int, max_rows: int) -> PrefillGroup | None:
    """The chunks of one step as one packed group (StepCtx.packed), when every chunk starts its sequence and their
    rows fit max_rows: rows back to back from row 0, then padding (position -1, sequence -1); B = the chunks
    rounded up to a power of two, T = the rows a sequence rounded so that B * T (a power of two >= 16 rows) holds
    them all. Short prompts of unequal lengths pad to the step's total, not to each length's power of two times a
    power-of-two count (session 64: 11 chunks of 4-24 tokens, 154 rows, ran as 384 rows in two graphs; packed,
    256 in one). None when the step does not qualify (a continued chunk reads cached keys: prefill_groups)."""
    if not chunks or any(start != 0 for _, start, _, _ in chunks):
        return None
    R = sum(len(t) for t, *_ in chunks)
    if R > max_rows:
        return None
    _check_ends(chunks, max_seq_len)
    n = len(chunks)
    B = pow2(n)
    T = pow2(-(-R // B), 16)
    if T > max_seq_len:   # (a graph's rows a sequence stay within the positions, as the grouped path's)
        return None
    M, lens = B * T, [len(t) for t, *_ in chunks]
    free = M - R   # (each array built as one list and converted once: ~10x faster than per-chunk tensor writes)
    tok = torch.tensor([x for t, *_ in chunks for x in t] + [0] * free, dtype=torch.int64)
    row_pos = torch.tensor([p for L in lens for p in range(L)] + [-1] * free, dtype=torch.int64)
    row_seq = torch.tensor([j for j, L in enumerate(lens) for _ in range(L)] + [-1] * free, dtype=torch.int64)
    ends = [e - 1 for e in itertools.accumulate(lens)]
    last = torch.tensor(ends + [M - 1] * (B - n), dtype=torch.int64)   # (an unused slot reads a padding row)
    pos = torch.tensor([0] * n + [-1] * (B - n), dtype=torch.int64)
    # the sampler's counter: pos + T - 1 - pad = the chunk's last position
    pad = torch.tensor([T - L for L in lens] + [T] * (B - n), dtype=torch.int64)
    tab = torch.tensor([list(tb) + [0] * (width - len(tb)) for _, _, tb, _ in chunks] +
                       [[0] * width] * (B - n), dtype=torch.int64)
    # (no kv_cap: a packed step's keys are its own rows, whatever the cap)
    return PrefillGroup(list(range(n)), B, T, tok, pos, pad, tab, [c[3] for c in chunks],
                        packed=(row_pos, row_seq, last))


def step_groups(chunks, max_seq_len: int, width: int, packed_rows: int) -> list[PrefillGroup]:
    """The groups one prefill step runs: the chunks that start their sequences as one packed group (packed_group,
    when packed_rows > 0 and their rows fit), the others (continued chunks: a long prompt's next part, a prefix-cache
    hit's rest) grouped by length (prefill_groups); every group's idx indexes `chunks`."""
    fresh = [i for i, c in enumerate(chunks) if c[1] == 0] if packed_rows else []
    pg = packed_group([chunks[i] for i in fresh], max_seq_len, width, packed_rows) if fresh else None
    if pg is None:
        return prefill_groups(chunks, max_seq_len, width)
    pg.idx = fresh
    rest = [i for i, c in enumerate(chunks) if c[1] != 0]
    groups = prefill_groups([chunks[i] for i in rest], max_seq_len, width) if rest else []
    for g in groups:
        g.idx = [rest[j] for j in g.idx]
    return [pg] + groups
