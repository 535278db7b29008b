// linear: y[:, n0:n1] = epilogue(norm?(x) @ W[n0:n1].T) (+ residual | push)   (tasks/ops/linear.py)
// Batch <= ROW_TILE per pass: x rows live in shared memory (bf16), one warp streams one weight row at a time
// with 16-byte non-coherent loads, UNROLL vectors in flight per lane, fp32 accumulation, warp-shuffle sums.
#pragma once
#include "../common.cuh"

namespace mpk {

// For columns n in [n0, n1) (warp-strided): acc0[m] = xs[m] . w0[n], acc1[m] = xs[m] . w1[n] (TWO), then
// lane 0 calls epi(m, n, acc0, acc1) for m < M. xs: (M, K) bf16 in shared memory, w: (N, K) bf16 rows.
template <bool TWO, int MT, int UN, int NC, typename Epi>
__device__ __forceinline__ void linear_core_t(const bf16* xs, int M, int K, const bf16* w0, const bf16* w1, int n0,
                                              int n1, Epi epi) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  const int KV = K >> 3;  // 16-byte vectors per row
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
    float acc0[NC][MT], acc1[NC][MT];
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int m = 0; m < MT; ++m) { acc0[c][m] = 0.f; acc1[c][m] = 0.f; }
    for (int base = lane; base < KV; base += 32 * UN) {
      uint4 v0[NC][UN], v1[NC][UN];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const int n = min(nb + c, n1 - 1);  // a missing column re-reads the last one; its result is dropped
#pragma unroll
        for (int u = 0; u < UN; ++u) {
          const int kk = base + u * 32;
          v0[c][u] = make_uint4(0, 0, 0, 0);
          v1[c][u] = make_uint4(0, 0, 0, 0);
          if (kk < KV) {
            v0[c][u] = ld_weight16(w0 + (int64_t)n * K + kk * 8);
            if (TWO) v1[c][u] = ld_weight16(w1 + (int64_t)n * K + kk * 8);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < UN; ++u) {
        const int kk = base + u * 32;
        if (kk < KV) {
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
          acc0[c][m] = warp_sum(acc0[c][m]);
          if (TWO) acc1[c][m] = warp_sum(acc1[c][m]);
        }
      }
    if (lane == 0) {
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int m = 0; m < MT; ++m)
          if (m < M && nb + c < n1) epi(m, nb + c, acc0[c][m], acc1[c][m]);
    }
  }
}

// Rows per pass specialised at compile time (1, 2, 4, ROW_TILE) so batch 1 keeps few registers; wide passes
// keep fewer weight vectors in flight to stay within the 1-CTA/SM register budget.
template <bool TWO, typename Epi>
__device__ __forceinline__ void linear_core(const bf16* xs, int M, int K, const bf16* w0, const bf16* w1, int n0,
                                            int n1, Epi epi) {
  if (M <= 1) linear_core_t<TWO, 1, UNROLL, (TWO ? 1 : 2)>(xs, M, K, w0, w1, n0, n1, epi);
  else if (M <= 2) linear_core_t<TWO, 2, UNROLL, 1>(xs, M, K, w0, w1, n0, n1, epi);
  else if (M <= 4) linear_core_t<TWO, 4, (UNROLL > 2 ? UNROLL / 2 : 1), 1>(xs, M, K, w0, w1, n0, n1, epi);
  else linear_core_t<TWO, ROW_TILE, (UNROLL > 4 ? UNROLL / 4 : 1), 1>(xs, M, K, w0, w1, n0, n1, epi);
}

__device__ inline void op_linear(const Ctx& c) {
  const int64_t* a = c.rec;
  const bf16* x = ptr<const bf16>(a[A_LINEAR_X]);
  const bf16* w0 = ptr<const bf16>(a[A_LINEAR_W0]);
  const bf16* w1 = ptr<const bf16>(a[A_LINEAR_W1]);
  const bf16* nw = ptr<const bf16>(a[A_LINEAR_NORM]);
  const bf16* res = ptr<const bf16>(a[A_LINEAR_RESIDUAL]);
  const int K = (int)a[A_LINEAR_K], n0 = (int)a[A_LINEAR_N0], n1 = (int)a[A_LINEAR_N1];
  const int N = (int)a[A_LINEAR_N], M = (int)a[A_LINEAR_M];
  const float eps = f32(a[A_LINEAR_EPS]);
  const int epilogue = (int)a[A_LINEAR_EPILOGUE], out_kind = (int)a[A_LINEAR_OUT_KIND];
  const int64_t row_off = a[A_LINEAR_ROW_OFF], row_stride = a[A_LINEAR_ROW_STRIDE];
  const int64_t* peers = ptr<const int64_t>(a[A_LINEAR_PEERS]);
  const int npeers = (int)a[A_LINEAR_NPEERS];
  const int64_t sym_off = c.parity * a[A_LINEAR_PAR_STRIDE];
  const int slot = (int)a[A_LINEAR_SLOT];
  bf16* xs = reinterpret_cast<bf16*>(c.smem);
  for (int g0 = 0; g0 < M; g0 += ROW_TILE) {
    const int Mg = min(ROW_TILE, M - g0);
    load_rows_norm(xs, x, Mg, K, row_off + g0 * row_stride, row_stride, nw, eps);
    auto epi = [&](int m, int n, float y0, float y1) {
      const int64_t mo = g0 + m;
      float y = bf(y0);  // the bf16 matmul result
      if (epilogue == EPI_SILU_MUL) {
        const float s = bf(y / (1.f + expf(-y)));
        y = bf(s * bf(y1));
      }
      if (res != nullptr) y = bf(ld_act_bf16(res + mo * N + n) + y);
      if (out_kind == OUT_BF16) {
        ptr<bf16>(a[A_LINEAR_OUT])[mo * N + n] = __float2bfloat16_rn(y);
      } else if (out_kind == OUT_F32) {
        ptr<float>(a[A_LINEAR_OUT])[mo * N + n] = y;
      } else {  // push fp32 into slot `slot` of every rank's symmetric buffer (peer pointers)
        for (int p = 0; p < npeers; ++p)
          ptr<float>(peers[p] + sym_off)[((int64_t)slot * M + mo) * N + n] = y;
      }
    };
    if (epilogue == EPI_SILU_MUL)
      linear_core<true>(xs, Mg, K, w0, w1, n0, n1, epi);
    else
      linear_core<false>(xs, Mg, K, w0, nullptr, n0, n1, epi);
    __syncthreads();
  }
}

}  // namespace mpk
