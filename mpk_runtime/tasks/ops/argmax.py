"""argmax: the next token over a vocab-parallel LM head: greedy, or sampled on device (ir/sampling.py).

argmax_partial: the rank's vocabulary is cut into S equal slices (graph attr "slices"); per row and slice, the
candidates go into slot rank * S + s of every rank's symmetric buffer (W * S, B, C, 2) = (value, global index as
fp32). A task covers a run of slices (one per task in the megakernel: the scan of the logits spreads over SMs;
all of them in the conventional executor). Greedy rows (temperature 0): entry 0 is the slice's best (value,
lowest index). Sampled rows: the slice's top-C by (order key desc, index asc). Merging the slots gives what one
slot per rank gave: the best entry (ties -> lowest index) and the global top-C (a total order) do not depend on
how the vocabulary was cut.
argmax_reduce: every rank merges the slots the same way (greedy: best entry 0, ties -> lowest index, as
torch.argmax; sampled: the global top-C, temperature, top-k, top-p, a counter-based draw), so all ranks agree on
the token without a host round trip; in decode graphs it also writes the `tokens` input of the next step (a
lag-1 dependency), which is what lets several steps run in one launch.

The CPU semantics below are vectorised over rows and use only single IEEE fp32 ops (no fused multiply-add, no
library exp), in the order device_kernels/ops/argmax.cuh (and sample_select.cuh) uses, so pyvm / the conventional executor and the
megakernel draw identical tokens. They never sync with the host (no data-dependent branching on tensors that
may live on a GPU): greedy and sampled results are both computed and selected per row.
"""
from __future__ import annotations

import torch

from ...envflags import env_flag
from ...ir.sampling import EXP2_POLY, HASH_M1, HASH_M2, LOG2E, PAD_INDEX, POS_SALT
from ..graph import Region, Task
from . import decomposer, task_kind

_M32 = 0xFFFFFFFF


@decomposer("argmax")
def decompose(op, graph, tiling, rank):
    a = op.attrs
    B, V = graph.tensors[a["logits"]].shape
    W = a["world"]
    sp = {k: a[k] for k in ("temperature", "top_k", "top_p", "seed")}
    S = a.get("slices", 1)
    n = tiling.argmax_t(S)
    vs, per = V // S, S // n   # logits per slice, slices per task
    parts = []
    for b0, nb in tiling.argmax_row_groups(B, n):
        rows = (b0, b0 + nb)
        for k in range(n):
            s0 = k * per
            slot0 = rank * S + s0
            parts.append(Task(-1, rank, "argmax_partial", op.name,
                              {"logits": a["logits"], "part": a["part"], "vocab0": a["vocab0"],
                               "temperature": sp["temperature"], "s0": s0, "nslices": per, "slice_len": vs,
                               "slot0": slot0, "b0": b0, "nb": nb},
                              reads=[Region(a["logits"], rank, (rows, (s0 * vs, (s0 + per) * vs)))],
                              writes=[Region(a["part"], r, ((slot0, slot0 + per), rows)) for r in range(W)],
                              est_bytes=nb * vs * per * 4, est_flops=nb * vs * per))
    reds = []
    for b0, nb in tiling.argmax_reduce_groups(B):
        rows = (b0, b0 + nb)
        lag = [Region("tokens", rank, (rows,))] if a["feeds_next_step"] else []
        reds.append(Task(-1, rank, "argmax_reduce", op.name,
                         {"part": a["part"], "out": a["out"], "world": W, "slots": W * S,
                          "feeds_next_step": a["feeds_next_step"], "b0": b0, "nb": nb, **sp},
                         reads=[Region(a["part"], rank, ((0, W * S), rows))], writes=[Region(a["out"], rank, (rows,))],
                         lag_writes=lag, est_bytes=W * S * nb * 8 + nb * 8, est_flops=W * S * nb))
    return [*parts, *reds]


