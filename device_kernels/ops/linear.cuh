// linear: y[:, n0:n1] = epilogue(norm?(x) @ W[n0:n1].T) (+ residual | push)   (tasks/ops/linear.py)
// Batch <= ROW_TILE per pass: x rows live in shared memory (bf16), one warp streams one weight row at a time
// with 16-byte non-coherent loads, UN vectors in flight per lane, fp32 accumulation, warp-shuffle sums. The dot
// products land in a shared fp32 tile; the whole CTA then applies the epilogue (coalesced stores), so the
// epilogue's code exists once instead of once per unrolled (row, column) of every core variant.
#pragma once
#include "../common.cuh"

namespace mpk {

// For columns n in [n0, n1) (warp-strided): y0s[m * (n1 - n0) + n - n0] = xs[m] . w0[n] (and y1s with w1 when
// TWO) for m < M. xs: (M, K) bf16 in shared memory, w: (N, K) bf16 rows. K is reduced in kseg equal segments:
// each segment exactly as a rank holding only that K slice would (lane-strided from the segment start, then a
// warp butterfly), the segment sums added in fp32 in order (tasks/ops/linear.py k_segments).
template <bool TWO, int MT, int UN, int NC>
__device__ __noinline__ void linear_core_t(const bf16* xs, int M, int K, const bf16* w0, const bf16* w1, int n0,
                                           int n1, int kseg, float* y0s, float* y1s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  const int KVs = (K >> 3) / kseg;  // 16-byte vectors per row segment
  const int ldy = n1 - n0;
  // each warp pass: NC columns, UN vectors per lane per column in flight before the first FMA
  for (int nb = n0 + warp * NC; nb < n1; nb += nwarps * NC) {
    if (PF_DIST > 0) {  // this warp's rows PF_DIST passes ahead -> L2 (keeps HBM busy between round trips)
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
          const int n = min(nb + c, n1 - 1);  // a missing column re-reads the last one; its result is dropped
#pragma unroll
          for (int u = 0; u < UN; ++u) {
            const int kk = base + u * 32;
            v0[c][u] = make_uint4(0, 0, 0, 0);
            v1[c][u] = make_uint4(0, 0, 0, 0);
            if (kk < ke) {
              v0[c][u] = ld_weight16(w0 + (int64_t)n * K + kk * 8);
              if (TWO) v1[c][u] = ld_weight16(w1 + (int64_t)n * K + kk * 8);
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
            const float s0 = warp_sum(acc0[c][m]);
            tot0[c][m] = sg == 0 ? s0 : tot0[c][m] + s0;
            if (TWO) {
              const float s1 = warp_sum(acc1[c][m]);
              tot1[c][m] = sg == 0 ? s1 : tot1[c][m] + s1;
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
}

// Rows per pass specialised at compile time (1, 2, 4, ROW_TILE) so batch 1 keeps few registers; wide passes
// keep fewer weight vectors in flight to stay within the 1-CTA/SM register budget. Ends with __syncthreads().
template <bool TWO>
__device__ inline void linear_core(const bf16* xs, int M, int K, const bf16* w0, const bf16* w1, int n0, int n1,
                                   int kseg, float* y0s, float* y1s) {
  if (M <= 1) linear_core_t<TWO, 1, UNROLL, (TWO ? 1 : 2)>(xs, M, K, w0, w1, n0, n1, kseg, y0s, y1s);
  else if (M <= 2) linear_core_t<TWO, 2, UNROLL, 1>(xs, M, K, w0, w1, n0, n1, kseg, y0s, y1s);
  else if (M <= 4) linear_core_t<TWO, 4, (UNROLL > 2 ? UNROLL / 2 : 1), 1>(xs, M, K, w0, w1, n0, n1, kseg, y0s, y1s);
  else linear_core_t<TWO, ROW_TILE, (UNROLL > 4 ? UNROLL / 4 : 1), 1>(xs, M, K, w0, w1, n0, n1, kseg, y0s, y1s);
  __syncthreads();
}

// Shared-memory layout of a linear tile: xs (ROW_TILE, K) bf16, then the fp32 result tile(s) (ROW_TILE, n1 - n0).
__device__ __forceinline__ float* linear_ytile(unsigned char* smem, int K) {
  return reinterpret_cast<float*>(smem + (((int64_t)ROW_TILE * K * 2 + 15) & ~15LL));
}

__device__ inline void op_linear(const Ctx& c) {
  const int64_t* a = c.rec;
  const bf16* x = ptr<const bf16>(a[A_LINEAR_X]);
  const bf16* w0 = ptr<const bf16>(a[A_LINEAR_W0]);
  const bf16* w1 = ptr<const bf16>(a[A_LINEAR_W1]);
  const bf16* nw = ptr<const bf16>(a[A_LINEAR_NORM]);
  const bf16* res = ptr<const bf16>(a[A_LINEAR_RESIDUAL]);
  const int K = (int)a[A_LINEAR_K], n0 = (int)a[A_LINEAR_N0], n1 = (int)a[A_LINEAR_N1];
  const int N = (int)a[A_LINEAR_N], M = (int)a[A_LINEAR_M], kseg = (int)a[A_LINEAR_KSEG];
  const float eps = f32(a[A_LINEAR_EPS]);
  const int epilogue = (int)a[A_LINEAR_EPILOGUE], out_kind = (int)a[A_LINEAR_OUT_KIND];
  const int64_t row_off = a[A_LINEAR_ROW_OFF], row_stride = a[A_LINEAR_ROW_STRIDE];
  const int64_t* peers = ptr<const int64_t>(a[A_LINEAR_PEERS]);
  const int npeers = (int)a[A_LINEAR_NPEERS];
  const int64_t sym_off = c.parity * a[A_LINEAR_PAR_STRIDE];
  const int slot = (int)a[A_LINEAR_SLOT];
  const int w = n1 - n0;
  bf16* xs = reinterpret_cast<bf16*>(c.smem);
  float* y0s = linear_ytile(c.smem, K);
  float* y1s = y0s + ROW_TILE * w;
  for (int g0 = 0; g0 < M; g0 += ROW_TILE) {
    const int Mg = min(ROW_TILE, M - g0);
    load_rows_norm(xs, x, Mg, K, row_off + g0 * row_stride, row_stride, nw, eps);
    if (epilogue == EPI_SILU_MUL)
      linear_core<true>(xs, Mg, K, w0, w1, n0, n1, kseg, y0s, y1s);
    else
      linear_core<false>(xs, Mg, K, w0, nullptr, n0, n1, kseg, y0s, nullptr);
    for (int i = threadIdx.x; i < Mg * w; i += THREADS) {
      const int64_t mo = g0 + i / w;
      const int n = n0 + i % w;
      if (out_kind == OUT_PUSH) {  // fp32 partial sum, unrounded, into slot `slot` of every rank's buffer
        for (int p = 0; p < npeers; ++p) ptr<float>(peers[p] + sym_off)[((int64_t)slot * M + mo) * N + n] = y0s[i];
        continue;
      }
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
    __syncthreads();
  }
}

}  // namespace mpk
