// linear: y[:, n0:n1] = epilogue(norm?(x) @ W[n0:n1].T) (+ residual | push)   (tasks/ops/linear.py)
// Batch <= ROW_TILE per pass: x rows live in shared memory (bf16), one warp streams one weight row at a time
// with 16-byte non-coherent loads, UN vectors in flight per lane, fp32 accumulation, warp-shuffle sums. The dot
// products land in a shared fp32 tile; the whole CTA then applies the epilogue (coalesced stores), so the
// epilogue's code exists once instead of once per unrolled (row, column) of every core variant.
#pragma once
#include "../common.cuh"

namespace mpk {

// One warp pass: columns nb .. nb + NC - 1 (clamped to n1 - 1; a missing column re-reads the last one and its
// result is dropped). SMEM: the columns' weight rows are staged in shared memory (row n at s0 / s1 + (n - n0) K);
// else they stream from global memory. The sums are the same either way.
template <bool TWO, int MT, int UN, int NC, bool SMEM>
__device__ __forceinline__ void linear_pass(const bf16* xs, int M, int K, const bf16* w0, const bf16* w1,
                                            const bf16* s0, const bf16* s1, int nb, int n0, int n1, int kseg,
                                            float* y0s, float* y1s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  const int KVs = (K >> 3) / kseg;  // 16-byte vectors per row segment
  const int ldy = n1 - n0;
  if (!SMEM && PF_DIST > 0) {  // this warp's rows PF_DIST passes ahead -> L2 (keeps HBM busy between round trips)
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int n = nb + PF_DIST * nwarps * NC + c;
      if (n < n1) {
        for (int off = lane * 64; off < K; off += 32 * 64) {  // 64 bf16 = one 128-byte line per lane
          prefetch_l2_line(w0 + (int64_t)n * K + off);
          if (TWO) prefetch_l2_line(w1 + (int64_t)n * K + off);
        }
      }
    }
  }
  (void)warp;
  float tot0[NC][MT], tot1[NC][MT];
#pragma unroll 1
  for (int sg = 0; sg < kseg; ++sg) {
    const int kb = sg * KVs, ke = kb + KVs;
    float acc0[NC][MT], acc1[NC][MT];
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int m = 0; m < MT; ++m) { acc0[c][m] = 0.f; acc1[c][m] = 0.f; }
    for (int base = kb + lane; base < ke; base += 32 * UN) {
      uint4 v0[NC][UN], v1[NC][UN];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int n = min(nb + c, n1 - 1);
#pragma unroll
        for (int u = 0; u < UN; ++u) {
          const int kk = base + u * 32;
          v0[c][u] = make_uint4(0, 0, 0, 0);
          v1[c][u] = make_uint4(0, 0, 0, 0);
          if (kk < ke) {
            if (SMEM) {
              v0[c][u] = *reinterpret_cast<const uint4*>(s0 + (int64_t)(n - n0) * K + kk * 8);
              if (TWO) v1[c][u] = *reinterpret_cast<const uint4*>(s1 + (int64_t)(n - n0) * K + kk * 8);
            } else {
              v0[c][u] = ld_weight_stream16(w0 + (int64_t)n * K + kk * 8);
              if (TWO) v1[c][u] = ld_weight_stream16(w1 + (int64_t)n * K + kk * 8);
            }
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UN; ++u) {
        const int kk = base + u * 32;
        if (kk < ke) {
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            if (m < M) {
              const uint4 xv = *reinterpret_cast<const uint4*>(xs + (int64_t)m * K + kk * 8);
#pragma unroll
              for (int c = 0; c < NC; ++c) {
                acc0[c][m] = dot8(v0[c][u], xv, acc0[c][m]);
                if (TWO) acc1[c][m] = dot8(v1[c][u], xv, acc1[c][m]);
              }
            }
          }
        }
      }
    }
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < M) {
          const float s0v = warp_sum(acc0[c][m]);
          tot0[c][m] = sg == 0 ? s0v : tot0[c][m] + s0v;
          if (TWO) {
            const float s1v = warp_sum(acc1[c][m]);
            tot1[c][m] = sg == 0 ? s1v : tot1[c][m] + s1v;
          }
        }
      }
  }
  if (lane == 0) {
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int m = 0; m < MT; ++m)
        if (m < M && nb + c < n1) {
          y0s[m * ldy + nb + c - n0] = tot0[c][m];
          if (TWO) y1s[m * ldy + nb + c - n0] = tot1[c][m];
        }
  }
}

