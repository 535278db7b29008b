// mlp: a gate_up tile [n0, n1) with its share of the down projection (tasks/ops/mlp.py; MPK_MLP_FUSE=1 graphs, which
// make the packer ask for a -DMPK_MLP=1 build). Batch below TC_MIN_M (CUDA-core rows, M <= 2). Two calls on one record
// (codegen/layout.py: every slot op_linear reads sits at linear's index):
//   1. op_linear (megakernel.cu): x -> norm -> gate / up sums into the fp32 tiles y0s / y1s (shared memory), where
//      it stops (no epilogue);
//   2. op_mlp_tail (here, through op_small): SiLU * up, rounded as linear_epilogue rounds it, in place in y0s (a,
//      M x w); the down weight Wd (H, I) read in place, columns n0..n1 of every row (w x 2 bytes a row): thread t
//      owns rows 4t + 1024 k .. + 3, one fp32 dot over the tile's columns per (row, m); red.global.add.v4.f32 into
//      acc (M, H); then a ticket (monotonic: `tiles` a step), whose last taker of the step writes
//      out = bf16(res + bf16(acc)) (the down linear's rounding points) and zeroes acc. The megakernel signals after.
// bench_mlp.cu's mode "inplace" is this op's premise measured alone (scripts/bench_mlp.py).
#pragma once
#include "../common.cuh"
#include "linear.cuh"

namespace mpk {
#if MPK_MLP
static_assert(A_MLP_X == A_LINEAR_X && A_MLP_W0 == A_LINEAR_W0 && A_MLP_W1 == A_LINEAR_W1 && A_MLP_NORM == A_LINEAR_NORM &&
                  A_MLP_K == A_LINEAR_K && A_MLP_N0 == A_LINEAR_N0 && A_MLP_N1 == A_LINEAR_N1 && A_MLP_M == A_LINEAR_M &&
                  A_MLP_EPS == A_LINEAR_EPS && A_MLP_EPILOGUE == A_LINEAR_EPILOGUE && A_MLP_KSEG == A_LINEAR_KSEG &&
                  A_MLP_ROW_OFF == A_LINEAR_ROW_OFF && A_MLP_ROW_STRIDE == A_LINEAR_ROW_STRIDE &&
                  A_MLP_TC_ROWS == A_LINEAR_TC_ROWS,
              "op_linear runs the mlp record: its slots must be linear's (codegen/layout.py check_layout)");
constexpr int MLP_CHUNK = 8;   // 16-byte vectors of a row's slice in flight a thread (a 64-column tile's whole row)

__device__ __forceinline__ void mlp_red_v4(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

// Down's share: acc[m, j] += sum_n a[m, n] Wd[j, n0 + n] for the rows j this thread owns. ys: 8 floats a thread.
template <int MT>
__device__ __noinline__ void mlp_down_share(const bf16* __restrict__ wd, int I, int H, int n0, int w, const float* a,
                                            float* __restrict__ acc, float* ys) {
  const int vpr = w >> 3;            // w: a multiple of 8 (the packer checks)
  float* y = ys + 8 * threadIdx.x;   // (4 rows x MT) sums of this thread (shared: the row loop stays rolled)
  for (int j4 = 4 * threadIdx.x; j4 < H; j4 += 4 * THREADS) {
#pragma unroll 1
    for (int r = 0; r < 4; ++r) {
      const bf16* row = wd + (int64_t)(j4 + r) * I + n0;
      float s[MT];
#pragma unroll
      for (int m = 0; m < MT; ++m) s[m] = 0.f;
#pragma unroll 1
      for (int c0 = 0; c0 < vpr; c0 += MLP_CHUNK) {   // MLP_CHUNK vectors of the row in flight, then their FMAs
        uint4 v[MLP_CHUNK];
#pragma unroll
        for (int c = 0; c < MLP_CHUNK; ++c)
          if (c0 + c < vpr) v[c] = ld_weight_stream16(row + 8 * (c0 + c));
#pragma unroll
        for (int c = 0; c < MLP_CHUNK; ++c) {
          if (c0 + c < vpr) {
            const uint32_t wv[4] = {v[c].x, v[c].y, v[c].z, v[c].w};
            const float* ac = a + 8 * (c0 + c);
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
              for (int m = 0; m < MT; ++m) {
                s[m] = fmaf(ac[m * w + 2 * q], bf16_lo(wv[q]), s[m]);
                s[m] = fmaf(ac[m * w + 2 * q + 1], bf16_hi(wv[q]), s[m]);
              }
          }
        }
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) y[4 * m + r] = s[m];
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) mlp_red_v4(acc + (int64_t)m * H + j4, y[4 * m], y[4 * m + 1], y[4 * m + 2], y[4 * m + 3]);
  }
}

__device__ __noinline__ void op_mlp_tail(const Ctx& c) {
  const int64_t* a = c.rec;
  const int M = (int)a[A_MLP_M], K = (int)a[A_MLP_K], I = (int)a[A_MLP_I], H = (int)a[A_MLP_N];
  const int n0 = (int)a[A_MLP_N0], w = (int)a[A_MLP_N1] - n0;
  float* acc = ptr<float>(a[A_MLP_ACC]);
  float* y0s = linear_ytile(dyn_smem(), cc_xrows(M), K);   // op_linear's tiles, then the per-thread row sums
  const float* y1s = y0s + ROW_TILE * w;
  float* ys = y0s + 2 * ROW_TILE * w;
  __shared__ int s_last;
  for (int i = threadIdx.x; i < M * w; i += THREADS) {   // linear_epilogue's SiLU * up, in place
    const float g = bf(y0s[i]);
    y0s[i] = bf(bf(g / (1.f + expf(-g))) * bf(y1s[i]));
  }
  __syncthreads();
  if (M <= 1) mlp_down_share<1>(ptr<const bf16>(a[A_MLP_WD]), I, H, n0, w, y0s, acc, ys);
  else mlp_down_share<2>(ptr<const bf16>(a[A_MLP_WD]), I, H, n0, w, y0s, acc, ys);
  MPK_STAMP(3);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();   // the CTA's adds (ordered before by the barrier) before its ticket
    unsigned long long t;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(t) : "l"(ptr<uint64_t>(a[A_MLP_TICKET])) : "memory");
    s_last = (int)(t % (unsigned long long)a[A_MLP_TILES]) == (int)a[A_MLP_TILES] - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const bf16* res = ptr<const bf16>(a[A_MLP_RESIDUAL]);
  bf16* out = ptr<bf16>(a[A_MLP_OUT]);
  for (int i = threadIdx.x; i < M * H; i += THREADS) {
    out[i] = __float2bfloat16_rn(bf(ld_act_bf16(res + i) + bf(__ldcg(acc + i))));
    __stcg(acc + i, 0.f);
  }
  MPK_STAMP(4);
}
#endif
}  // namespace mpk