# --- helpers (mirrored one for one in argmax.cuh) --------------------------------------------------------------
def order_key(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 in [0, 2^32): the order-preserving unsigned key of the bit pattern (larger = larger float)."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & _M32
    return torch.where(u >= 0x80000000, _M32 - u, u | 0x80000000)


def _rank_order(key: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """A single int64 whose descending order is (key desc, idx asc); idx < 2^24."""
    return (key << 24) | (PAD_INDEX - idx)


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """(x * m) mod 2^32 for x in [0, 2^32) without int64 overflow (16-bit halves of m)."""
    lo = x * (m & 0xFFFF)
    hi = ((x * (m >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def hash32(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, HASH_M1)
    x = x ^ (x >> 15)
    x = _mul32(x, HASH_M2)
    return x ^ (x >> 16)


def seed_pos_hash(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of (seed, pos) (int64 tensors) that ir.sampling.uniform_bits takes 24 bits of."""
    h = hash32((pos.to(torch.int64) + POS_SALT) & _M32)
    h = hash32(h ^ ((seed >> 32) & _M32))
    return hash32(h ^ (seed & _M32))


def uniform(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """(B,) fp32 in [0, 1): 24 bits of hash(seed, pos) (ir.sampling.uniform_bits) times 2^-24 (exact)."""
    return (seed_pos_hash(seed, pos) >> 8).to(torch.float32) * (2.0 ** -24)   # a power of two: exact in fp32


def _f32(x: float, dev) -> torch.Tensor:
    # torch.full, not torch.tensor: a fill kernel, no host-to-device copy (capturable in a CUDA graph)
    return torch.full((), x, dtype=torch.float32, device=dev)


def exp2_neg(t: torch.Tensor) -> torch.Tensor:
    """2^t for t <= 0 in fp32: 2^floor(t) (exact, from the exponent bits) times a Horner polynomial of the
    fraction; 0 where !(t >= -126) (NaN included)."""
    dev = t.device
    ok = t >= -126.0
    ts = torch.where(ok, t, _f32(0.0, dev))
    n = torch.floor(ts)
    f = ts - n
    p = _f32(EXP2_POLY[6], dev).expand_as(f)
    for c in EXP2_POLY[5::-1]:
        p = p * f
        p = p + _f32(c, dev)
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(ok, p * scale, _f32(0.0, dev))


def sample_rows(vals: torch.Tensor, idx: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Steps 3-5 of ir/sampling.py on merged candidates vals/idx (B, C) sorted best first. Returns (B,) int64
    (rows with temperature <= 0 get a meaningless value: the caller selects the greedy result there; PAD_INDEX
    where vals[:, 0] is not finite)."""
    B, C = vals.shape
    dev = vals.device
    T = torch.where(temp > 0, temp, _f32(1.0, dev))
    d = (vals - vals[:, :1]) / T[:, None]
    t = d * _f32(LOG2E, dev)
    j = torch.arange(C, device=dev)
    k = torch.where((top_k >= 1) & (top_k <= C), top_k, torch.full_like(top_k, C))
    e = exp2_neg(t)
    e = torch.where(j[None, :] == 0, _f32(1.0, dev), e)
    e = torch.where(j[None, :] < k[:, None], e, _f32(0.0, dev))
    c = torch.zeros(B, C + 1, dtype=torch.float32, device=dev)
    cc, ee = c.unbind(1), e.unbind(1)
    for q in range(C):                       # serial prefix sums, as one device thread does them
        torch.add(cc[q], ee[q], out=cc[q + 1])   # one kernel per step (no temporary + copy), the same fp32 add
    S = c.gather(1, k[:, None])[:, 0]
    thr = top_p * S
    keep = (j[None, :] < k[:, None]) & ((j[None, :] == 0) | (c[:, :C] < thr[:, None]))
    m = keep.sum(1)
    r = uniform(seed, pos) * c.gather(1, m[:, None])[:, 0]
    live = j[None, :] < m[:, None]
    chosen = (live & (c[:, 1:] <= r[:, None])).sum(1)
    last = torch.where(live & (e > 0), j[None, :], torch.zeros_like(j)[None, :]).amax(1)
    chosen = torch.where(chosen < m, chosen, last)
    tok = idx.gather(1, chosen[:, None])[:, 0].to(torch.int64)
    # a row whose best candidate is not finite (NaN, or +-inf: no distribution to draw from) draws PAD_INDEX, which
    # is no token: the engine fails the request naming NaN / inf, as for a greedy row whose logits hold NaN.
    # d[:, 0] = (v_0 - v_0) / T is NaN exactly there (T is finite and > 0): two ops, not isfinite's five
    d0 = d[:, 0]
    return torch.where(d0 == d0, tok, PAD_INDEX)


def row_last_positions(ctx, B: int) -> torch.Tensor:
    """Position of each row's last token this step (the counter of the RNG): pos + tokens_per_seq - 1."""
    pos = ctx.pos.to(torch.int64)
    if pos.numel() != B:
        raise ValueError(f"StepCtx has {pos.numel()} positions for {B} rows")
    last = pos + (ctx.tokens_per_seq - 1)
    if getattr(ctx, "pad", None) is not None:   # left-padded prefill: the last row is token T - 1 - pad
        last = last - ctx.pad.to(pos.device)
    return torch.where(pos >= 0, last, pos)


def host_syncs_ok(dev: torch.device) -> bool:
    """CPU tensors may skip the sampling work of all-greedy batches (a host check); on a GPU that check would
    sync the host and break CUDA graph capture, so the candidates are always computed there."""
    return dev.type == "cpu"


# --- task semantics ---------------------------------------------------------------------------------------------
def _sampling_rows(temp: torch.Tensor | None, greedy: bool) -> bool:
    """Whether the sampling work must run: not when the caller promised an all-greedy step (StepCtx.greedy), nor
    on a CPU when no row samples (a host check); on a GPU otherwise always (a check would sync the host)."""
    if temp is None:
        return False
    if greedy:
        if host_syncs_ok(temp.device) and bool((temp > 0).any()):
            raise ValueError("StepCtx.greedy is set but some rows have temperature > 0: clear it for sampled steps")
        return False
    return not host_syncs_ok(temp.device) or bool((temp > 0).any())


def partial_candidates(logits: torch.Tensor, vocab0: int, C: int, temp: torch.Tensor,
                       greedy: bool = False) -> torch.Tensor:
    """(B, V_local) fp32 -> (B, C, 2) this rank's candidates (value, global index), as argmax_partial pushes.
    greedy: every row is greedy (the caller knows): only entry 0 is computed."""
    B, V = logits.shape
    dev = logits.device
    out = torch.empty(B, C, 2, dtype=torch.float32, device=dev)
    if _sampling_rows(temp, greedy):   # GPU: no host sync, always compute the candidates unless promised greedy
        n = min(C, V)
        local = torch.arange(V, device=dev).expand(B, V)
        order = _rank_order(order_key(logits), local)
        top = torch.topk(order, n, dim=-1, sorted=True).indices                 # (B, n), best first
        out[:, :n, 0] = logits.gather(1, top)
        out[:, :n, 1] = (top + vocab0).float()
        out[:, n:, 0].fill_(float("-inf"))   # fill_, not setitem: no scalar tensor to copy (graph capture)
        out[:, n:, 1].fill_(float(PAD_INDEX))
    else:
        out.fill_(float("nan"))   # greedy rows: only entry 0 is defined (the device writes nothing else)
    val, idx = logits.max(-1)    # first occurrence on ties
    greedy = temp <= 0
    out[:, 0, 0] = torch.where(greedy, val, out[:, 0, 0])
    out[:, 0, 1] = torch.where(greedy, (idx + vocab0).float(), out[:, 0, 1])
    return out


def reduce_tokens(part: torch.Tensor, temp: torch.Tensor | None, top_k=None, top_p=None, seed=None,
                  pos=None) -> torch.Tensor:
    """part (W, B, C, 2) of every rank -> (B,) int64 tokens, as argmax_reduce computes them (temp None: greedy)."""
    W, B, C, _ = part.shape
    # the best entry 0 over the slots (value desc, index asc): the max value, then the lowest index holding it -
    # what the device's merge in slot order picks (logits are finite; a NaN would order differently)
    v, i = part[:, :, 0, 0], part[:, :, 0, 1]
    best_v = v.amax(0)
    tok = torch.where(v == best_v, i, torch.full_like(i, float(PAD_INDEX))).amin(0).long()
    if temp is not None and (not host_syncs_ok(temp.device) or bool((temp > 0).any())):
        vals = part[..., 0].permute(1, 0, 2).reshape(B, W * C)             # slot-major, as the device
        idx = part[..., 1].permute(1, 0, 2).reshape(B, W * C)
        ii = torch.where(temp[:, None] > 0, idx, torch.zeros_like(idx)).to(torch.int64)
        order = _rank_order(order_key(torch.where(temp[:, None] > 0, vals, torch.zeros_like(vals))), ii)
        top = torch.topk(order, C, dim=-1, sorted=True).indices
        drawn = sample_rows(vals.gather(1, top), ii.gather(1, top), temp, top_k, top_p, seed, pos)
        tok = torch.where(temp > 0, drawn, tok)
    return tok


def sample_logits(logits: torch.Tensor, temperature, top_k, top_p, seed, pos, C: int) -> torch.Tensor:
    """The whole op for one rank holding the full vocab: (B, V) fp32 logits + per-row params -> (B,) tokens."""
    temp = torch.as_tensor(temperature, dtype=torch.float32)
    part = partial_candidates(logits.float().contiguous(), 0, C, temp)[None]
    return reduce_tokens(part, temp, torch.as_tensor(top_k, dtype=torch.int64),
                         torch.as_tensor(top_p, dtype=torch.float32), torch.as_tensor(seed, dtype=torch.int64),
                         torch.as_tensor(pos, dtype=torch.int64))


def _rows(t: torch.Tensor, b0: int, nb: int) -> torch.Tensor:
    """Rows [b0, b0 + nb) of t; t itself when that is all of it (the conventional executor's one task: no extra
    slice kernels in its graph)."""
    return t if b0 == 0 and nb == t.shape[0] else t[b0:b0 + nb]


@task_kind("argmax_partial")
def execute_partial(task, mem, ctx, logits: torch.Tensor | None = None):
    """logits: the LM head's product in place of the fp32 logits tensor (the conventional executor's greedy steps
    under MPK_CONV_BF16_ARGMAX: the same values, rounded no further)."""
    p = task.params
    logits = mem.t(p["logits"]) if logits is None else logits  # (B, V_local) fp32 (or bf16: see above)
    B = logits.shape[0]
    b0, nb = p.get("b0", 0), p.get("nb", B)
    logits = _rows(logits, b0, nb)
    n, vs = p.get("nslices", 1), p.get("slice_len", logits.shape[1])
    v0 = p.get("s0", 0) * vs
    x = logits[:, v0:v0 + n * vs].reshape(nb * n, vs)   # row b * n + j: slice j of row b
    if getattr(ctx, "greedy", False) and greedy_fast():
        return _greedy_partial(p, mem, ctx, x, b0, nb, B, n, vs, v0)
    C = mem.sym(p["part"], ctx.parity).shape[-2]
    temp = _rows(mem.t(p["temperature"]), b0, nb) if p.get("temperature") else torch.zeros(nb, device=logits.device)
    out = partial_candidates(x, 0, C, temp.repeat_interleave(n), greedy=getattr(ctx, "greedy", False))
    off = p["vocab0"] + v0 + vs * torch.arange(n, device=logits.device).repeat(nb)
    out[:, :, 1] += off.to(torch.float32)[:, None]     # exact: indices < 2^24
    out = out.view(nb, n, C, 2).transpose(0, 1)
    slot0 = p.get("slot0", mem.rank)
    for peer in mem.peers:
        dst = peer.sym(p["part"], ctx.parity)[slot0:slot0 + n]
        if nb == B:
            dst[:] = out
        else:
            dst[:, b0:b0 + nb] = out


def greedy_fast() -> bool:
    """Promised-greedy steps take _greedy_partial / _greedy_merge (5 kernels a step in the conventional executor, 8
    with vocabulary slices) instead of partial_candidates / reduce_tokens' greedy path (26): the same tokens. The
    default since session 26's A/B (1x H200, attn-mk): llama-3.2-1b B=32 / 128 -0.3..-1.3%, qwen3-8b within noise
    (bench/results/s26). MPK_CONV_GREEDY_FAST=0 keeps the older greedy path."""
    return env_flag("MPK_CONV_GREEDY_FAST", default=True)


def _greedy_merge(part: torch.Tensor) -> torch.Tensor:
    """reduce_tokens' greedy merge when every row is greedy: the best entry 0 over the slots (W * S, B, C, 2), as an
    fp32 index (exact). Slots run in vocabulary order (rank, then slice), so the first slot holding the largest value
    holds the lowest index among the maxima: 2 kernels instead of 6 (for finite logits, as reduce_tokens)."""
    v, i = part[:, :, 0, 0], part[:, :, 0, 1]
    return i[0] if part.shape[0] == 1 else i.gather(0, v.argmax(0, keepdim=True))[0]


def _greedy_partial(p, mem, ctx, x, b0, nb, B, n, vs, v0):
    """argmax_partial when every row is greedy (StepCtx.greedy, the caller's promise): entry 0 of each slot only,
    (the slice's best value, its lowest global index), what partial_candidates puts there for a greedy row; the
    other entries are left as they are (argmax_reduce reads only entry 0 of a greedy row, and the device writes
    nothing else either). 3-4 kernels instead of partial_candidates' ~18: in a CUDA-graphed conventional step each
    costs ~1.5-2 us (tests/runtime/test_conventional_op_count.py counts them)."""
    if p.get("temperature"):
        _sampling_rows(_rows(mem.t(p["temperature"]), b0, nb), True)   # a CPU refuses a broken promise (no-op on a GPU)
    val, idx = x.max(-1)                                   # first occurrence on ties
    val, idx = val.view(nb, n).t(), idx.view(nb, n).t()    # (n, nb): slot j holds slice j of every row
    base = p["vocab0"] + v0
    off = (torch.arange(base, base + n * vs, vs, device=x.device)[:, None]   # slice j's first global index
           if n > 1 or base else None)
    slot0 = p.get("slot0", mem.rank)
    for peer in mem.peers:
        dst = peer.sym(p["part"], ctx.parity)[slot0:slot0 + n]
        dst = dst[:, :, 0] if nb == B else dst[:, b0:b0 + nb, 0]   # (n, nb, 2)
        dst[..., 0].copy_(val)
        if off is None:
            dst[..., 1].copy_(idx)                         # exact in fp32: indices < 2^24
        else:
            torch.add(idx, off, out=dst[..., 1])


@task_kind("argmax_reduce")
def execute_reduce(task, mem, ctx):
    p = task.params
    part = mem.sym(p["part"], ctx.parity)[:p.get("slots", p["world"])]  # (W * S, B, C, 2)
    B = part.shape[1]
    b0, nb = p.get("b0", 0), p.get("nb", B)
    if nb != B:
        part = part[:, b0:b0 + nb]
    if getattr(ctx, "greedy", False) and greedy_fast():   # every row greedy (promised; _greedy_partial checked it)
        tok = _greedy_merge(part)
    else:
        temp = _rows(mem.t(p["temperature"]), b0, nb) if p.get("temperature") else None
        if _sampling_rows(temp, getattr(ctx, "greedy", False)):
            tok = reduce_tokens(part, temp, _rows(mem.t(p["top_k"]), b0, nb), _rows(mem.t(p["top_p"]), b0, nb),
                                _rows(mem.t(p["seed"]), b0, nb), _rows(row_last_positions(ctx, B), b0, nb))
        else:
            tok = reduce_tokens(part, None)
    _rows(mem.t(p["out"]), b0, nb).copy_(tok)
    if p["feeds_next_step"]:
        _rows(mem.t("tokens"), b0, nb).copy_(tok)