// For columns n in [n0, n1) (warp-strided): y0s[m * (n1 - n0) + n - n0] = xs[m] . w0[n] (and y1s with w1 when
// TWO) for m < M. xs: (M, K) bf16 in shared memory, w: (N, K) bf16 rows. K is reduced in kseg equal segments:
// each segment exactly as a rank holding only that K slice would (lane-strided from the segment start, then a
// warp butterfly), the segment sums added in fp32 in order (tasks/ops/linear.py k_segments).
// Staged rows (nst > 0): rows n0 .. n0 + nst - 1 of w0 (and w1) are being copied to the dynamic shared memory at byte
// offset soff (w1's after w0's) and complete on the mbarrier phase (bar, par) (megakernel.cu stage_task_weights). A
// warp first streams its passes that are not wholly staged from global memory, then waits for the copy and runs its
// staged passes (the first ones in column order) from shared memory.
template <bool TWO, int MT, int UN, int NC>
__device__ __noinline__ void linear_core_t(const bf16* xs, int M, int K, const bf16* w0, const bf16* w1, int n0,
                                           int n1, int kseg, float* y0s, float* y1s, int soff, int nst,
                                           uint32_t bar, uint32_t par) {
  const int warp = threadIdx.x >> 5, nwarps = THREADS / 32;
  // a pass is staged when its last real column is: staged passes are each warp's first ones
  auto staged = [&](int nb) { return min(nb + NC - 1, n1 - 1) - n0 < nst; };
  for (int nb = n0 + warp * NC; nb < n1; nb += nwarps * NC)
    if (!staged(nb)) linear_pass<TWO, MT, UN, NC, false>(xs, M, K, w0, w1, nullptr, nullptr, nb, n0, n1, kseg, y0s, y1s);
  if (nst > 0 && n0 + warp * NC < n1 && staged(n0 + warp * NC)) {
    const bf16* s0 = reinterpret_cast<const bf16*>(dyn_smem() + soff);
    const bf16* s1 = s0 + (int64_t)nst * K;
    mbar_wait(bar, par);
    for (int nb = n0 + warp * NC; nb < n1 && staged(nb); nb += nwarps * NC)
      linear_pass<TWO, MT, UN, NC, true>(xs, M, K, w0, w1, s0, s1, nb, n0, n1, kseg, y0s, y1s);
  }
}

// Rows per pass specialised at compile time (1, 2, 4, ROW_TILE) so batch 1 keeps few registers; wide passes
// keep fewer weight vectors in flight to stay within the 1-CTA/SM register budget. Ends with __syncthreads().
template <bool TWO>
__device__ inline void linear_core(const bf16* xs, int M, int K, const bf16* w0, const bf16* w1, int n0, int n1,
                                   int kseg, float* y0s, float* y1s, int soff = 0, int nst = 0, uint32_t bar = 0,
                                   uint32_t par = 0) {
  if (M <= 1) linear_core_t<TWO, 1, UNROLL, (TWO ? 1 : 2)>(xs, M, K, w0, w1, n0, n1, kseg, y0s, y1s, soff, nst, bar, par);
  else if (M <= 2) linear_core_t<TWO, 2, UNROLL, 1>(xs, M, K, w0, w1, n0, n1, kseg, y0s, y1s, soff, nst, bar, par);
  else if (M <= 4)
    linear_core_t<TWO, 4, (UNROLL > 2 ? UNROLL / 2 : 1), 1>(xs, M, K, w0, w1, n0, n1, kseg, y0s, y1s, soff, nst, bar, par);
  else
    linear_core_t<TWO, ROW_TILE, (UNROLL > 4 ? UNROLL / 4 : 1), 1>(xs, M, K, w0, w1, n0, n1, kseg, y0s, y1s, soff, nst,
                                                                   bar, par);
  __syncthreads();
}

