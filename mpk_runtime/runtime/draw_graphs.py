"""A decode step's full-vocabulary draw (full_sampling.py has the definition) replayed as one CUDA graph.

Eagerly, the split draw (full_sampling_triton.py) is three Triton launches a step for rows at top_p 1 and seven with a
nucleus, each ~18 us of Python on the host (session 52: 55-76 us a plain draw at B=1-8 back to back, with kernels of a
few us), and a launch gap on the device each. A DrawGraphs belongs to one memory whose logits, positions and
next_tokens stay at fixed addresses (a plan bucket's, or the single megakernel's). The vocab rows of a step
(FullRows' _VocabRows group) are padded to m = the next power of two by repeating the last row, and copied into static
row tensors of that size when the group changes (FullRows is rebuilt only when the step's sampling rows change: a
request joined or left). A duplicate row draws the same token into the same slot: a row's draw is a function of its
logits, parameters and position alone, its workspace row is its own. Per (m, nucleus, buffer addresses) one graph holds
the launches; its first use runs them eagerly (compiling the kernels) and captures them right after, later uses replay
it. Ranked rows (0 < top_k < V) stay eager: torch.topk's K follows the rows.

Where the graph cannot run (CPU tensors under TRITON_INTERPRET=1, the tests; `graph=False` callers, whose positions are
a fresh tensor each call) the same padded launches run eagerly, so the CPU tests exercise the padding. MPK_DRAW_GRAPHS=0
turns this off: FullRows.draw's eager launches of the rows as they are (session 52's path; the A/B).
"""
from __future__ import annotations

import torch

from ..envflags import env_flag
from . import full_sampling_triton as fst
from .full_sampling import FullRows, _VocabRows


def enabled() -> bool:
    return env_flag("MPK_DRAW_GRAPHS", True)   # ("off" / "false" were silently on)


class _Static:
    """The row tensors and workspace of m padded vocab rows (what fst.draw_vocab reads as `rows`), and their graphs."""

    def __init__(self, m: int, V: int, device, nucleus: bool):
        self.m, self.nucleus = m, nucleus
        self.idx = torch.zeros(m, dtype=torch.int64, device=device)
        self.temp = torch.ones(m, dtype=torch.float32, device=device)
        self.seed = torch.zeros(m, dtype=torch.int64, device=device)
        self.top_p = torch.ones(m, dtype=torch.float64, device=device)
        self.work = fst.VocabWork(m, V, device, fst.CHUNK)
        self.loaded: _VocabRows | None = None       # the group whose rows these tensors hold
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}   # by (logits, stride, pos, out) addresses

    def load(self, g: _VocabRows) -> None:
        """g's rows, the last repeated up to m (stream-ordered copies: a replay queued before reads the old rows)."""
        n = g.idx.numel()
        sel = torch.arange(self.m, device=g.idx.device).clamp_(max=n - 1)
        for dst, src in ((self.idx, g.idx), (self.temp, g.temp), (self.seed, g.seed), (self.top_p, g.top_p)):
            dst.copy_(src.index_select(0, sel))
        self.loaded = g


class DrawGraphs:
    """The full draws of one memory's decode steps (module doc)."""

    def __init__(self):
        self._static: dict[tuple[int, int, bool], _Static] = {}
        self.captures = 0    # graphs captured (tests; a capture costs a device synchronisation)
        self.replays = 0

    def draw(self, fr: FullRows, logits: torch.Tensor, pos: torch.Tensor, out: torch.Tensor,
             graph: bool = True) -> None:
        """FullRows.draw's result (out[i] of every full row i), vocab rows through the padded static launches, as a
        graph when `graph` and the tensors are on a GPU. pos, out: (n,) views whose storage stays put between calls
        when `graph` (a decode step's pos and next_tokens)."""
        if logits.shape[-1] != fr.vocab:
            fr.draw(logits, pos, out)   # (its error: a vocabulary shard)
            return
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        for g in fr.groups:
            if not isinstance(g, _VocabRows):
                g.draw(logits, pos, out)
                continue
            V = logits.shape[1]
            key = (fst._pow2(g.idx.numel()), V, g.nucleus)
            st = self._static.get(key)
            if st is None:
                st = self._static[key] = _Static(key[0], V, logits.device, g.nucleus)
            if st.loaded is not g:
                st.load(g)
            if not (graph and logits.is_cuda):
                fst.draw_vocab(st, logits, pos, out, st.work)
                continue
            where = (logits.data_ptr(), logits.stride(0), pos.data_ptr(), out.data_ptr())
            cg = st.graphs.get(where)
            if cg is not None:
                cg.replay()
                self.replays += 1
                continue
            fst.draw_vocab(st, logits, pos, out, st.work)   # this step's draw; compiles the kernels
            cg = torch.cuda.CUDAGraph()
            # (thread_local: an engine thread reading the last burst's tokens meanwhile does not void the capture;
            # the capture records the launches only, nothing runs)
            with torch.cuda.graph(cg, capture_error_mode="thread_local"):
                fst.draw_vocab(st, logits, pos, out, st.work)
            st.graphs[where] = cg
            self.captures += 1
