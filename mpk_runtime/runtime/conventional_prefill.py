"""The prompt chunks of a step as a few left-padded prefill graphs through the conventional executor (torch ops on
the GPU, replayed as CUDA graphs per shape) instead of one megakernel launch per prompt token: the "megakernel"
ModelRunner's prefill at every world size (at tp > 1 over the group's communicator). gather_vocab: a TP rank's
vocabulary shards of the logits gathered through that communicator (prefill and PlannedDecoder at tp > 1).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

import torch

from ..envflags import env_flag, env_int
from ..ir.build import build_graph
from ..ir.shard import shard_for
from ..models.reference import rope_inv_freq
from ..ir.sampling import TENSORS
from .device_sampling import draw_full, has_sampling_tensors, sampling_lists, set_full_rows
from .memory import KVStore, RankMemory, StepCtx
from .torch_exec import ConventionalExecutor, pow2, step_groups

log = logging.getLogger(__name__)


def gather_vocab(cfg, tp: int, comm, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(n, V) fp32 on this device from this rank's vocab shard of the logits (n, V / tp), through the communicator:
    every rank's shard, in vocabulary order (a collective: every rank calls it for the same rows). out: an (n, V)
    fp32 tensor to write (one whose storage stays put: the full draw's graphs key on its address)."""
    lg = logits.float()
    n = lg.shape[0]
    nv = [shard_for(cfg, tp, q).n_vocab for q in range(tp)]
    buf = torch.zeros((n, max(nv)), dtype=torch.float32, device=lg.device)
    buf[:, :lg.shape[1]] = lg
    parts = comm.all_gather(buf, dim=0).view(tp, n, max(nv))
    pieces = [parts[q, :, :nv[q]] for q in range(tp)]
    if out is None:
        return torch.cat(pieces, dim=-1)
    return torch.cat(pieces, dim=-1, out=out)


class _PrefillShape:
    """One (sequences, tokens) bucket of ConventionalPrefill: its graph's memory and executor, the step inputs a
    captured CUDA graph reads, and the graphs captured so far, one per key cap.

    The inputs (tokens, positions, padding, page tables, a packed step's rows, the sampling parameters) are written
    on the host into one pinned buffer per dtype with numpy (`write`, `set_inactive`) and reach the device by `load`:
    one copy a buffer, then device copies into the graph memory's tokens and sample.* tensors, captured at the head of
    every graph. So a step makes no torch call before its graph's launch: each torch call lets go of the GIL, and in
    the server (its HTTP thread busy answering the finished requests of a wave) each one waited ~1-5 ms to get it
    back: session 65 measured ~20 ms a 64-prompt admission step in its ten input copies, against ~0.1 ms alone."""

    def __init__(self, mem: RankMemory, ex: ConventionalExecutor, B: int, width: int, device):
        self.mem, self.ex = mem, ex
        M = mem.t("tokens").numel()
        self.M = M
        nb = B if has_sampling_tensors(mem) else 0
        pinned = torch.device(device).type == "cuda"
        ints = (("tokens", M), ("pos", B), ("pad", B), ("tables", B * width), ("row_pos", M), ("row_seq", M),
                ("last", B), ("sample.top_k", nb), ("sample.seed", nb))
        floats = (("sample.temperature", nb), ("sample.top_p", nb))
        self.dev: dict[str, torch.Tensor] = {}
        self.host: dict[str, object] = {}      # numpy views of the pinned buffers
        self._bufs = []
        for parts, dt in ((ints, torch.int64), (floats, torch.float32)):
            n = sum(k for _, k in parts)
            d = torch.zeros((n,), dtype=dt, device=device)
            h = torch.zeros((n,), dtype=dt, pin_memory=pinned)
            self._bufs.append((d, h))
            o, hn = 0, h.numpy()
            for name, k in parts:
                self.dev[name], self.host[name] = d[o:o + k], hn[o:o + k]
                o += k
        self.pos, self.pad = self.dev["pos"], self.dev["pad"]
        self.tables = self.dev["tables"].view(B, width)
        self.packed = (self.dev["row_pos"], self.dev["row_seq"], self.dev["last"])   # row positions, row sequences,
        #                                                                            each sequence's last row
        self.sampled = nb > 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}   # by key cap (PACKED: the packed step's)

    def set_inactive(self, T: int) -> None:
        """Every row inactive (a graph's warm-up and capture: nothing live is written), greedy."""
        h = self.host
        for name, v in (("tokens", 0), ("pos", -1), ("pad", T), ("tables", 0), ("row_pos", -1), ("row_seq", -1),
                        ("last", self.M - 1)):
            h[name][:] = v
        if self.sampled:
            self._write_sampling([])

    def write(self, g) -> None:
        """A PrefillGroup's inputs into the pinned buffers (host only; `load`, or the graph's replay, moves them)."""
        h = self.host
        h["tokens"][:] = g.tokens.numpy()
        h["pos"][:] = g.pos.numpy()
        h["pad"][:] = g.pad.numpy()
        h["tables"][:] = g.tables.numpy().reshape(-1)
        if g.packed is not None:
            for name, src in zip(("row_pos", "row_seq", "last"), g.packed):
                h[name][:] = src.numpy()
        if self.sampled:
            self._write_sampling(g.sampling)

    def _write_sampling(self, rows) -> None:
        for name, v in zip(TENSORS, sampling_lists(rows, len(self.host["sample.top_k"]))):
            self.host[name][:] = v
        set_full_rows(self.mem, rows)

    def load(self) -> None:
        """The pinned buffers to the device and into the graph memory's inputs (device work, no sync; captured)."""
        for d, h in self._bufs:
            if d.numel():
                d.copy_(h, non_blocking=True)
        self.mem.t("tokens").view(-1).copy_(self.dev["tokens"])
        if self.sampled:
            for name in TENSORS:
                self.mem.t(name).copy_(self.dev[name])