// ---- Tensor Core path (batch >= TC_MIN_M): Y^T = W . X^T with mma.sync m16n8k16 (bf16 in, fp32 accumulate).
// A = 16 weight rows x 16 k (W's own row-major layout), B = 16 k x 8 batch rows (xs rows in shared memory), C = 16
// output columns x 8 rows. The k order inside an mma is permuted consistently for A and B: thread (g, t) loads 16
// contiguous bytes of a row (k = 8t .. 8t+7 of a 32-wide round) and feeds k 8t+0..3 to the first mma and 8t+4..7
// to the second, in both operands, so a dot product's terms are all present once. Every weight vector is loaded
// once for all rows of the pass (the CUDA-core path re-streams it per 8 rows).
// Warps: a tile of w columns has ntn = ceil(w/16) n-tiles; its work is a list of units, one (weight, n-tile) each:
// ntn for one weight, 2 ntn for two (gate's n-tiles, then up's). A warp runs one unit at a time on the
// software-pipelined one-weight loop (one weight's fragments, one accumulator set), writing y0s (weight 0) or y1s
// (weight 1). Each K segment of a unit may be cut into wk k-slices (tc_kslices) whose partials are added in slice
// order through `red` (deterministic).
// kslices = 1 fixes wk = 1: one fp32 chain over each K segment, whatever the tile width (tp_invariant graphs,
// whose TP=1 and TP=R tiles differ in width, need it for bit-identical sums; other fixed counts cost registers).

// k-slices per unit (codegen/layout.py tc_kslices mirrors this rule; keep them equal). kslices 1: wk = 1. Auto
// (kslices 0): one weight: the largest power of two with wk * ntn <= nwarps (v17). Two weights: the smallest power
// of two wk <= min(nwarps, R) (R: 32-wide k rounds per segment, so no slice is empty) minimising the makespan
// ceil(2 ntn wk / nwarps) / wk in units, among those whose 2 ntn wk partial blocks fit `cap` (0 = no limit).
__host__ __device__ __forceinline__ int tc_kslices(int ntn, bool two, int R, int kslices, int cap) {
  const int nwarps = THREADS / 32;
  int wk = 1;  // kslices: 0 = auto, 1 = one slice (the only fixed count: the packer refuses others)
  if (kslices != 0) return wk;
  if (!two) {
    while (wk * 2 * ntn <= nwarps) wk *= 2;
    return wk;
  }
  const int units = 2 * ntn;
  int best = (units + nwarps - 1) / nwarps * nwarps;  // makespan x nwarps (an integer: wk divides nwarps)
  for (int c = 2; c <= nwarps && c <= R && (cap == 0 || units * c <= cap); c *= 2) {
    const int span = (units * c + nwarps - 1) / nwarps * (nwarps / c);
    if (span < best) best = span, wk = c;
  }
  return wk;
}

// The tile's units over the warps: pairs p = warp, warp + nwarps, ... of [0, units * wk), unit u = p / wk, k-slice
// ks = p % wk (= warp % wk: wk divides nwarps). TWO: units [0, ntn) are w0's n-tiles into y0s, [ntn, 2 ntn) w1's
// into y1s. red_cap: `red`'s size in blocks of (16, MT8 * 8) fp32 (0 = sized by linear_geometry for this rule).
template <bool TWO, int MT8>
__device__ __forceinline__ void linear_tc_t(const bf16* xs, int ldx, int M, int K, const bf16* w0, const bf16* w1,
                                         int n0, int n1, int kseg, int kslices, int red_cap, float* y0s,
                                         float* y1s, float* red, int ldw, bool acc) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  const int g = lane >> 2, t = lane & 3;
  const int w = n1 - n0, ntn = (w + 15) / 16, units = TWO ? 2 * ntn : ntn;
  const int R = (K / kseg) / 32;  // 32-wide k rounds per segment
  const int wk = tc_kslices(ntn, TWO, R, kslices, red_cap);
  const int ks = warp % wk;
  const int r0 = (R * ks) / wk, r1 = (R * (ks + 1)) / wk;
  constexpr int BLK = 16 * MT8 * 8;  // one (unit, k-slice) block of `red`: (16 columns, MT8 * 8 rows) fp32
  // H rounds of 32 k per stage, two stages in flight, software-pipelined (the next stage's loads are issued before
  // this stage's mma.sync), so that however ptxas orders a stage's loads and mma's, a full stage of loads is
  // always outstanding. The rounds accumulate in order r0, r0 + 1, ..., r1 - 1. MPK_TC_H: rounds per stage (bytes
  // in flight per warp: 2 stages x H rounds x 2 rows x 512 B).
