"""Two-weight Tensor Core tiles as one-weight units (device_kernels/ops/linear.cuh linear_tc_t): the k-slice rule
(codegen/layout.tc_kslices, the Python mirror of the device's tc_kslices), the (unit, k-slice) assignment over the
warps, the `red` blocks the kernel indexes against what linear_geometry sizes, and the gate_up tiles of
llama-3.2-1b and qwen3-8b (wk, makespan, rows per pass). The pure-Python VM does not model k-slicing, so these
are the CPU checks of the device's indexing; the device rule itself is compared with the mirror by compiling it
for the host where nvcc exists."""
from __future__ import annotations

import subprocess
from fractions import Fraction

import pytest

from mpk_runtime.codegen import header, layout as L, nvcc

NWARPS = L.CONSTANTS["THREADS"] // 32
RS = (1, 2, 3, 4, 5, 7, 8, 16, 64, 128, 192, 384)


def old_wk(ntn: int, kslices: int) -> int:
    """The v17/v18 rule, both weights in one warp: the largest power of two with wk * ntn <= nwarps."""
    wk = 1
    if kslices == 0:
        while wk * 2 * ntn <= NWARPS:
            wk *= 2
    return wk


def makespan(units: int, wk: int) -> Fraction:
    """Time of the busiest warp, in one-weight n-tile units over a full K segment."""
    return Fraction(-(-units * wk // NWARPS), wk)


def old_makespan(ntn: int, kslices: int = 0) -> Fraction:
    """The v18 two-weight loop: ntn * wk warps, each both weights of an n-tile over 1 / wk of K."""
    wk = old_wk(ntn, kslices)
    return Fraction(-(-ntn * wk // NWARPS) * 2, wk)


def rounds(R: int, wk: int, ks: int) -> int:
    """32-wide k rounds of k-slice ks: [R ks / wk, R (ks + 1) / wk)."""
    return R * (ks + 1) // wk - R * ks // wk


def busiest_warp_rounds(ntn: int, R: int, wk: int, old: bool = False) -> int:
    """Weight rounds the busiest warp streams: units of one weight (linear_tc_t), or (old) v18's warps streaming
    both weights of their n-tiles."""
    if old:
        return max(sum(2 * rounds(R, wk, warp % wk) for _ in range(warp // wk, ntn, NWARPS // wk))
                   for warp in range(NWARPS))
    return max(sum(rounds(R, wk, ks) for wp, _, ks in pairs(ntn, True, wk) if wp == warp) for warp in range(NWARPS))


def pairs(ntn: int, two: bool, wk: int) -> list[tuple[int, int, int]]:
    """(warp, unit, k-slice) as linear_tc_t's loop runs them: unit u = warp / wk, += nwarps / wk; ks = warp % wk."""
    units = 2 * ntn if two else ntn
    return [(warp, u, warp % wk) for warp in range(NWARPS) for u in range(warp // wk, units, NWARPS // wk)]


def red_blocks_used(ntn: int, two: bool, wk: int) -> int:
    """1 + the largest `red` block index linear_tc_t writes (u * wk + ks) or reads in its slice sums (nt * wk + q
    for weight 0, (ntn + nt) * wk + q for weight 1); 0 when wk == 1 (partials go straight to y0s / y1s)."""
    if wk == 1:
        return 0
    written = {u * wk + ks for _, u, ks in pairs(ntn, two, wk)}
    read = {nt * wk + q for nt in range(ntn) for q in range(wk)}
    if two:
        read |= {(ntn + nt) * wk + q for nt in range(ntn) for q in range(wk)}
    assert read == written   # every partial the sums read was written
    return max(written) + 1


def test_kslices_one_fixes_one_slice():
    for ntn in range(1, 40):
        for R in RS:
            assert L.tc_kslices(ntn, 1, R, 1) == 1 and L.tc_kslices(ntn, 2, R, 1) == 1
            assert L.tc_kslices(ntn, 2, R, 1, 16) == 1


def test_one_weight_rule_unchanged():
    # the one-weight path keeps v17's slices (and so its sums, bit for bit)
    for ntn in range(1, 40):
        for R in RS:
            assert L.tc_kslices(ntn, 1, R, 0) == old_wk(ntn, 0)


@pytest.mark.parametrize("cap", [0, 16])
def test_two_weight_rule_is_the_smallest_wk_of_least_makespan(cap):
    for ntn in range(1, 65):
        units = 2 * ntn
        for R in RS:
            cands = [c for c in (1, 2, 4, 8) if c <= NWARPS and (c == 1 or (c <= R and (cap == 0 or units * c <= cap)))]
            want = min(cands, key=lambda c: (makespan(units, c), c))
            wk = L.tc_kslices(ntn, 2, R, 0, cap)
            assert wk == want, (ntn, R, cap)
            assert wk == 1 or wk <= R          # every k-slice holds at least one 32-wide round
            assert NWARPS % wk == 0            # so a warp keeps its k-slice across its units
            # never more weight rounds on the busiest warp than v18's loop (both weights per warp), where k-slices
            # are even (R % 8 == 0: K a multiple of 256 per segment, every model here; the rule's makespan
            # assumes even slices)
            if R % NWARPS == 0:
                assert busiest_warp_rounds(ntn, R, wk) <= busiest_warp_rounds(ntn, R, old_wk(ntn, 0), old=True)


@pytest.mark.parametrize("two", [False, True])
def test_units_and_slices_run_once_each(two):
    for ntn in range(1, 40):
        for wk in (1, 2, 4, 8):
            ps = pairs(ntn, two, wk)
            units = 2 * ntn if two else ntn
            assert sorted((u, ks) for _, u, ks in ps) == [(u, k) for u in range(units) for k in range(wk)]
            per_warp = [sum(1 for wp, _, _ in ps if wp == warp) for warp in range(NWARPS)]
            assert max(per_warp) == -(-units * wk // NWARPS)   # the makespan the rule minimises


def _red_fits(M: int, K: int, w: int, nw: int, kseg: int) -> None:
    rows, need, chunks = L.linear_tile(M, K, w, nw, kseg)
    if not rows:
        return
    K //= chunks   # (x chunks: op_linear_tc holds K / chunks columns of its rows, and reduces that many a call)
    ntn, R = -(-w // 16), K // kseg // 32
    red_off = ((rows * (K + 8) * 2 + 15) & ~15) + 2 * rows * w * 4   # op_linear_tc: xs, y0s, y1s, then red
    for Mg in {min(rows, M - g0) for g0 in range(0, M, rows)}:
        mt8 = 1 if Mg <= 8 else 2 if Mg <= 16 else 4
        blk = 16 * mt8 * 8 * 4
        for ksl in (0, 1):
            used = red_blocks_used(ntn, nw == 2, L.tc_kslices(ntn, nw, R, ksl))
            assert red_off + used * blk <= need, (M, K, w, nw, kseg, ksl)


def test_red_buffer_covers_what_the_kernel_indexes():
    for M in (3, 8, 13, 16, 24, 32, 40, 128):
        for K in (1024, 2048, 4096, 6144, 8192, 12288, 18944):
            for kseg in (1, 2, 4):
                for w in list(range(1, 130)) + [144, 160, 192, 256, 400, 976]:
                    for nw in (1, 2):
                        _red_fits(M, K, w, nw, kseg)


def test_qkv_rope_red_cap():
    # linear_tc_rows8 (qkv_rope) passes cap 16: its caller sizes 2 x 8 blocks of (16, 8) fp32 (runtime/megakernel.py
    # _pack_qkv_rope, qkv_rope.cuh), for any part of a head (nr <= MAX_HEAD_DIM / 2 columns)
    for nr in range(1, L.CONSTANTS["MAX_HEAD_DIM"] // 2 + 1):
        ntn = -(-nr // 16)
        for R in RS:
            for ksl in (0, 1):
                wk = L.tc_kslices(ntn, 2, R, ksl, 16)
                assert red_blocks_used(ntn, True, wk) <= 16
                if R % NWARPS == 0:
                    assert busiest_warp_rounds(ntn, R, wk) <= busiest_warp_rounds(ntn, R, old_wk(ntn, ksl), old=True)


# gate_up tile width -> (ntn, wk, (unit, slice) pairs, makespan) with the units, and the v18 makespan
GATE_UP = {64: (4, 1, 8, Fraction(1), Fraction(1)),          # llama-3.2-1b TP=1
           32: (2, 2, 8, Fraction(1, 2), Fraction(1, 2)),    # llama-3.2-1b TP=2
           96: (6, 2, 24, Fraction(3, 2), Fraction(2)),      # qwen3-8b TP=1
           48: (3, 4, 24, Fraction(3, 4), Fraction(1))}      # qwen3-8b TP=2


def _old_rows(M, K, w, nw, kseg):
    """linear_geometry's rows per pass with v18's `red` (8 blocks per weight)."""
    C = L.CONSTANTS
    if M < C["TC_MIN_M"] or K % (32 * kseg):
        return 0
    for rows in (32, 16, 8):
        if rows > C["MAX_PASS_ROWS"] or (rows > 8 and rows // 2 >= M):
            continue
        if ((rows * (K + 8) * 2 + 15) & ~15) + 2 * rows * w * 4 + 8 * 16 * rows * nw * 4 <= L.SMEM_BUDGET:
            return rows
    return 0


@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen3-8b"])
def test_gate_up_units_of_the_models(name):
    from mpk_runtime.ir import build_graph
    from mpk_runtime.models import PRESETS
    from mpk_runtime.planner.simulate import linear_shape
    from mpk_runtime.tasks import Tiling, build_task_graphs
    cfg = PRESETS[name].replace(num_layers=1)
    seen = set()
    for tp in (1, 2):
        for B in (8, 16, 32, 128):
            for tpi in ((1, 2) if B == 8 else (1,)):
                gs = [build_graph(cfg, batch=B, context_len=64, tp=tp, rank=r, tp_invariant=tpi) for r in range(tp)]
                for t in build_task_graphs(gs, Tiling(num_sms=132))[0].tasks:
                    if t.kind != "linear":
                        continue
                    M, K, w, nw, kseg = linear_shape(t)
                    rows = L.linear_geometry(M, K, w, nw, kseg)[0]
                    assert rows == _old_rows(M, K, w, nw, kseg), (t.op, M, K, w)  # no extra weight passes
                    if nw == 1 or not rows:
                        continue
                    ntn, R, ksl = -(-w // 16), K // kseg // 32, t.params["k_slices"]
                    wk = L.tc_kslices(ntn, 2, R, ksl)
                    if tpi > 1:   # tp_invariant: one k-slice (bit-identical TP=1 / TP=R sums)
                        assert ksl == 1 and wk == 1
                        continue
                    assert (ntn, wk, 2 * ntn * wk, makespan(2 * ntn, wk), old_makespan(ntn)) == GATE_UP[w], (tp, B)
                    seen.add((tp, w))
    assert seen == ({(1, 64), (2, 32)} if name == "llama-3.2-1b" else {(1, 96), (2, 48)})


_HOST_MAIN = r"""
#include "common.cuh"
#include "ops/linear.cuh"
#include <cstdio>
int main() {
  for (int ntn = 1; ntn <= 64; ++ntn)
    for (int two = 0; two <= 1; ++two)
      for (int R : {%s})
        for (int ks = 0; ks <= 1; ++ks)
          for (int cap : {0, 16})
            std::printf("%%d %%d %%d %%d %%d %%d\n", ntn, two, R, ks, cap, mpk::tc_kslices(ntn, two != 0, R, ks, cap));
  return 0;
}
"""


@pytest.mark.skipif(nvcc.find_nvcc() is None, reason="nvcc not on PATH: cannot compile device sources")
def test_device_kslice_rule_equals_the_python_mirror(tmp_path):
    (tmp_path / header.HEADER_NAME).write_text(header.generate_header())
    src = tmp_path / "kslices.cu"
    src.write_text(_HOST_MAIN % ", ".join(map(str, RS)))
    exe = tmp_path / "kslices"
    p = subprocess.run([nvcc.find_nvcc(), "-std=c++17", nvcc.GENCODE, "-I", str(tmp_path), "-I", str(nvcc.DEVICE_DIR),
                        "-o", str(exe), str(src)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split("\n")
    rows = [tuple(map(int, line.split())) for line in out if line.strip()]
    assert len(rows) == 64 * 2 * len(RS) * 2 * 2
    for ntn, two, R, ks, cap, wk in rows:
        assert wk == L.tc_kslices(ntn, 2 if two else 1, R, ks, cap), (ntn, two, R, ks, cap)
