"""A decode burst's inputs and outputs on the device, shared by the megakernel runner's paths (the one megakernel,
PlannedDecoder's graphs): the step inputs a launch or a captured graph reads, written in place without synchronising
(fill_step, write_tables, host_copy); a burst of steps with each drawn token fed back on the device (burst); and the
burst's tokens and status words read back later (device_pending: a runtime.base.Pending), so the next burst can be
queued before this one is read (engine/bursts.py).
"""
from __future__ import annotations

import torch

from .base import KernelTimeout, Pending
from .device_sampling import draw_full, fill_sampling
from .memory import RankMemory


def fill_step(mem: RankMemory, pos_t, tables_t, toks, pos, tables, width: int, sampling,
              tokens_from: torch.Tensor | None = None) -> None:
    """Write a step's inputs in place (what a captured graph reads): rows past len(toks) inactive. tokens_from: the
    live rows' tokens as a tensor on the device (a resumed burst: the tokens the last one drew; toks then ignored)."""
    B = pos_t.shape[0]
    n = len(pos)
    # one host tensor per input, built from padded lists (a tensor per row cost ~1 ms at 128 rows)
    if tokens_from is None:
        host_copy(mem.t("tokens"), list(toks) + [0] * (B - n))
    else:
        mem.t("tokens")[:n].copy_(tokens_from)
        mem.t("tokens")[n:].zero_()
    host_copy(pos_t, list(pos) + [-1] * (B - n))
    write_tables(tables_t, tables)
    fill_sampling(mem, sampling or [])


def host_copy(dst: torch.Tensor, values) -> None:
    """dst (flat view) <- values (a list, or a nested list of dst's shape), queued on the current stream without
    synchronising: through pinned memory when dst is on a GPU. A pageable host tensor's copy_ waits for the stream
    to drain, i.e. for a burst already queued (engine/bursts.py queues the next one before reading the last); the
    pinned block goes back to torch's host cache only after the copy ran."""
    if dst.is_cuda:
        dst.copy_(torch.tensor(values, dtype=dst.dtype, pin_memory=True).view(dst.shape), non_blocking=True)
    else:
        dst.copy_(torch.tensor(values, dtype=dst.dtype).view(dst.shape))


def write_tables(tables_t: torch.Tensor, tables) -> None:
    """The rows' page tables into tables_t (B, width): each row zero past its pages, the rows past len(tables) zero,
    exactly as a full-width rewrite leaves it. The tensor keeps what each row holds (before its zero tail); a row that
    only grew writes its new entries, a row that changed otherwise is rewritten over its old length, and the changed
    cells go to the device in one scatter (none when nothing changed). A step costs O(rows) list comparisons in C and
    Python ints for the changes only (a page a row every page_size tokens); the full-width host table it replaced was
    O(B x max_seq_len / page_size) ints: 3.7 ms at 128 rows and max_seq_len 8192 (page 16), 57 ms at 131072, on the
    critical path of every burst."""
    B, width = tables_t.shape
    rows = [list(r) for r in tables] + [[] for _ in range(B - len(tables))]
    if len(rows) > B or max(map(len, rows), default=0) > width:
        raise ValueError(f"{len(tables)} page tables of up to {max(map(len, rows), default=0)} pages for a table "
                         f"tensor of {B} rows x {width} pages")
    prev = getattr(tables_t, "_mpk_rows", None)
    if prev is None or len(prev) != B:   # the first write: contents unknown, zeroed
        tables_t.zero_()
        prev = [[]] * B
    idx: list[int] = []
    val: list[int] = []
    for i, (r, p) in enumerate(zip(rows, prev)):
        lp, lr = len(p), len(r)
        if lr >= lp and r[:lp] == p:   # grew (or unchanged)
            if lr > lp:
                idx.extend(range(i * width + lp, i * width + lr))
                val.extend(r[lp:])
        else:                          # another sequence, or shorter: the row over its old length
            m = max(lr, lp)
            idx.extend(range(i * width, i * width + m))
            val.extend(r + [0] * (m - lr))
    if idx:
        upd = torch.empty((2, len(idx)), dtype=torch.int64, device=tables_t.device)
        host_copy(upd, [idx, val])
        tables_t.view(-1).index_copy_(0, upd[0], upd[1])
    tables_t._mpk_rows = rows


def burst(mem: RankMemory, pos_t: torch.Tensor, n: int, num_steps: int, run_step, logits=None) -> torch.Tensor:
    """num_steps calls of run_step() on the inputs fill_step wrote, each later step's inputs made from the last one's
    on the device (each of the n rows' drawn token, one position on); returns the drawn tokens (num_steps, n) on the
    device, without synchronising. logits(): the step's logits over the whole vocabulary for the full draw (a TP
    rank's gathered shards); default the step's own."""
    drawn = torch.empty((num_steps, n), dtype=torch.int64, device=pos_t.device)
    for j in range(num_steps):
        if j:
            mem.t("tokens")[:n].copy_(mem.t("next_tokens")[:n])
            pos_t[:n] += 1
        run_step()
        draw_full(mem, logits() if logits is not None else mem.t("logits")[:n], pos_t[:n], graph=True)
        drawn[j].copy_(mem.t("next_tokens")[:n])
    return drawn


def device_pending(drawn: torch.Tensor, megakernels, on_timeout=None) -> Pending:
    """A burst's drawn tokens (k, n) on the device as a Pending of (n, k) on the CPU. Queued behind the burst now,
    nothing synchronised: the tokens' copy into pinned memory, each megakernel's status words beside them, and an
    event; wait() synchronises on the event, raises KernelTimeout for a timed-out status (after on_timeout()), and
    returns the tokens. On the CPU (the pyvm twin) the tokens are already there."""
    if not drawn.is_cuda:
        return Pending(value=drawn.t().contiguous())
    host = drawn.t().to("cpu", non_blocking=True)
    status = [(mk, mk.status.to("cpu", non_blocking=True)) for mk in megakernels]
    done = torch.cuda.Event()
    done.record()

    def wait() -> torch.Tensor:
        done.synchronize()
        try:
            for mk, st in status:
                mk.check(st)
        except KernelTimeout:
            if on_timeout is not None:
                on_timeout()
            raise
        return host
    return Pending(wait)