#ifndef MPK_TC_H
#define MPK_TC_H 2
#endif
#ifndef MPK_TC_H32
#define MPK_TC_H32 2
#endif
  constexpr int H = MT8 >= 4 ? MPK_TC_H32 : MPK_TC_H;   // 32-row passes: their accumulators take the registers
#pragma unroll 1
  for (int sg = 0; sg < kseg; ++sg) {
    const int kb = sg * (K / kseg);
#pragma unroll 1
    for (int u = warp / wk; u < units; u += nwarps / wk) {
      const bool second = TWO && u >= ntn;  // w1's n-tile -> y1s
      const int nt = second ? u - ntn : u;
      const bf16* wt = second ? w1 : w0;
      float* ys = second ? y1s : y0s;
      const int na = min(n0 + nt * 16 + g, n1 - 1), nb = min(n0 + nt * 16 + g + 8, n1 - 1);  // clamped: dropped
      float c0[MT8][4];
#pragma unroll
      for (int i = 0; i < MT8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) c0[i][j] = 0.f;
      const bf16* wa = wt + (int64_t)na * ldw + kb + 8 * t;
      const bf16* wb = wt + (int64_t)nb * ldw + kb + 8 * t;
      // stage loads: rounds [rr, rr + H) (zeros past r1, nothing read)
      auto load = [&](int rr, uint4 (&A)[H], uint4 (&B)[H]) {
#pragma unroll
        for (int i = 0; i < H; ++i) {
          const bool ok = rr + i < r1;
          const int o = (rr + i) * 32;
          A[i] = ok ? ld_weight_stream16(wa + o) : make_uint4(0, 0, 0, 0);
          B[i] = ok ? ld_weight_stream16(wb + o) : make_uint4(0, 0, 0, 0);
        }
      };
      auto compute = [&](int rr, const uint4 (&A)[H], const uint4 (&B)[H]) {
#pragma unroll
        for (int i = 0; i < H; ++i) {
          if (rr + i < r1) {
            const int k = kb + (rr + i) * 32 + 8 * t;
#pragma unroll
            for (int mt = 0; mt < MT8; ++mt) {
              const uint4 xv = *reinterpret_cast<const uint4*>(xs + (int64_t)(mt * 8 + g) * ldx + k);
              mma_bf16_16816(c0[mt], A[i].x, B[i].x, A[i].y, B[i].y, xv.x, xv.y);
              mma_bf16_16816(c0[mt], A[i].z, B[i].z, A[i].w, B[i].w, xv.z, xv.w);
            }
          }
        }
      };
      uint4 pa[H], pb[H], qa[H], qb[H];
      load(r0, pa, pb);
#pragma unroll 1
      for (int r = r0; r < r1; r += 2 * H) {
        load(r + H, qa, qb);
        compute(r, pa, pb);
        load(r + 2 * H, pa, pb);
        compute(r + H, qa, qb);
      }
      // C fragment: c[mt][0..1] = (column n0+nt*16+g, rows mt*8+2t, +1), c[mt][2..3] = (column +8, same rows)
#pragma unroll
      for (int mt = 0; mt < MT8; ++mt)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int m = mt * 8 + 2 * t + (j & 1), col = nt * 16 + g + (j >> 1) * 8;
          if (m >= M || col >= w) continue;
          if (wk == 1)
            ys[m * w + col] = sg == 0 && !acc ? c0[mt][j] : ys[m * w + col] + c0[mt][j];
          else
            red[(int64_t)(u * wk + ks) * BLK + (g + (j >> 1) * 8) * MT8 * 8 + m] = c0[mt][j];
        }
    }
    if (wk > 1) {  // partials of the wk k-slices of each unit, added in slice order
      __syncthreads();
      for (int i = threadIdx.x; i < M * w; i += THREADS) {
        const int m = i / w, col = i % w, nt = col / 16, cc = col % 16;
        const float* rr = red + (int64_t)(nt * wk) * BLK + cc * MT8 * 8 + m;  // unit nt, slice 0
        float s0 = 0.f, s1 = 0.f;
        for (int q = 0; q < wk; ++q) {
          s0 = q == 0 ? rr[q * BLK] : s0 + rr[q * BLK];
          if (TWO) {  // unit ntn + nt: blocks (ntn + nt) * wk + q
            const float v = rr[(int64_t)(ntn * wk + q) * BLK];
            s1 = q == 0 ? v : s1 + v;
          }
        }
        y0s[i] = sg == 0 && !acc ? s0 : y0s[i] + s0;
        if (TWO) y1s[i] = sg == 0 && !acc ? s1 : y1s[i] + s1;
      }
      __syncthreads();
    }
  }
}

