"""Tile sizes: how finely each op is cut into tasks. Part of a plan; `Tiling.auto` is the default heuristic.

More tiles mean more parallelism and finer overlap but more per-task fixed cost and more event traffic;
the auto rule aims for about `waves` tiles per SM on every weight-streaming op, in multiples of 16 columns
(a Tensor Core tile edge).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field

from ..envflags import env_flag, env_int


# Tiling fields whose default comes from the environment (A/B switches): set, the variable overrides a plan's
# recorded value too (plan books are cached on disk; runtime/plan_exec.py _tiling)
ENV_FIELDS = {"attn_fold_merge": "MPK_ATTN_FOLD", "attn_groups": "MPK_ATT_GROUPS"}
# Tiling.attn_groups = 0 (auto): an attention task's fixed chain and a group's finish, in passes of its keys
# (session 21's stamps at llama B=128 ctx 4096: q and the page table at 1.7 us, the first pass landed at 4.6 us,
# ~2-3 us a pass; the task's control path ~2 us; the cross-warp merge and output of a group ~1 us)
ATTN_TASK_FIXED_PASSES = 3.0
ATTN_GROUP_FINISH_PASSES = 0.5


def attn_groups_max() -> int:
    """$MPK_ATT_GROUPS_MAX: the most KV groups the auto rule puts in one attention task. Default 8 (every KV head of
    a sequence may share a task; session 23 measured it against the old cap of 2 on 1x H200: llama B=128 -8.0% at
    ctx 512, -3.3% at ctx 4096, B=32 within noise; docs/perf-notes.md). 2 or 1 restores the narrower tasks."""
    return env_int("MPK_ATT_GROUPS_MAX", 8, 1, 8)


def attn_groups_cost(units: int, ng: int, passes: int, num_sms: int) -> float:
    """The attention's makespan in passes with ng groups per task: waves of tasks over the SMs x one task's fixed
    chain plus its groups' passes and finishes (`units` = sequences x KV heads; `passes` per group)."""
    waves = -(-(units // ng) // num_sms)
    return waves * (ATTN_TASK_FIXED_PASSES + ng * (passes + ATTN_GROUP_FINISH_PASSES))


def attn_direct() -> bool:
    """MPK_ATT_DIRECT (default on since session 16; =0 for the merge path): a folded attention group of one split
    (every batch from ~17 sequences: attn_splits_for) writes its output straight from the chunk: the same bf16 values
    as the merge of one chunk (weight exp(0) = 1, sum 1), without the part / lse stores, the ticket atomic and the
    merge's two dependent reloads (~2-3 us per task, ~8 tasks per SM per layer at llama B=128). Measured (1x H200,
    48105cf, ctx 512, attn-mk plan): llama-3.2-1b B=32 2.602 -> 2.497 ms, B=128 4.232 -> 3.909; qwen3-8b B=32
    9.997 -> 9.702, B=128 14.603 -> 13.551 (bench/results/s16/run2_direct_stamps_48105cf)."""
    return env_flag("MPK_ATT_DIRECT", default=True)


def _att_smem_fits(head_dim: int, ng: int, wide: int = 1) -> bool:
    """An attention task of ng groups (wide x 16 keys per warp and pass) fits the SM's shared memory with the
    build's K/V stages (MPK_ATT_STAGES)."""
    from ..codegen import layout, nvcc   # (codegen reads the tasks' opcodes at import)
    return layout.att_smem_bytes(head_dim, ng=ng, stages=nvcc.define_int("MPK_ATT_STAGES", 2), wide=wide) <= layout.ATT_SMEM_MAX


def attn_wide(head_dim: int, ng: int = 1) -> int:
    """The pass width of an attention task (device_kernels/ops/attention.cuh `wide`): 2 (two 16-key tiles per warp
    and pass, K and V in the build's stages) where the head dim is <= 64 and that fits the shared memory, else 1.
    The narrow passes were bound by their per-pass chain, not by HBM (docs/perf-notes.md session 19).
    $MPK_ATT_WIDE: unset or 1 = the rule above; 0 = narrow passes everywhere (the A/B). The CTA-barrier build
    (-DMPK_ATT_WARP_PIPE=0) has narrow passes only."""
    import os   # (the planner's simulator asks per attention task: the answer is cached per switch setting)
    return _attn_wide(head_dim, ng, os.environ.get("MPK_ATT_WIDE", "").strip(), os.environ.get("MPK_NVCC_DEFINES", ""))


@functools.lru_cache(maxsize=256)
def _attn_wide(head_dim: int, ng: int, mode: str, _defines: str) -> int:
    from ..codegen import nvcc
    if mode not in ("", "0", "1"):
        gone = " (ring: removed, slower than the narrow passes on qwen3-8b)" if mode == "ring" else ""
        raise ValueError(f"MPK_ATT_WIDE={mode!r}: expected unset or 1 (wide passes where they fit, the default) "
                         f"or 0 (narrow passes everywhere){gone}")
    if mode == "0" or nvcc.define_int("MPK_ATT_WARP_PIPE", 1) == 0:
        return 1
    return 2 if head_dim <= 64 and _att_smem_fits(head_dim, ng, wide=2) else 1


@dataclass(frozen=True)
class Tiling:
    num_sms: int = 132
    linear_cols: int = 0       # output columns per linear tile; 0 = auto
    allreduce_cols: int = 0    # columns per reduce tile; 0 = auto
    waves: float = 1.0         # auto: target tiles per SM for each linear op
    min_cols: int = 16
    qkv_parts: int = 0         # tasks per qkv_rope head (RoPE-pair slices); 0 = auto
    # qkv_rope of per-head-normed models (Qwen3) with CUDA-core rows (batch < TC_MIN_M): the q and k rows as flat
    # linear tiles into qk_raw (no head alignment: ~one tile per SM instead of 2 head parts; the qk_norm_rope tasks,
    # or attention with attn_qk_norm, finish the heads) and v heads in pair parts. On by default since session 32
    # (qwen3-8b B=1 ctx 512 -1.4%, bench/results/s32/run2_qkvflat); $MPK_QKV_FLAT=0 keeps the head parts (docs/perf-notes.md sessions 31-32:
    # a batch-1 task streams ~35 GB/s, so 96 qkv tasks on 132 SMs stream at ~3.4 TB/s)
    qkv_flat: bool = field(default_factory=lambda: env_flag("MPK_QKV_FLAT", default=True))
    argmax_tasks: int = 0      # argmax_partial tasks per rank and row group (each a run of vocabulary slices);
    #                            0 = one per slice
    argmax_rows: int = 0       # rows per argmax_partial task; 0 = auto (row groups x slice tasks ~ the SMs)
    l2_prefetch_mb: float = 0.0   # per layer: weight bytes of o_proj / gate_up pulled into L2 during attention by
    #                               weight_prefetch tasks (tasks/ops/prefetch.py); 0 = none (not yet GPU-measured)
    # attention: the last attn_partial of each (sequence, KV group) to finish merges the group (a ticket counter
    # decides which), instead of a separate attn_merge task: one dependent phase fewer per layer. On unless
    # $MPK_ATTN_FOLD=0 (measured session 12: B=1 -0.6% both models, B=8 within noise; docs/perf-notes.md v23).
    attn_fold_merge: bool = field(default_factory=lambda: env_flag("MPK_ATTN_FOLD", default=True))
    # attention of per-head-normed models (Qwen3) whose qkv_rope writes qk_raw (head parts or flat tiles) in the same
    # task graph: each attn_partial normalises and rotates its own q heads from qk_raw into shared memory, and the
    # chunk holding the new position its k head into the cache, so the qk_norm_rope tasks (a dependent phase of
    # ~3.6 us a layer on qwen3-8b at batch 1, session 32's traces) are gone. Such a graph's packer needs a
    # -DMPK_ATT_QKNORM=1 build, and Megakernel builds it with that (llama's graphs need none: their build leaves the
    # path out, -0.9% at llama-3.2-1b B=1, session 34). On by default since session 33 (qwen3-8b ctx 512: B=1 -0.5%,
    # B=8 one megakernel -3.2%, bench/results/s33/run2_ab_qknorm); $MPK_ATTN_QKNORM=0 keeps the qk_norm_rope tasks
    # (docs/perf-notes.md s32-33)
    attn_qk_norm: bool = field(default_factory=lambda: env_flag("MPK_ATTN_QKNORM", default=True))
    # attention: KV groups of one sequence per attn_partial task where the keys are not split (one split, folded,
    # direct write): the task fetches the page table and q once and runs the groups' passes as one pipeline.
    # 0 = auto (attn_g): 2 where the direct write is on, two groups' q heads and shared memory fit and there are
    # enough groups per SM, else 1 (default since session 17, measured with the warp pipe: llama-3.2-1b B=128 ctx
    # 512 -3.3%, qwen3-8b -2.4%; docs/perf-notes.md);
    # $MPK_ATT_GROUPS=n asks for n (an error where the direct write is off)
    attn_groups: int = field(default_factory=lambda: env_int("MPK_ATT_GROUPS", 0, 0, 8))

    def linear_n(self, graph, op, N: int) -> int:
        if self.linear_cols:
            return self.linear_cols
        target = max(1, int(self.num_sms * self.waves))
        n = max(self.min_cols, -(-N // target))
        return -(-n // 16) * 16 if N >= 16 else N

    def linear_tiles(self, graph, op, N: int) -> list[tuple[int, int]]:
        """The column ranges [n0, n1) of a linear op's tiles (`linear_n` wide; the last may be narrower)."""
        from .ops.common import split_range
        return split_range(N, self.linear_n(graph, op, N))

    def qkv_p(self, graph, op, heads: int, pairs: int) -> int:
        """Parts per qkv_rope head (each owns a slice of the D/2 RoPE pairs, >= 4 pairs): auto fills the SMs
        with one wave of head parts, so the layer's qkv weights stream on ~all SMs instead of one per head."""
        p = self.qkv_parts or max(1, self.num_sms // max(1, heads))
        return max(1, min(p, pairs // 4 if pairs >= 4 else 1))

    def qkv_flat_geometry(self, qk_rows: int, v_heads: int, pairs: int, split_at: int) -> tuple[int, int]:
        """(rows per q/k tile, parts per v head) of a flat qkv_rope: the pair that minimises the largest task's rows
        (tiles do not cross `split_at`, the q / k boundary; a v part owns >= 4 RoPE pairs) within one task per SM,
        smaller tiles first on ties."""
        best = self.qkv_flat_fit(qk_rows, v_heads, pairs, split_at)
        if best is None:
            raise ValueError(f"a flat qkv_rope needs more than {self.num_sms} SMs for {v_heads} v heads")
        return best

    def qkv_flat_fit(self, qk_rows: int, v_heads: int, pairs: int, split_at: int) -> tuple[int, int] | None:
        """qkv_flat_geometry, or None where no geometry fits the SMs (fewer than two SMs left beside one part per v
        head): the op then takes head parts (qkv_rope.decompose)."""
        best = None
        for pv in range(1, max(1, pairs // 4) + 1):
            left = self.num_sms - v_heads * pv
            if left < 2:
                break
            r = -(-qk_rows // left)
            r += r % 2   # even: the CUDA-core pass takes two columns
            while -(-split_at // r) + -(-(qk_rows - split_at) // r) > left:
                r += 2
            cand = (max(r, 2 * -(-pairs // pv)), r, pv)
            if best is None or cand < best:
                best = cand
        return None if best is None else (best[1], best[2])

    def attn_g(self, splits: int, gs: int, n_kv: int, head_dim: int, seqs: int, keys: int = 0,
               max_qh: int = 0) -> int:
        """KV groups per attn_partial task (a divisor of the rank's KV heads whose q heads fit a task's q area,
        max_qh = codegen ATT_MAX_QH) where the keys are one split of a folded merge with direct writes; else 1.
        Explicit (attn_groups / MPK_ATT_GROUPS): as many as asked for within those limits. Auto (0): the count
        that minimises the attention's waves x per-task time under a pass-count model (`attn_groups_cost`), among
        those up to attn_groups_max() whose shared memory fits the build's K/V stages and keeps the wide passes.
        A task's groups share one fixed chain (q and page table fetched, the first pass landing, the task's
        control path) and run their passes as one pipeline. So at ~1 unit per SM a group costs a whole task
        (llama-3.2-1b B=8, 64 units on 132 SMs: +9% measured with 2 groups), and at many units per SM the fixed
        chain is paid once per several groups (session 22: up to every group of a sequence in one task, where 2
        was the most before)."""
        if splits != 1 or not self.attn_fold_merge:
            return 1
        from ..codegen import layout   # (codegen reads the tasks' opcodes at import)
        max_qh = max_qh or layout.CONSTANTS["ATT_MAX_QH"]
        # (one group a task is always a candidate: a group of more q heads than the q area is the kernel's MAX_GS
        # limit, which the packer checks; the CPU twin runs it)
        ok = [n for n in range(1, n_kv + 1) if n_kv % n == 0 and (n == 1 or n * gs <= max_qh)]
        if self.attn_groups:   # asked for: the packer says what else to lower
            return max(n for n in ok if n <= self.attn_groups)
        if not attn_direct():
            return 1
        wide, most = attn_wide(head_dim, 1), attn_groups_max()
        ok = [n for n in ok
              if n == 1 or (n <= most and _att_smem_fits(head_dim, n) and attn_wide(head_dim, n) >= wide)]
        passes = max(1, -(-keys // (wide * layout.CONSTANTS["ATT_KP"])))
        return min(ok, key=lambda n: (attn_groups_cost(seqs * n_kv, n, passes, self.num_sms), n))

    def argmax_t(self, slices: int) -> int:
        """argmax_partial tasks per rank: a divisor of the op's vocabulary slices."""
        n = min(self.argmax_tasks or slices, slices)
        while slices % n:
            n -= 1
        return n

    def argmax_row_groups(self, rows: int, tasks: int) -> list[tuple[int, int]]:
        """(b0, nb) row groups of argmax_partial: with `tasks` slice tasks per group, auto puts about one task on
        each SM (a sampled row costs a few us per slice, so rows spread over SMs rather than queue on one)."""
        return _row_groups(rows, self.argmax_rows or -(-rows // max(1, min(rows, self.num_sms // max(1, tasks)))))

    def argmax_reduce_groups(self, rows: int) -> list[tuple[int, int]]:
        """(b0, nb) row groups of argmax_reduce: one row per SM up to the SM count (a sampled row's merge and draw
        take one CTA)."""
        return _row_groups(rows, -(-rows // max(1, min(rows, self.num_sms))))

    def allreduce_n(self, graph, op, N: int) -> int:
        if self.allreduce_cols:
            return self.allreduce_cols
        return max(self.min_cols, -(-N // max(1, self.num_sms // 2)))

    def to_dict(self) -> dict:
        return asdict(self)


def _row_groups(rows: int, per: int) -> list[tuple[int, int]]:
    """(b0, nb): rows [0, rows) in runs of `per` (the last may be shorter)."""
    return [(b, min(per, rows - b)) for b in range(0, rows, per)]


def attn_splits_for(rows: int, kv_heads: int, keys: int, num_sms: int = 132, most: int = 32,
                    least_keys: int = 64) -> int:
    """Key splits of decode attention: rows x KV heads (of this rank) x splits roughly fills the SMs, with at
    least `least_keys` keys per split of `keys` and at most `most` splits."""
    return max(1, min(num_sms // max(1, rows * kv_heads), -(-keys // least_keys), most))