def _pow2s(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... <= hi (lo a power of two)."""
    out, p = [], lo
    while p <= hi:
        out.append(p)
        p *= 2
    return out


# Key caps from which a prefill group runs eagerly over its sequences' exact keys instead of replaying a graph over the
# power-of-two cap with a mask (session 55, 1x H100, llama-3.2-1b, 4096-token chunks through the graphs: ~92 / 163 /
# 340 ms a chunk at caps 16k / 32k / 128k, the time following the cap, not the keys; a 131k-token prompt's first token
# 6.9 s warm, 7.9 s cold, each new cap's first chunk 0.4-1.6 s with its capture). From 16k keys a chunk's attention
# should dominate its time (prediction: ~60-80%), so an eager step's launches hide behind it.
EXACT_KEYS = 16384

# The chunks of a step that start their sequences, when they hold at most this many rows, run packed
# (torch_exec.step_groups / packed_group: one graph, rows back to back, attention under a block-diagonal mask of
# M x M): the (g * M, M) mask is 32 MB at 2048 rows and 4 query heads a KV head (64 prompts of 4-24 tokens: up to 1536
# rows). Continued chunks, and fresh ones past it, run grouped by length (prefill_groups). Session 64, 1x H100, 11
# prompts of 4-24 tokens a step: 4.18 ms packed against 7.09 grouped (llama-3.2-1b), 12.28 against 20.1 (qwen3-8b).
PACKED_ROWS = 2048
PACKED = -1   # the key of a shape's packed graph in _PrefillShape.graphs (the padded ones key on their key cap)


def _lap(tm: dict, key: str, t: float) -> float:
    """Add the seconds since t to tm[key]; the time now."""
    now = time.perf_counter()
    tm[key] += now - t
    return now


class ConventionalPrefill:
    """Prompt chunks through the conventional executor on the GPU. A step's fresh prompts (chunks that start their
    sequences), up to `packed_rows` rows in all, run packed: one graph, the rows back to back (torch_exec.step_groups,
    StepCtx.packed). The other chunks (or all, past packed_rows) are grouped by length
    bucket (powers of two >= 16) and each group runs as one prefill graph of (sequences, tokens) bucketed to
    powers of two, the chunks left-padded (StepCtx.pad: padding rows have position -1, write the scratch page and
    are masked out of attention; each chunk's last token is the graph's last row); padding sequences are inactive.
    Attention gathers a static key count per group (PrefillGroup.kv_cap, a power of two), so shapes repeat.
    Executors are cached per (sequences, tokens) bucket (a few).

    CUDA graphs (`capture`, GPU): a bucket of at most `capture_tokens` rows is captured once per key cap (warm-up
    and capture on inactive rows: their KV writes go to the scratch page) and replayed after its inputs are
    written in place: eager, a short prompt's prefill was ~60-100 ms of host time per group (~800 kernel launches
    for llama-3.2-1b; measured, scripts/profile_prefill.py). At tp > 1 the graphs hold the NCCL all-gathers;
    every rank captures the same buckets in the same order (the engine sends every rank the same chunks). The
    graphs share one memory pool (they never run concurrently). MPK_PREFILL_GRAPHS=0 turns capture off; a failed
    capture turns it off for this runner and runs eagerly."""

    def __init__(self, cfg, weights: dict, kv: KVStore, *, max_seq_len: int, page_size: int, dtype: str,
                 device: torch.device, keep: int = 8, tp: int = 1, rank: int = 0, comm=None,
                 capture: bool | None = None, capture_tokens: int = 4096, share_activations: bool = True):
        """tp > 1: this process's rank of the group (`weights` its shard) and a multi-process communicator
        (torch.distributed): the all-reduces and the distributed argmax run as all-gathers through it.
        share_activations: the layers' activations share storage (RankMemory; 11.6 -> 0.3 GiB for a qwen3-8b
        shape of 4096 rows; replays equal to eager bitwise on the GPU, tests/gpu/test_prefill_graphs.py)."""
        if tp > 1 and (comm is None or getattr(comm, "world_size", 1) != tp):
            raise ValueError(f"tp={tp} prefill through the conventional path needs the group's communicator")
        self.tp, self.rank, self.comm = tp, rank, comm
        self.cfg, self.weights, self.kv = cfg, weights, kv
        self.max_seq_len, self.page_size, self.dtype, self.device = max_seq_len, page_size, dtype, device
        self.width = -(-max_seq_len // page_size)
        self.inv = rope_inv_freq(cfg).to(device)
        self.keep = keep
        if capture is None:
            capture = env_flag("MPK_PREFILL_GRAPHS", True)   # ("off" / "false" were silently on)
        self.capture = bool(capture) and torch.device(device).type == "cuda"
        self.capture_tokens = capture_tokens
        # a group whose key cap reaches this many keys runs eagerly, each sequence over its exact keys with no mask
        # (StepCtx.rows, conventional_ops.attention_rows); 0 = never
        self.exact_keys = env_int("MPK_PREFILL_EXACT_KEYS", EXACT_KEYS, lo=0, hi=1 << 30)
        self.share_activations = share_activations
        # a step's fresh chunks, up to this many rows in all, run packed (MPK_PREFILL_PACKED_ROWS; 0 = never)
        self.packed_rows = env_int("MPK_PREFILL_PACKED_ROWS", PACKED_ROWS, lo=0, hi=1 << 16)
        self._pool = None
        self._ex: OrderedDict[tuple[int, int], _PrefillShape] = OrderedDict()
        self.graph_runs = 0          # prefill graphs run (tests: chunks of a step share graphs)
        self.captures = 0            # CUDA graphs captured
        self.capture_s = 0.0         # seconds spent capturing them (warm-up run + capture)
        self.replays = 0             # steps' groups run by replaying one
        self.exact_runs = 0          # groups run eagerly over their exact keys (exact_keys)
        self.packed_runs = 0         # steps run packed (packed_rows)
        self.late_captures: list[str] = []   # "BxT@cap" of the graphs captured in a request's path (not in warm)
        self._warming = False
        # where run_many's seconds go (graph_counts: prefill_*_s): the groups built on the host, their inputs copied
        # in, the graphs launched, the wait for the drawn tokens and the logits read back, the device's time from
        # the first group's launch to the last group's end (CUDA events; several groups: with the host's reads
        # between them; the end event is queued after the launch returns, so a thread that waits for the GIL there
        # past the graph's end stretches it: an upper bound in a busy server), and this thread's CPU seconds; wall
        # minus device minus CPU is time the thread waited for something else (the GIL, a copy queued behind work)
        self.timing = {"build_s": 0.0, "inputs_s": 0.0, "launch_s": 0.0, "wait_s": 0.0, "read_s": 0.0,
                       "device_s": 0.0, "cpu_s": 0.0, "wall_s": 0.0}
        self._events = None

    def _get(self, B: int, T: int) -> _PrefillShape:
        key = (B, T)
        if key in self._ex:
            self._ex.move_to_end(key)
            return self._ex[key]
        g = build_graph(self.cfg, mode="prefill", batch=B, tokens_per_seq=T, context_len=0,
                        max_seq_len=self.max_seq_len, dtype=self.dtype, tp=self.tp, rank=self.rank)
        mem = RankMemory(g, self.weights, self.kv, device=self.device, share_activations=self.share_activations)
        ex = ConventionalExecutor([g], [mem], comm=self.comm if self.tp > 1 else None)
        self._ex[key] = _PrefillShape(mem, ex, B, self.width, self.device)
        while len(self._ex) > self.keep:
            self._ex.popitem(last=False)
        return self._ex[key]

    def _ctx(self, sh: _PrefillShape, T: int, cap: int, rows: tuple | None = None) -> StepCtx:
        """cap PACKED: the packed step (StepCtx.packed)."""
        return StepCtx(self.cfg, 1, sh.pos, sh.tables, self.page_size, T, self.inv, pad=sh.pad,
                       kv_len_cap=T if cap == PACKED else cap, rows=rows,
                       packed=sh.packed if cap == PACKED else None)

    def _capture(self, sh: _PrefillShape, T: int, cap: int) -> None:
        """Warm up and capture bucket `sh` at key cap `cap` (or PACKED), every row inactive (nothing live is
        written)."""
        sh.set_inactive(T)
        ctx = self._ctx(sh, T, cap)
        t0 = time.perf_counter()
        try:
            sh.load()
            sh.ex.run([ctx])                 # warm-up: cuBLAS / attention plans, lazy allocations
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                sh.load()                    # (the inputs' copies from pinned memory, replayed with the graph)
                sh.ex.run([ctx])
            torch.cuda.synchronize(self.device)
        except Exception as e:   # eager from now on (every rank fails alike: same ops, same shapes)
            log.warning("prefill CUDA graph capture failed (%s: %s); prefill runs eagerly", type(e).__name__, e)
            self.capture = False
            return
        self._pool = self._pool or graph.pool()
        sh.graphs[cap] = graph
        self.captures += 1
        self.capture_s += time.perf_counter() - t0
        if not self._warming:
            # (the newest 32: a long-running server whose shapes churn past `keep` would grow it without end)
            name = f"{sh.pos.shape[0]}x{T}@{'packed' if cap == PACKED else cap}"
            self.late_captures = self.late_captures[-31:] + [name]
            log.info("prefill graph %s captured in a step (%.3f s)", name, time.perf_counter() - t0)

    def warm(self, max_batch: int, max_tokens: int) -> int:
        """Capture the short-prompt buckets now rather than in the first requests' path (~0.25 s each): sequences
        1, 2, 4 .. max_batch rounded up to a power of two (as prefill_groups rounds) x tokens 16, 32 .. max_tokens,
        key cap = tokens (a chunk that starts a sequence), and each shape's packed graph where it holds at most
        packed_rows rows. Every rank of a group calls it with the same arguments (same captures, same order).
        Returns the number of graphs captured."""
        if not self.capture:
            return 0
        shapes = [(B, T) for B in _pow2s(1, pow2(max_batch)) for T in _pow2s(16, min(max_tokens, self.max_seq_len))
                  if B * T <= self.capture_tokens]
        self.keep = max(self.keep, len(shapes) + 4)
        before = self.captures
        self._warming = True
        try:
            for B, T in shapes:
                sh = self._get(B, T)
                for cap in (T, PACKED) if B * T <= self.packed_rows else (T,):
                    if cap not in sh.graphs and self.capture:
                        self._capture(sh, T, cap)
                if not self.capture:   # a capture failed: eager from now on
                    break
        finally:
            self._warming = False
        return self.captures - before

    def run_many(self, chunks: list[tuple[list[int], int, list[int], object]], want_logits: bool = True):
        """chunks: (tokens, start_pos, block table, sampling or None). Returns (logits (n, V) fp32 on the CPU of
        each chunk's last token, or None when not wanted; the tokens drawn for them, list of n ints)."""
        logits: list[torch.Tensor | None] = [None] * len(chunks)
        drawn = [0] * len(chunks)
        tm, w0, c0 = self.timing, time.perf_counter(), time.thread_time()
        groups = step_groups(chunks, self.max_seq_len, self.width, self.packed_rows)
        ev = self._step_events()
        t = time.perf_counter()
        tm["build_s"] += t - w0
        for gi, g in enumerate(groups):
            sh = self._get(g.B, g.T)
            key = PACKED if g.packed is not None else g.kv_cap
            exact = g.packed is None and 0 < self.exact_keys <= g.kv_cap
            graphed = self.capture and g.B * g.T <= self.capture_tokens and not exact
            if graphed and key not in sh.graphs:
                self._capture(sh, g.T, key)   # (its seconds are capture_s, left out of the laps: wall_s has them)
                graphed = key in sh.graphs
                t = time.perf_counter()
            mem = sh.mem
            sh.write(g)   # (host only: the graph's replay, or load, copies the inputs in)
            self.packed_runs += g.packed is not None
            t = _lap(tm, "inputs_s", t)
            if ev is not None and gi == 0:
                ev[0].record()
            if graphed:
                sh.graphs[key].replay()
                self.replays += 1
            elif exact:
                rows = tuple((int(g.pad[j]), int(g.pos[j]), g.T - int(g.pad[j]) if g.pos[j] >= 0 else 0)
                             for j in range(g.B))
                sh.load()
                sh.ex.run([self._ctx(sh, g.T, g.kv_cap, rows)])
                self.exact_runs += 1
            else:
                sh.load()
                sh.ex.run([self._ctx(sh, g.T, key)])
            self.graph_runs += 1
            if ev is not None and gi == len(groups) - 1:
                ev[1].record()
            t = _lap(tm, "launch_s", t)
            last = [chunks[i][1] + len(chunks[i][0]) - 1 for i in g.idx]
            full = getattr(mem, "_full_rows", None) is not None   # (the same on every rank: the same chunks)
            glg = self._gathered(mem, len(g.idx)) if (full or want_logits) and self.tp > 1 else None
            if full:   # tp > 1: every rank draws the same tokens from the gathered shards
                draw_full(mem, glg if glg is not None else mem.t("logits")[:len(g.idx)], last)
            nxt = mem.t("next_tokens")[:len(g.idx)].tolist()
            t = _lap(tm, "wait_s", t)
            lg = None if not want_logits else (glg if glg is not None else mem.t("logits")[:len(g.idx)]).float().cpu()
            for j, i in enumerate(g.idx):
                drawn[i] = int(nxt[j])
                logits[i] = lg[j] if lg is not None else None
            t = _lap(tm, "read_s", t)
        if ev is not None:
            tm["device_s"] += ev[0].elapsed_time(ev[1]) / 1e3   # (both recorded and passed: the tokens were read)
        tm["cpu_s"] += time.thread_time() - c0
        tm["wall_s"] += time.perf_counter() - w0
        return (torch.stack(logits) if want_logits else None), drawn   # type: ignore[arg-type]

    def _step_events(self):
        """The two CUDA events run_many times the device with (reused), or None off the GPU."""
        if self._events is None and torch.device(self.device).type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        return self._events

    def _gathered(self, mem: RankMemory, n: int) -> torch.Tensor:
        """(n, V) fp32 on this device, tp > 1: the vocab shards of every rank, gathered through the communicator (a
        collective: every rank calls it for the same groups)."""
        return gather_vocab(self.cfg, self.tp, self.comm, mem.t("logits")[:n])

    def run(self, tokens: list[int], start_pos: int, table: list[int], sampling=None):
        """One chunk: (logits (V,) fp32 on the CPU of its last token, the token drawn for it)."""
        lg, drawn = self.run_many([(tokens, start_pos, table, sampling)])
        return lg[0], drawn[0]