// qkv_rope's Tensor Core matmul (<= ROW_TILE rows, two weights: the two halves of a head's RoPE pairs): one
// out-of-line entry. Its caller's `red` holds 2 x 8 blocks of (16, 8) fp32 (qkv_rope.cuh, the packer's
// _pack_qkv_rope): the k-slice count is capped to fit them. Ends with __syncthreads().
__device__ __noinline__ void linear_tc_rows8(const bf16* xs, int ldx, int M, int K, const bf16* w0, const bf16* w1,
                                             int n0, int n1, int kslices, float* y0s, float* y1s, float* red) {
  linear_tc_t<true, 1>(xs, ldx, M, K, w0, w1, n0, n1, 1, kslices, 2 * 8, y0s, y1s, red, K, false);
  __syncthreads();
}

// Shared-memory layout of a linear tile (runtime/megakernel.py _pack_linear sizes it): xs (xrows, ldx) bf16, the
// fp32 result tile(s) (rows, n1 - n0), then the Tensor Core k-slice partials.
__device__ __forceinline__ float* linear_ytile(unsigned char* smem, int xrows, int ldx) {
  return reinterpret_cast<float*>(smem + (((int64_t)xrows * ldx * 2 + 15) & ~15LL));
}

// out[:, n0:n1] of rows [g0, g0 + Mg) from the fp32 result tile(s): SiLU*up, residual, bf16 / fp32 / push stores.
__device__ __forceinline__ void linear_epilogue(const Ctx& c, int g0, int Mg, const float* y0s, const float* y1s) {
  const int64_t* a = c.rec;
  const bf16* res = ptr<const bf16>(a[A_LINEAR_RESIDUAL]);
  const int n0 = (int)a[A_LINEAR_N0], w = (int)a[A_LINEAR_N1] - n0;
  const int N = (int)a[A_LINEAR_N], M = (int)a[A_LINEAR_M];
  const int epilogue = (int)a[A_LINEAR_EPILOGUE], out_kind = (int)a[A_LINEAR_OUT_KIND];
  for (int i = threadIdx.x; i < Mg * w; i += THREADS) {
    const int64_t mo = g0 + i / w;
    const int n = n0 + i % w;
    if (out_kind == OUT_PUSH) {  // fp32 partial sum, unrounded, into slot `slot` of every rank's buffer
      const int64_t* peers = ptr<const int64_t>(a[A_LINEAR_PEERS]);
      const int64_t sym_off = c.parity * a[A_LINEAR_PAR_STRIDE];
      for (int p = 0; p < (int)a[A_LINEAR_NPEERS]; ++p)
        ptr<float>(peers[p] + sym_off)[((int64_t)a[A_LINEAR_SLOT] * M + mo) * N + n] = y0s[i];
      continue;
    }
#if MPK_AR_LL
    if (out_kind == OUT_PUSH_LL) {  // the same, as one 8-byte word {fp32 bits, step flag} (allreduce.cuh polls it)
      const int64_t* peers = ptr<const int64_t>(a[A_LINEAR_PEERS]);
      const int64_t sym_off = c.parity * a[A_LINEAR_PAR_STRIDE];
      const uint32_t flag = (uint32_t)c.step;
      for (int p = 0; p < (int)a[A_LINEAR_NPEERS]; ++p) {
        uint32_t* dst = ptr<uint32_t>(peers[p] + sym_off) + (((int64_t)a[A_LINEAR_SLOT] * M + mo) * N + n) * 2;
        asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(dst), "r"(__float_as_uint(y0s[i])),
                     "r"(flag) : "memory");
      }
      continue;
    }
#endif
    float y = bf(y0s[i]);  // the bf16 matmul result
    if (epilogue == EPI_SILU_MUL) {
      const float s = bf(y / (1.f + expf(-y)));
      y = bf(s * bf(y1s[i]));
    }
    if (res != nullptr) y = bf(ld_act_bf16(res + mo * N + n) + y);
    if (out_kind == OUT_BF16)
      ptr<bf16>(a[A_LINEAR_OUT])[mo * N + n] = __float2bfloat16_rn(y);
    else
      ptr<float>(a[A_LINEAR_OUT])[mo * N + n] = y;
  }
}

