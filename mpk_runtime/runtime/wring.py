"""Per-warp weight page rings for batch-1 linear and qkv_rope tiles (experimental build `-DMPK_WRING=<KB>`; off by
default; measured slower at batch 1 when placed above every layout: session 28's first build +12..+97%, session
29's +0.2..+11%, and +1.5..+6.5% serving only the short phases, because the extra shared memory shrinks L1, which
holds the direct path's loads in flight; docs/perf-notes.md session 29; since session 31 they sit inside
attention's shared memory instead, see Placement).

At batch 1 every linear task pays 3-4 us at its two ends (x + norm before its first weight byte, epilogue + barrier +
signal after its last) and ~1 us at each phase boundary, while HBM idles (docs/perf-notes.md sessions 24-25). Here
the weights of the chosen tiles stream through shared memory instead, continuously: each warp owns a ring of
RING_SLOTS pages of MPK_RING_SLOT bytes, and after it has read a page it issues (one TMA bulk copy per weight, on the
page's mbarrier) the page RING_SLOTS ahead in its own sequence. That page may belong to the SM's next ring task,
so its bytes are in flight while this task finishes, the SM waits on the next task's events, and x is loaded.
Weights never depend on events, and a warp refills only the slot it has just read, so no producer warp, no empty
barriers and no cross-warp hand-off are needed.

A warp's sequence over one step is fixed by the schedule: for each ring task of its SM, in list order, the warp's
contiguous row block (layout.ring_rows) of each weight (a segment), cut into pages of layout.ring_part_bytes per
weight (two weights: gate's part then up's in one page). This module lays the segments out; the kernel
(device_kernels/ops/wring.cuh) cuts them into pages, walks them, wrapping once per step, keeps the next segment's
descriptor prefetched, and reads the pages from shared memory in the same lane order as the
global-memory path (each lane its vectors k = lane mod 32 of each row, in order), so the sums are bitwise the same.

Chosen tiles (view()): batch-1 CUDA-core linear tiles of one K segment and batch-1 qkv_rope parts, nothing staged
(layout stage word). Its size is the build's (MPK_WRING KB = warps x RING_SLOTS x MPK_RING_SLOT).

Placement (session 31): the rings start right above the ring tiles' own layouts (their x rows), inside the shared
memory the launch takes anyway for larger layouts (attention's K/V buffers, the LM head's rows, argmax), so they add
no carveout where they fit (sessions 28-29 put them above every layout and lost ~10% in the long phases to the
smaller L1). The tasks whose layouts reach into the rings are clobbers (layout RING_CLOB_SHIFT): a warp issues the
pages of a tile only once the clobbers before it on its SM have finished (lay_out's gates; the kernel's
ring_resume refills the slots after each), so no copy is in flight while a clobber runs; replay() checks that
on the CPU against the schedule.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from ..codegen import layout as L
from ..codegen import nvcc

NWARPS = L.CONSTANTS["THREADS"] // 32


@dataclass(frozen=True)
class RingConfig:
    kb: int            # the ring's shared memory per CTA, KB (MPK_WRING)
    slot: int          # bytes per page slot (MPK_RING_SLOT)

    @property
    def slots(self) -> int:
        """Page slots per warp (the kernel's RING_SLOTS: the same integer division)."""
        return self.kb * 1024 // NWARPS // self.slot

    @property
    def nbytes(self) -> int:
        return NWARPS * self.slots * self.slot


def build_config() -> RingConfig | None:
    """The ring of the build MPK_NVCC_DEFINES describes (-DMPK_WRING=<KB>, -DMPK_RING_SLOT=<bytes>, default 4096),
    or None (the default build has none)."""
    kb = nvcc.define_int("MPK_WRING", 0)
    if kb <= 0:
        return None
    cfg = RingConfig(kb, nvcc.define_int("MPK_RING_SLOT", 4096))
    if cfg.slots < 1:
        raise ValueError(f"MPK_WRING={kb} KB gives {NWARPS} warps no {cfg.slot}-byte page slot each: a larger ring or a "
                         "smaller MPK_RING_SLOT")
    L.ring_part_bytes(cfg.slot, 2)   # two-weight pages must split in whole 512-byte halves
    return cfg


# the ops whose batch-1 tiles view() can serve
RING_OP_NAMES = frozenset({"qkv_rope", "o_proj", "gate_up", "down", "lm_head"})


def ring_ops() -> frozenset[str] | None:
    """The ops whose tiles the ring serves, from MPK_RING_OPS (comma-separated op names without the layer prefix,
    e.g. "o_proj,down,qkv_rope"; session 29 measured the ring slower than the direct path inside long phases such
    as gate_up and lm_head, faster into short ones), or None: every tile view() accepts."""
    names = os.environ.get("MPK_RING_OPS", "").strip()
    if not names:
        return None
    ops = frozenset(n.strip() for n in names.split(",") if n.strip())
    bad = sorted(ops - RING_OP_NAMES)
    if bad:
        raise ValueError(f"MPK_RING_OPS names {bad}: the ring serves only {sorted(RING_OP_NAMES)}")
    return ops


def op_name(op: str) -> str:
    """A task's op name without its layer prefix ("L3.o_proj" -> "o_proj")."""
    return re.sub(r"^L\d+\.", "", op)


def view(kind: str, a: dict, stage_word: int) -> dict | None:
    """The weight rows a tile the ring serves streams, as (n0, n1, k, w0, w1): rows [n0, n1) of w0 (and of w1), K
    bf16 each; None for a tile it does not serve. Served: batch-1 CUDA-core linear tiles of one K segment, and
    batch-1 qkv_rope parts (their two row ranges of the head: pairs r0 .. r0 + nr and D/2 + r0 ..; linear_core's
    call in qkv_rope.cuh), with nothing staged."""
    if stage_word != 0:
        return None
    if kind == "linear" and a["tc_rows"] == 0 and a["m"] == 1 and a["kseg"] == 1:
        return dict(n0=a["n0"], n1=a["n1"], k=a["k"], w0=a["w0"], w1=a["w1"])
    if kind == "qkv_rope" and a["m"] == 1:
        return dict(n0=a["r0"], n1=a["r0"] + a["nr"], k=a["k"], w0=a["w"], w1=a["w"] + a["d"] // 2 * a["k"] * 2)
    return None


SEG_WORDS = 4   # a segment descriptor: weight 0's address, weight 1's (or 0), bytes of each, a pad word (32 B)


def warp_segment(v: dict, warp: int) -> tuple[int, int, int] | None:
    """(address of weight 0's rows, of weight 1's or 0, bytes of each) that warp `warp` reads of a ring tile whose rows
    are `v` (view()): its contiguous row block (layout.ring_rows); None when the block is empty."""
    ra, rb = L.ring_rows(v["n0"], v["n1"], warp, NWARPS)
    if ra >= rb:
        return None
    row = v["k"] * 2
    return v["w0"] + ra * row, (v["w1"] + ra * row) if v["w1"] else 0, (rb - ra) * row


def pages(seg: tuple[int, int, int], slot: int) -> list[tuple[int, int, int]]:
    """The pages the kernel cuts a segment into (wring.cuh ring_issue): parts of layout.ring_part_bytes per weight
    (the last one shorter), as (weight 0 address, weight 1 address or 0, bytes of each)."""
    s0, s1, total = seg
    part = L.ring_part_bytes(slot, 2 if s1 else 1)
    return [(s0 + o, s1 + o if s1 else 0, min(part, total - o)) for o in range(0, total, part)]


def ring_quiet() -> bool:
    """MPK_RING_QUIET=1: no ring copy in flight on any SM while attention runs; the tasks that wait on attention open
    the gates when they start (session 31: copies issued during attention on the SMs without an attention task made
    attention 2.3 us a layer slower on llama)."""
    v = os.environ.get("MPK_RING_QUIET", "0").strip()
    if v not in ("0", "1", ""):
        raise ValueError(f"MPK_RING_QUIET={v!r}: 1 (no ring copies during attention) or 0")
    return v == "1"


def lay_out(sm_lists: list[list[int]], ring_args: dict[int, dict],
            clobbers: frozenset[int] | set[int] = frozenset(),
            openers: frozenset[int] | set[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment table (n, SEG_WORDS) int64 and the int32 offsets (num_sms * NWARPS + 1) of each (SM, warp)'s
    segments within it: for SM s and warp w, rows offs[s * NWARPS + w] .. offs[... + 1] - 1 are its row blocks of
    one step's ring tiles, in the SM's list order (ring_args: task id -> its rows, view()). The kernel cuts them into
    pages itself (pages()), so it reads one descriptor a tile, a tile ahead, instead of one a page.

    Word 3 gates a segment's pages behind the clobbering tasks (`clobbers`: tasks whose shared memory overlaps the
    rings) of its SM: the tile's clobbers before it in the SM's list (low 32 bits) and the SM's clobbers a step
    (high 32 bits), 0 where the SM has none. The kernel issues the pages of the segment of launch step s only after
    s * high + low clobbers have finished (wring.cuh ring_gate / ring_resume). An opener (`openers`) counts as a
    clobber that ends when it starts: it gates the tiles from itself on."""
    rows: list[tuple[int, int, int, int]] = []
    offs = [0]
    for lst in sm_lists:
        before, n_clob = [], 0
        for tid in lst:
            n_clob += tid in openers
            before.append(n_clob)
            n_clob += tid in clobbers
        for w in range(NWARPS):
            for tid, c in zip(lst, before):
                if tid in ring_args and (seg := warp_segment(ring_args[tid], w)) is not None:
                    rows.append((*seg, (c | n_clob << 32) if n_clob else 0))
            offs.append(len(rows))
    table = torch.tensor(rows or [(0, 0, 0, 0)], dtype=torch.int64)
    return table, torch.tensor(offs, dtype=torch.int32)


def replay(sm_lists: list[list[int]], ring_args: dict[int, dict], clobbers: set[int], table: torch.Tensor,
           offs: torch.Tensor, cfg: RingConfig, nsteps: int = 2, openers: frozenset[int] | set[int] = frozenset()) -> int:
    """The kernel's ring protocol replayed on the CPU over a launch of `nsteps` steps, SM by SM, warp by warp: the
    issue side from the table as ring_issue walks it (pages cut by pages(), gated by word 3 as ring_gate reads it),
    the read side as linear_ring_core consumes it (a tile's pages counted from its own rows: ceil of the warp's
    vectors over a page's, layout.ring_rows), ring_resume after each clobbering task. Raises AssertionError where the
    kernel would hang (a warp waits for a page never issued), corrupt shared memory (a copy in flight while a
    clobbering task runs) or read a page of another tile. `openers` (MPK_RING_QUIET) open a gate when they start
    (ring_resume before the op), and none may find a copy in flight then: the SM was quiet since its last tile
    before them, so through the attention they wait on. Returns the pages issued."""
    total = 0
    segs, offs = table.tolist(), offs.tolist()
    for sm, lst in enumerate(sm_lists):
        for w in range(NWARPS):
            mine = segs[offs[sm * NWARPS + w]:offs[sm * NWARPS + w + 1]]
            seq = []   # (the clobbers a page waits for, its segment over the launch), in issue order
            for s in range(nsteps):
                for j, (s0, s1, nb, g) in enumerate(mine):
                    need = 0 if g == 0 else s * (g >> 32) + (g & 0xFFFFFFFF)
                    seq += [(need, s * len(mine) + j)] * len(pages((s0, s1, nb), cfg.slot))
            st = {"q": 0, "iq": 0, "done": 0}

            def issue():
                if st["iq"] < len(seq) and st["done"] >= seq[st["iq"]][0] and st["iq"] < st["q"] + cfg.slots:
                    st["iq"] += 1
                    return True
                return False
            def gate(what: str):
                """A clobber's end or an opener's start (ring_resume): nothing may be in flight, then refill."""
                assert st["iq"] == st["q"], f"SM {sm} warp {w}: {st['iq'] - st['q']} ring copies in flight {what}"
                st["done"] += 1
                while issue():
                    pass
            while issue():
                pass
            k = 0   # the warp's segments read so far (over the launch)
            for _s in range(nsteps):
                for tid in lst:
                    if tid in openers:
                        gate(f"before opener {tid}")
                    if tid in clobbers:
                        gate(f"while task {tid} runs")
                    v = ring_args.get(tid)
                    if v is None:
                        continue
                    ra, rb = L.ring_rows(v["n0"], v["n1"], w, NWARPS)
                    if ra >= rb:
                        continue
                    pv = L.ring_part_bytes(cfg.slot, 2 if v["w1"] else 1) // 16
                    for _p in range(-(-(rb - ra) * (v["k"] // 8) // pv)):
                        assert st["q"] < st["iq"], \
                            f"SM {sm} warp {w}: task {tid} waits for page {st['q']}, never issued (a hang)"
                        assert seq[st["q"]][1] == k, f"SM {sm} warp {w}: task {tid} reads a page of another segment"
                        st["q"] += 1
                        issue()
                    k += 1
            assert st["q"] == st["iq"] == len(seq), (sm, w, st, len(seq))
            total += len(seq)
    return total
