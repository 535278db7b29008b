"""Pack one rank's TaskGraph + RankMemory into the megakernel's device arrays: task records (codegen/layout.py),
wait / signal tables, per-SM task lists, the weight-prefetch table and the weight-stage words. Pure torch (CPU
tensors of device addresses): no CUDA, so the CPU tests check what the kernel will read.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field

import torch

from ..codegen import layout as L
from ..codegen import nvcc
from ..envflags import env_removed
from ..tasks.graph import TaskGraph
from ..tasks.tiling import attn_direct, attn_wide
from .memory import RankMemory

_NWARPS = L.CONSTANTS["THREADS"] // 32
_LL_NEED = ("this graph's all-reduce (allreduce_ll / MPK_AR_LL=1) writes LL words, whose readers",
            "drop -DMPK_AR_LL=0 from MPK_NVCC_DEFINES, or build the graph without allreduce_ll (unset MPK_AR_LL)")


def f32_bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", float(x)))[0] & 0xFFFFFFFF


@dataclass
class PeerTable:
    """World size > 1: the other ranks' event counters and symmetric buffers as this rank addresses them
    (nvshmem_ptr peer addresses over NVLink; entry `rank` is the local address). Index = rank."""

    rank: int
    world: int
    counters: list[int]                                   # base of rank r's counter array (int64 words)
    syms: dict[str, list[int]] = field(default_factory=dict)   # sym name -> base of rank r's (2, ...) buffer


class TaskPacker:
    """TaskGraph -> int64 arrays (tasks, waits, signals, SM lists) with device addresses from a RankMemory.

    World size > 1 needs a PeerTable: a push writes slot `rank` of every rank's buffer through the peer
    addresses, a signal to rank r's event e is `counters[r] + 8 e` tagged with SIGNAL_REMOTE_BIT, and a wait
    on an event with a producer on another rank acquires at system scope."""

    def __init__(self, tg: TaskGraph, mem: RankMemory, counters_ptr: int, head_dim: int,
                 peers: PeerTable | None = None, device: torch.device | str | None = None,
                 stage_smem: int | None = None, stage_ops: str | None = None, stage_cap: int | None = None):
        """Weight staging (layout.TASK_HEADER "stage"): stage_smem is the shared bytes per CTA below which staged
        rows must fit: STAGE_AUTO (-1) = the shared memory the graph needs anyway (its largest op layout), so the
        launch's shared / L1 split does not change (a 224 KB carveout measured 6% slower at batch 1 on its own:
        the L1 shrinks to ~28 KB); 0 = off; > 0 bytes. Default layout.stage_smem() ($MPK_STAGE_KB), off:
        measured neutral at batch 1 and 3.7% slower for qwen3-8b at context 4096 (docs/perf-notes.md v22).
        stage_ops: a regular expression on op names choosing the staged tasks; default ($MPK_STAGE_OPS unset or
        empty): the tasks that wait on attention (o_proj), whose SMs idle while attention runs on a few of them
        and HBM is quiet (staging tiles that wait on a weight-streaming phase measured slower: their copies
        compete with that phase).
        stage_cap: bytes of a task's weights staged at most, its ranges together (default layout.stage_cap(),
        $MPK_STAGE_CAP_KB; 0 = no cap)."""
        self.tg, self.mem, self.D = tg, mem, head_dim
        for name in ("MPK_RING_OPS", "MPK_RING_QUIET"):
            env_removed(name, "the per-warp weight page rings gained nothing at batch 1 in sessions 28-32 and were "
                        "removed in session 32; docs/perf-notes.md")
        env_removed("MPK_LIN_FILL", "batch-1 linear ops in one tile per SM measured llama-3.2-1b B=1 +1.5..+1.8% and "
                    "qwen3-8b -0.2% in session 37 and were removed; docs/perf-notes.md", allowed=("0",))
        ops = os.environ.get("MPK_STAGE_OPS", "") if stage_ops is None else stage_ops
        try:
            self.stage_ops = re.compile(ops) if ops else None
        except re.error as e:   # (a bare re.error named neither the variable nor what it wants)
            raise ValueError(f"{'MPK_STAGE_OPS' if stage_ops is None else 'stage_ops'}={ops!r}: not a regular "
                             f"expression ({e}); expected a regex on op names (e.g. '.' or 'o_proj'), or unset for "
                             "the default") from None
        self.stage_smem = L.stage_smem() if stage_smem is None else int(stage_smem)
        self.stage_cap = L.stage_cap() if stage_cap is None else int(stage_cap)
        if self.stage_cap < 0:
            raise ValueError(f"stage_cap={self.stage_cap}: bytes of a task's staged weights, 0 = no cap")
        if not (self.stage_smem == L.STAGE_AUTO or 0 <= self.stage_smem <= 227 * 1024):
            raise ValueError(f"stage_smem={self.stage_smem}: {L.STAGE_AUTO} (auto), 0 (off) .. 227 KiB of shared "
                             "memory per CTA")
        self.counters_ptr = counters_ptr
        self.peers = peers
        self.device = device
        if tg.world_size > 1 and peers is None:
            raise ValueError(f"rank {tg.rank} of a world of {tg.world_size}: cross-rank pushes and signals need a "
                             "PeerTable (peer counter / symmetric buffer addresses; runtime.nvshmem.peer_table)")
        if peers is not None and (peers.rank != tg.rank or peers.world != tg.world_size
                                  or len(peers.counters) != tg.world_size):
            raise ValueError(f"PeerTable for rank {peers.rank}/{peers.world} ({len(peers.counters)} counter bases) "
                             f"does not match TaskGraph rank {tg.rank}/{tg.world_size}")
        self._peer_arrays: dict[str, torch.Tensor] = {}   # keep alive
        self.smem = 0
        self._task_need = 0     # the shared bytes of the task being packed (its op's layout)
        self.largest = (0, "", "")   # (shared bytes, op, kind) of the task that needs the most (error messages)
        self.task_smem: dict[int, int] = {}   # task -> its op layout's shared bytes (planner/feasible.py mirrors them)
        # build defines the packed tasks need ({name: (what needs it, how to get it)}): Megakernel builds with them
        # (nvcc.build(needs=...)) and checks the build it launches (nvcc.check_defines)
        self.needs: dict[str, tuple[str, str]] = {}
        self.staged_bytes = 0   # weight bytes staged per step, all tasks (diagnostics)
        self.stage_info: dict[int, tuple[int, int, int, int]] = {}   # task -> (op's shared bytes, offset, rows, bytes)
        self.prefetch: torch.Tensor | None = None   # (n, PF_WORDS) int64 weight ranges, filled by pack()

    def _t(self, name):
        return self.mem.t(name).data_ptr() if name else 0

    def _sym(self, name):
        s = self.mem.syms[name]
        return s.data_ptr(), s[0].numel() * s.element_size()

    def _peers(self, name):
        if name not in self._peer_arrays:
            if self.peers is not None:
                if name not in self.peers.syms:
                    raise KeyError(f"PeerTable has no peer addresses for symmetric buffer {name!r}")
                ptrs = list(self.peers.syms[name])
            else:
                ptrs = [p.syms[name].data_ptr() for p in self.mem.peers]
            dev = self.device if self.device is not None else self.mem.syms[name].device
            self._peer_arrays[name] = torch.tensor(ptrs, dtype=torch.int64, device=dev)
        return self._peer_arrays[name].data_ptr(), self._peer_arrays[name].numel()

    def pack(self):
        tg = self.tg
        n = len(tg.tasks)
        tasks = torch.zeros((n, L.TASK_WORDS), dtype=torch.int64)
        waits, signals = [], []
        self.prefetch = torch.zeros((max(n, 1), L.PF_WORDS), dtype=torch.int64)
        cands = []
        # folded attention merges: one int64 ticket per (op, sequence, KV group), zeroed once, never reset
        groups = sorted({(t.op, t.params["b"], t.params["g"]) for t in tg.tasks
                         if t.kind == "attn_partial" and t.params.get("fold")})
        self._ticket_of = {k: i for i, k in enumerate(groups)}
        self.tickets = torch.zeros(max(len(groups), 1), dtype=torch.int64,
                                   device=self.device if self.device is not None else "cpu")
        nxt = {}   # task -> the task after it on its SM (the last wraps to the first: the next step's)
        for lst in tg.sm_lists:
            for j, tid in enumerate(lst):
                nxt[tid] = lst[(j + 1) % len(lst)]
        for t in tg.tasks:
            row = tasks[t.id]
            row[L.TASK_HEADER.index("opcode")] = L_OPCODE[t.kind]
            row[L.TASK_HEADER.index("task_id")] = t.id
            row[L.TASK_HEADER.index("next_task")] = nxt.get(t.id, t.id)
            row[L.TASK_HEADER.index("wait_begin")] = len(waits)
            for j, (e, lag) in enumerate(t.waits):
                remote = any(r != tg.rank for r, _ in tg.events[e].producers)
                waits.append([e, tg.events[e].triggers, lag, int(remote)])
                if j < L.INLINE_WAITS:
                    row[L.T_INLINE_WAIT + j] = L.pack_wait(*waits[-1])
            row[L.TASK_HEADER.index("wait_end")] = len(waits)
            row[L.TASK_HEADER.index("sig_begin")] = len(signals)
            for j, (r, e) in enumerate(t.signals):
                if r != tg.rank:
                    signals.append((self.peers.counters[r] + 8 * e) | L.SIGNAL_REMOTE_BIT)
                else:
                    signals.append(self.counters_ptr + 8 * e)
                if j < L.INLINE_SIGNALS:
                    row[L.T_INLINE_SIG + j] = signals[-1]
            row[L.TASK_HEADER.index("sig_end")] = len(signals)
            self._task_need = 0
            self._task = t
            args = getattr(self, "_pack_" + t.kind)(t.params)
            for k, v in args.items():
                row[L.arg_index(t.kind, k)] = int(v)
            ranges = self._weight_ranges(t.kind, args)
            for j, (a, nb) in enumerate(ranges[:2]):
                self.prefetch[t.id, 2 * j], self.prefetch[t.id, 2 * j + 1] = int(a), int(nb)
            cands.append((t, args, ranges, self._task_need))
            self.task_smem[t.id] = self._task_need
            if self._task_need > self.largest[0]:
                self.largest = (self._task_need, t.op, t.kind)
        # second pass: the staging budget may depend on every task's layout (STAGE_AUTO)
        budget = self.smem if self.stage_smem == L.STAGE_AUTO else self.stage_smem
        for t, args, ranges, need in cands:
            tasks[t.id, L.TASK_HEADER.index("stage")] = self._stage_word(t, args, ranges, need, budget)
        offs = [0]
        flat: list[int] = []
        for lst in tg.sm_lists:
            flat += lst
            offs.append(len(flat))
        return (tasks, torch.tensor(waits or [[0] * len(L.WAIT_FIELDS)], dtype=torch.int64),
                torch.tensor(signals or [0], dtype=torch.int64), torch.tensor(offs, dtype=torch.int32),
                torch.tensor(flat or [0], dtype=torch.int32))

    @staticmethod
    def _weight_ranges(kind: str, a: dict) -> list[tuple[int, int]]:
        """The contiguous weight byte ranges a task streams (prefetched into L2 before its events are met)."""
        if kind == "linear":
            n0, n1, K = a["n0"], a["n1"], a["k"]
            return [(w + n0 * K * 2, (n1 - n0) * K * 2) for w in (a["w0"], a["w1"]) if w]
        if kind == "qkv_rope":   # rows [r0, r0+nr) and [D/2 + r0, D/2 + r0 + nr) of the head at a["w"]
            K, r0, nr = a["k"], a["r0"], a["nr"]
            return [(a["w"] + r0 * K * 2, nr * K * 2), (a["w"] + (a["d"] // 2 + r0) * K * 2, nr * K * 2)]
        return []

    def _need(self, nbytes: int):
        self.smem = max(self.smem, int(nbytes))
        self._task_need = max(self._task_need, int(nbytes))

    def _waits_on_attention(self, t) -> bool:
        return any(self.tg.tasks[tid].kind in ("attn_merge", "attn_partial")
                   for e, _lag in t.waits for _r, tid in self.tg.events[e].producers if _r == self.tg.rank)

    def _stage_word(self, t, a: dict, ranges: list, need: int, budget: int) -> int:
        """The task's stage word (layout.pack_stage): CUDA-core tiles (linear without Tensor Core rows, qkv_rope
        below TC_MIN_M) chosen by stage_ops get the first rows of each weight range copied into the shared memory
        above their op's own layout (`need` bytes), as many as fit below `budget` (even, so two-column warp passes
        are whole; or all rows). The kernel then reads those rows from shared memory (bitwise the same sums).
        0 = nothing staged."""
        kind = t.kind
        if budget <= 0 or not ranges:
            return 0
        if not ((kind == "linear" and a["tc_rows"] == 0) or (kind == "qkv_rope" and a["m"] < L.CONSTANTS["TC_MIN_M"])):
            return 0
        if not (self.stage_ops.search(t.op) if self.stage_ops is not None else self._waits_on_attention(t)):
            return 0
        row_bytes = a["k"] * 2
        rows = ranges[0][1] // row_bytes
        off = (need + 127) & ~127
        fit = max(0, budget - off) // (len(ranges) * row_bytes)
        if self.stage_cap > 0:
            fit = min(fit, self.stage_cap // (len(ranges) * row_bytes))
        n = rows if fit >= rows else fit & ~1
        if n <= 0:
            return 0
        nbytes = n * len(ranges) * row_bytes
        self.smem = max(self.smem, off + nbytes)
        self.staged_bytes += nbytes
        self.stage_info[t.id] = (need, off, n, nbytes)
        return L.pack_stage(n, off)

    # --- per task kind: argument words (names from codegen.layout.OP_ARGS) -------------------------------------
    def _pack_embed(self, p):
        M, H = self.mem.t(p["out"]).shape
        assert H % 8 == 0, f"hidden size {H} is not a multiple of 8 (megakernel_shape_problems)"
        return dict(tokens=self._t(p["tokens"]), table=self._t(p["table"]), out=self._t(p["out"]), m=M, h=H,
                    rows=self.mem.t(p["table"]).shape[0])

    def _pack_qkv_rope(self, p):
        x = self.mem.t(p["x"])
        M, K = x.shape
        D, h = self.D, p["head"]
        assert K % 8 == 0 and D <= L.CONSTANTS["MAX_HEAD_DIM"], f"K={K} / head_dim={D} (megakernel_shape_problems)"
        w = self.mem.t(p["weight"])
        which = p["which"]
        cache = self.mem.kv(p[f"{which}_cache"]) if which != "q" else None
        q = self.mem.t(p["q"])
        r0 = p.get("r0", 0)
        nr = p.get("r1", D // 2) - r0
        assert D % 2 == 0 and 0 <= r0 and nr > 0 and r0 + nr <= D // 2
        assert p["head_norm"] is None or nr == D // 2, "a per-head q/k norm needs the whole head in one task"
        self._need(L.qkv_rope_smem(M, K))
        _check_kslices(p.get("k_slices", 0), nr)
        dst, head = q, h
        if p.get("raw") is not None:   # a normed head's part: projection rows to its column block of qk_raw
            dst, head, which, cache = self.mem.t(p["raw"]), p["raw_slot"], "raw", None
        bias = self.mem.t(p["bias"]) if p.get("bias") is not None else None   # (Qwen2) this head's D values
        if bias is not None:
            self.needs["MPK_QKV_BIAS"] = ("qkv_rope tasks of a model with q / k / v biases (Qwen2)",
                                          "drop -DMPK_QKV_BIAS=0 from MPK_NVCC_DEFINES")
        return dict(x=x.data_ptr(), norm=self._t(p["norm"]), w=w.data_ptr() + h * D * K * w.element_size(),
                    bias=0 if bias is None else bias.data_ptr() + h * D * bias.element_size(),
                    head_norm=self._t(p["head_norm"]), q=dst.data_ptr(), ldq=dst.shape[1],
                    cache=cache.data_ptr() if cache is not None else 0, which=L.WHICH.index(which), head=head, m=M,
                    k=K, d=D, eps=f32_bits(p["eps"]), n_kv=(cache.shape[2] if cache is not None else 0), r0=r0, nr=nr,
                    kslices=p.get("k_slices", 0))

    def _pack_qk_norm_rope(self, p):
        raw, q, kc = self.mem.t(p["raw"]), self.mem.t(p["q"]), self.mem.kv(p["k_cache"])
        D = self.D
        assert D % 2 == 0 and D <= L.CONSTANTS["MAX_HEAD_DIM"], f"head_dim={D} (megakernel_shape_problems)"
        return dict(raw=raw.data_ptr(), ldraw=raw.shape[1], q_norm=self._t(p["q_norm"]), k_norm=self._t(p["k_norm"]),
                    q=q.data_ptr(), ldq=q.shape[1], cache=kc.data_ptr(), m=raw.shape[0], d=D, eps=f32_bits(p["eps"]),
                    n_kv=kc.shape[2], nq=q.shape[1] // D, qh0=p["q_head0"], nqh=p["n_qh"], kh0=p["k_head0"],
                    nkh=p["n_kh"])

    def _attn_common(self, p):
        part = self.mem.t(p["part"])
        assert p["gs"] <= L.CONSTANTS["MAX_GS"], f"{p['gs']} q heads a KV group (megakernel_shape_problems)"
        return dict(b=p["b"], g=p["g"], gs=p["gs"], d=self.D, nq=part.shape[1], splits=p["splits"])

    def _pack_attn_partial(self, p):
        kc = self.mem.kv(p["k_cache"])
        d_max = L.CONSTANTS["MAX_HEAD_DIM"]
        if self.D % 8 or self.D > d_max:
            raise ValueError(f"the megakernel's attention copies K/V rows in 16-byte pieces: head_dim must be a multiple "
                             f"of 8 and <= {d_max} (got {self.D}); use backend='torch' for this model")
        ng = p.get("ng", 1)
        direct = int(bool(p.get("fold")) and p["splits"] == 1 and attn_direct())
        if ng > 1 and not direct:
            raise ValueError(f"an attention task of {ng} KV groups (Tiling.attn_groups / MPK_ATT_GROUPS) writes its "
                             f"outputs directly: it needs one split, the folded merge and MPK_ATT_DIRECT on")
        if ng * p["gs"] > L.CONSTANTS["ATT_MAX_QH"]:
            raise ValueError(f"an attention task holds at most {L.CONSTANTS['ATT_MAX_QH']} q heads: {ng} groups of "
                             f"{p['gs']} do not fit (Tiling.attn_g keeps to it; fewer MPK_ATT_GROUPS)")
        stages = nvcc.define_int("MPK_ATT_STAGES", 2)   # the build's K/V buffers (attention.cuh)
        wide = attn_wide(self.D, ng)   # 16-key tiles per warp and pass
        need = L.att_smem_bytes(self.D, ng=ng, stages=stages, wide=wide)   # attention.cuh's layout
        if need > L.ATT_SMEM_MAX:
            raise ValueError(f"attention with head_dim {self.D}, {ng} KV group(s) per task and "
                             f"MPK_ATT_STAGES={stages} needs {need} B of shared memory "
                             f"(> {L.ATT_SMEM_MAX} B: 227 KiB less the kernel's static shared memory): fewer stages "
                             f"(MPK_NVCC_DEFINES) or groups (MPK_ATT_GROUPS)")
        self._need(need)
        return dict(self._attn_common(p), q=self._t(p.get("raw") or p["q"]), k_cache=kc.data_ptr(),
                    v_cache=self.mem.kv(p["v_cache"]).data_ptr(), part=self._t(p["part"]), lse=self._t(p["lse"]),
                    split=p["split"], n_kv=kc.shape[2], scale=f32_bits(p["scale"]),
                    out=self._t(p["out"]) if p.get("fold") else 0,
                    ticket=(self.tickets.data_ptr() + 8 * self._ticket_of[(self._task.op, p["b"], p["g"])]
                            if p.get("fold") else 0),
                    direct=direct, ng=ng, wide=wide, **self._kv_new(p), **self._qk_norm(p, kc))

    def _qk_norm(self, p, kc):
        """Tiling.attn_qk_norm (q is then qk_raw: its q heads, then its k heads, contiguous rows): the head norms and
        eps; or nothing (q_norm = 0: q is read as written)."""
        if not p.get("raw"):
            return {}
        self.needs["MPK_ATT_QKNORM"] = (
            "attention tasks that norm their q / k heads (Tiling.attn_qk_norm, the default)",
            "drop -DMPK_ATT_QKNORM=0 from MPK_NVCC_DEFINES, or build the task graph without it (MPK_ATTN_QKNORM=0)")
        raw, nq = self.mem.t(p["raw"]), self.mem.t(p["part"]).shape[1]
        if p.get("kv_defer") or raw.shape[1] != (nq + kc.shape[2]) * self.D or raw.stride() != (raw.shape[1], 1):
            raise ValueError(f"{p['raw']}: attention's q / k norm reads contiguous rows of the rank's q then k heads "
                             f"((M, {(nq + kc.shape[2]) * self.D}), got {tuple(raw.shape)} strides {raw.stride()}), "
                             "and no deferred append")
        return dict(q_norm=self._t(p["q_norm"]), k_norm=self._t(p["k_norm"]), eps=f32_bits(p["eps"]))

    def _kv_new(self, p):
        """The deferred append's rows (ir/defer.py): kv_new's address and row stride, or 0 (appended by qkv_rope)."""
        if not p.get("kv_defer"):
            return dict(kv_new=0, ldkv=0)
        t = self.mem.t(p["kv_new"])
        if t.data_ptr() % 16 or t.stride(0) % 8 or not t.stride(1) == 1:
            raise ValueError(f"{p['kv_new']}: the deferred append copies 16-byte pieces: rows must be 16-byte "
                             f"aligned and contiguous (got address {t.data_ptr():#x}, strides {t.stride()})")
        return dict(kv_new=t.data_ptr(), ldkv=t.stride(0))

    def _pack_attn_merge(self, p):
        return dict(self._attn_common(p), part=self._t(p["part"]), lse=self._t(p["lse"]), out=self._t(p["out"]))

    def _pack_linear(self, p):
        x = self.mem.t(p["x"])
        M_in, K = x.shape
        assert K % 8 == 0
        r0 = p.get("weight_row0", 0)
        ws = [self.mem.t(w) for w in p["weights"]]
        wp = [w.data_ptr() + r0 * K * w.element_size() for w in ws]
        rs = p["row_select"]
        d = dict(x=x.data_ptr(), w0=wp[0], w1=wp[1] if len(wp) > 1 else 0, norm=self._t(p["norm"]),
                 residual=self._t(p["residual"]), m_in=M_in, k=K, n0=p["n0"], n1=p["n1"],
                 eps=f32_bits(p["eps"] or 0.0), epilogue=L.EPILOGUES.index(p["epilogue"]),
                 row_off=rs["offset"] if rs else 0, row_stride=rs["stride"] if rs else 1, slot=self.tg.rank,
                 kseg=p.get("k_segments", 1), kslices=p.get("k_slices", 0))
        assert (K // 8) % d["kseg"] == 0, f"K={K} does not split into {d['kseg']} segments of 16-byte vectors"
        if p["push"]:
            base, stride = self._sym(p["out"])
            peers, npeers = self._peers(p["out"])
            shape = self.mem.syms[p["out"]].shape  # (2, W, M, N)
            if p.get("ll"):
                self.needs["MPK_AR_LL"] = _LL_NEED
            d.update(out=base, out_kind=L.OUT_KINDS.index("push_ll" if p.get("ll") else "push"), peers=peers,
                     npeers=npeers, par_stride=stride, m=shape[-2], n=shape[-1])
        else:
            out = self.mem.t(p["out"])
            d.update(out=out.data_ptr(), m=out.shape[0], n=out.shape[1],
                     out_kind=L.OUT_KINDS.index("f32" if out.dtype == torch.float32 else "bf16"))
        rows, need, chunks = L.linear_tile(d["m"], K, p["n1"] - p["n0"], len(wp), d["kseg"], bool(p["norm"]))
        d["tc_rows"] = L.pack_tc_rows(rows, chunks)
        _check_kslices(d["kslices"], p["n1"] - p["n0"])
        self._need(need)
        return d

    def _pack_allreduce(self, p):
        base, stride = self._sym(p["part"])
        W, M, N = self.mem.syms[p["part"]].shape[1:]
        if p.get("ll"):
            self.needs["MPK_AR_LL"] = _LL_NEED
        return dict(part=base, par_stride=stride, residual=self._t(p["residual"]), out=self._t(p["out"]), world=W,
                    m=M, n=N, n0=p["n0"], n1=p["n1"], ll=int(bool(p.get("ll"))))

    def _pack_weight_prefetch(self, p):
        """(address, bytes) of each (weight, first row, rows, K) range; bytes whole rows (K % 8 == 0: 16-byte
        multiples, as the bulk prefetch needs)."""
        from ..tasks.ops.prefetch import PREFETCH_RANGES
        rs = p["ranges"]
        assert len(rs) <= PREFETCH_RANGES, f"{len(rs)} prefetch ranges > {PREFETCH_RANGES}"
        d = {"n": len(rs)}
        for i, (name, r0, rows, K) in enumerate(rs):
            w = self.mem.t(name)
            assert K % 8 == 0 and w.shape[-1] == K, (name, tuple(w.shape), K)
            d[f"p{i}"] = w.data_ptr() + r0 * K * w.element_size()
            d[f"b{i}"] = rows * K * w.element_size()
            assert d[f"p{i}"] % 16 == 0, f"weight {name} row {r0} is not 16-byte aligned"
        return d

    def _pack_argmax_partial(self, p):
        lg = self.mem.t(p["logits"])
        base, stride = self._sym(p["part"])
        peers, npeers = self._peers(p["part"])
        C = L.CONSTANTS["SAMPLE_C"]
        assert self.mem.syms[p["part"]].shape[-2] == C, "argmax.part candidates != layout SAMPLE_C"
        n, vs = p.get("nslices", 1), p.get("slice_len", lg.shape[1])
        # argmax.cuh / sample_select.cuh: sv, si | hist | scan | misc | cv, ci, then for a sampled slice staged in shared memory the
        # candidates (key, index) [SAMPLE_CAP + 4], 16-byte aligned, and the keys (stage_slot: one pad word per 32)
        staged = (3 + 2 * (L.CONSTANTS["SAMPLE_CAP"] + 4) + vs + (vs >> 5) + 1
                  if p.get("temperature") and vs <= L.CONSTANTS["SAMPLE_STAGE"] else 0)
        self._need((2 * _NWARPS + 256 + 2 * (_NWARPS + 1) + 8 + 2 * C + staged) * 4)
        v0 = p.get("s0", 0) * vs
        b0, nb = p.get("b0", 0), p.get("nb", lg.shape[0])
        return dict(logits=lg.data_ptr() + v0 * lg.element_size(), b=lg.shape[0], v=vs, ld=lg.shape[1], nslices=n,
                    vocab0=p["vocab0"] + v0, peers=peers, npeers=npeers, par_stride=stride,
                    slot=p.get("slot0", self.tg.rank), temp=self._t(p.get("temperature")), b0=b0, nb=nb)

    def _pack_argmax_reduce(self, p):
        base, stride = self._sym(p["part"])
        out = self.mem.t(p["out"])
        C = L.CONSTANTS["SAMPLE_C"]
        slots = p.get("slots", p["world"])   # the kernel's "world": candidate slots to merge (W * S)
        # argmax.cuh reduce smem: pv, pi | mv, mi | es | cs | heads | scan | 16-byte aligned ck, cx, ce [4 C + 4]
        self._need((2 * slots * C + 4 * C + 8 + slots + 2 * (_NWARPS + 1) + 3 + 3 * (4 * C + 4)) * 4)
        return dict(part=base, par_stride=stride, out=out.data_ptr(),
                    tokens=self._t("tokens") if p["feeds_next_step"] else 0, world=slots, b=out.shape[0],
                    temp=self._t(p.get("temperature")), top_k=self._t(p.get("top_k")),
                    top_p=self._t(p.get("top_p")), seed=self._t(p.get("seed")), b0=p.get("b0", 0),
                    nb=p.get("nb", out.shape[0]))


def _check_kslices(k: int, w: int) -> None:
    """linear.cuh linear_tc_t takes k_slices 0 (auto from the tile width) or 1 (one chain over K)."""
    if k not in (0, 1):
        raise ValueError(f"k_slices={k} for a {w}-column tile: the kernel takes 0 (auto) or 1 (one k-slice)")


from ..tasks.ops import OPCODES  # noqa: E402

def megakernel_shape_problems(cfg, tp: int = 1) -> list[str]:
    """What of a model's shape the megakernel's device code cannot run at `tp` (its 16-byte vector loads, its
    attention's head and group sizes), as sentences naming the limit; [] when it can. Checked before any graph is
    packed, so a model past a limit is refused with the reason instead of an assertion deep in the packer. A rank's
    down projection reduces over intermediate_size / tp, which must be whole 16-byte rows too (intermediate_size
    1000 runs at tp=1 but not at tp=2: 500 per rank)."""
    C = L.CONSTANTS
    out = []
    if cfg.head_dim % 8 or cfg.head_dim > C["MAX_HEAD_DIM"]:
        out.append(f"head_dim must be a multiple of 8 and <= {C['MAX_HEAD_DIM']} (got {cfg.head_dim})")
    gs = cfg.num_heads // max(1, cfg.num_kv_heads)
    if gs > C["MAX_GS"]:
        out.append(f"at most {C['MAX_GS']} q heads a KV head (got {cfg.num_heads} / {cfg.num_kv_heads} = {gs})")
    for name in ("hidden_size", "intermediate_size"):
        if getattr(cfg, name) % 8:
            out.append(f"{name} must be a multiple of 8 (16-byte rows; got {getattr(cfg, name)})")
    inter = cfg.intermediate_size
    if tp > 1 and inter % 8 == 0 and inter % tp == 0 and (inter // tp) % 8:
        from ..ir.shard import valid_tps
        ok = [t for t in valid_tps(cfg) if (inter // t) % 8 == 0 and t <= 8]
        out.append(f"intermediate_size / tp must be a multiple of 8 (each rank's down projection reduces over 16-byte "
                   f"rows; got {inter} / {tp} = {inter // tp}; tp this model's megakernel splits into: "
                   f"{', '.join(map(str, ok))})")
    return out


L_OPCODE = {k: i for i, k in enumerate(OPCODES)}
SMEM_BUDGET = L.SMEM_BUDGET   # a linear tile's shared memory budget (defined in codegen/layout.py)