// A linear tile on CUDA cores (batch < TC_MIN_M, or K not in 32-wide rounds): ROW_TILE rows per pass.
__device__ inline void op_linear(const Ctx& c) {
  const int64_t* a = c.rec;
  const bf16* x = ptr<const bf16>(a[A_LINEAR_X]);
  const bf16* w0 = ptr<const bf16>(a[A_LINEAR_W0]);
  const bf16* w1 = ptr<const bf16>(a[A_LINEAR_W1]);
  const int K = (int)a[A_LINEAR_K], n0 = (int)a[A_LINEAR_N0], n1 = (int)a[A_LINEAR_N1];
  const int M = (int)a[A_LINEAR_M], kseg = (int)a[A_LINEAR_KSEG];
  const int w = n1 - n0;
  bf16* xs = reinterpret_cast<bf16*>(dyn_smem());
  float* y0s = linear_ytile(dyn_smem(), cc_xrows(M), K);
  float* y1s = y0s + ROW_TILE * w;
  const int nst = stage_rows(a[T_STAGE]), soff = stage_off(a[T_STAGE]);   // (megakernel.cu stage_task_weights)
  MPK_STAMP(0);
  for (int g0 = 0; g0 < M; g0 += ROW_TILE) {
    const int Mg = min(ROW_TILE, M - g0);
    load_rows_norm(xs, K, x, Mg, K, a[A_LINEAR_ROW_OFF] + g0 * a[A_LINEAR_ROW_STRIDE], a[A_LINEAR_ROW_STRIDE],
                   ptr<const bf16>(a[A_LINEAR_NORM]), f32(a[A_LINEAR_EPS]));
    MPK_STAMP(1);
    if ((int)a[A_LINEAR_EPILOGUE] == EPI_SILU_MUL)
      linear_core<true>(xs, Mg, K, w0, w1, n0, n1, kseg, y0s, y1s, soff, nst, c.stage_bar, c.stage_par);
    else
      linear_core<false>(xs, Mg, K, w0, nullptr, n0, n1, kseg, y0s, nullptr, soff, nst, c.stage_bar, c.stage_par);
    MPK_STAMP(2);
    linear_epilogue(c, g0, Mg, y0s, y1s);
    MPK_STAMP(3);
    __syncthreads();
  }
}

// Columns [0, Kc) of M input rows (row m at x + (row_off + m * row_stride) * K: x already offset to the chunk) into
// xs (row stride ldx), without a norm: one chunk of rows too long for shared memory (op_linear_tc's x chunks). As
// load_rows_norm: cp.async through L2, one wait, then a barrier.
__device__ inline void load_rows_chunk(bf16* xs, int ldx, const bf16* x, int M, int Kc, int K, int64_t row_off,
                                       int64_t row_stride) {
  const int KV = Kc >> 3;
  for (int i = threadIdx.x; i < M * KV; i += THREADS) {
    const int m = i / KV, k8 = i - m * KV;
    cp_async16(xs + (int64_t)m * ldx + k8 * 8, x + (row_off + m * row_stride) * (int64_t)K + k8 * 8, true);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();
}

// A linear tile on Tensor Cores: passes of tc_rows (8, 16 or 32) rows, each streaming the weights once. Out of
// line: its registers are allocated apart from the persistent loop's.
__device__ __noinline__ void op_linear_tc(const Ctx& c) {
  const int64_t* a = c.rec;
  const bf16* x = ptr<const bf16>(a[A_LINEAR_X]);
  const bf16* w0 = ptr<const bf16>(a[A_LINEAR_W0]);
  const bf16* w1 = ptr<const bf16>(a[A_LINEAR_W1]);
  const int K = (int)a[A_LINEAR_K], n0 = (int)a[A_LINEAR_N0], n1 = (int)a[A_LINEAR_N1];
  const int M = (int)a[A_LINEAR_M], kseg = (int)a[A_LINEAR_KSEG], rows = (int)(a[A_LINEAR_TC_ROWS] & 0xff);
  const int ksl = (int)a[A_LINEAR_KSLICES];
  const bool two = (int)a[A_LINEAR_EPILOGUE] == EPI_SILU_MUL;
  // x chunks (codegen/layout.py linear_tile): input rows too long for shared memory are held K / xch columns at a
  // time (no norm, kseg 1), each chunk's products added into the fp32 result tile; 1: whole rows
  const int xch = max(1, (int)((a[A_LINEAR_TC_ROWS] >> 8) & 0xff)), Kc = K / xch;
  const int w = n1 - n0, ldx = Kc + 8;  // +8: rows start in different banks
  bf16* xs = reinterpret_cast<bf16*>(dyn_smem());
  float* y0s = linear_ytile(dyn_smem(), rows, ldx);
  float* y1s = y0s + rows * w;
  float* red = y1s + rows * w;
  MPK_STAMP(0);
  for (int g0 = 0; g0 < M; g0 += rows) {
    const int Mg = min(rows, M - g0);
    for (int ch = 0; ch < xch; ++ch) {
      if (xch == 1) {
        load_rows_norm(xs, ldx, x, Mg, K, a[A_LINEAR_ROW_OFF] + g0 * a[A_LINEAR_ROW_STRIDE], a[A_LINEAR_ROW_STRIDE],
                       ptr<const bf16>(a[A_LINEAR_NORM]), f32(a[A_LINEAR_EPS]));
      } else {
        if (ch > 0) __syncthreads();   // every warp is done reading the previous chunk
        load_rows_chunk(xs, ldx, x + (int64_t)ch * Kc, Mg, Kc, K, a[A_LINEAR_ROW_OFF] + g0 * a[A_LINEAR_ROW_STRIDE],
                        a[A_LINEAR_ROW_STRIDE]);
      }
      MPK_STAMP(1);
      const bf16* c0 = w0 + (int64_t)ch * Kc;
      const bf16* c1 = two ? w1 + (int64_t)ch * Kc : nullptr;
      const bool acc = ch > 0;
      if (two) {  // red: sized by codegen/layout.py linear_geometry for tc_kslices' rule (cap 0)
        if (Mg <= 8) linear_tc_t<true, 1>(xs, ldx, Mg, Kc, c0, c1, n0, n1, kseg, ksl, 0, y0s, y1s, red, K, acc);
        else if (Mg <= 16) linear_tc_t<true, 2>(xs, ldx, Mg, Kc, c0, c1, n0, n1, kseg, ksl, 0, y0s, y1s, red, K, acc);
        else linear_tc_t<true, 4>(xs, ldx, Mg, Kc, c0, c1, n0, n1, kseg, ksl, 0, y0s, y1s, red, K, acc);
      } else {
        if (Mg <= 8) linear_tc_t<false, 1>(xs, ldx, Mg, Kc, c0, nullptr, n0, n1, kseg, ksl, 0, y0s, nullptr, red, K, acc);
        else if (Mg <= 16) linear_tc_t<false, 2>(xs, ldx, Mg, Kc, c0, nullptr, n0, n1, kseg, ksl, 0, y0s, nullptr, red, K, acc);
        else linear_tc_t<false, 4>(xs, ldx, Mg, Kc, c0, nullptr, n0, n1, kseg, ksl, 0, y0s, nullptr, red, K, acc);
      }
    }
    __syncthreads();
    MPK_STAMP(2);
    linear_epilogue(c, g0, Mg, y0s, y1s);
    MPK_STAMP(3);
    __syncthreads();
  }
}

}  // namespace mpk
