// qkv_rope: one head: RMSNorm(x) @ W_head.T -> [q/k RMSNorm] -> RoPE -> q or paged KV cache  (tasks/ops/qkv_rope.py)
#pragma once
#include "../common.cuh"
#include "linear.cuh"

namespace mpk {

__device__ inline void op_qkv_rope(const Ctx& c) {
  const int64_t* a = c.rec;
  const bf16* x = ptr<const bf16>(a[A_QKV_ROPE_X]);
  const bf16* nw = ptr<const bf16>(a[A_QKV_ROPE_NORM]);
  const bf16* w = ptr<const bf16>(a[A_QKV_ROPE_W]);          // (D, K): this head's rows
  const bf16* hn = ptr<const bf16>(a[A_QKV_ROPE_HEAD_NORM]);  // (D,) or null
  const int which = (int)a[A_QKV_ROPE_WHICH], head = (int)a[A_QKV_ROPE_HEAD];
  const int M = (int)a[A_QKV_ROPE_M], K = (int)a[A_QKV_ROPE_K], D = (int)a[A_QKV_ROPE_D];
  const int n_kv = (int)a[A_QKV_ROPE_N_KV];
  const int64_t ldq = a[A_QKV_ROPE_LDQ];
  const float eps = f32(a[A_QKV_ROPE_EPS]);
  const float* inv_freq = ptr<const float>(c.P[P_INV_FREQ]);
  const int64_t* bt = ptr<const int64_t>(c.P[P_BLOCK_TABLES]);
  const int64_t max_pages = c.P[P_MAX_PAGES], ps = c.P[P_PAGE_SIZE];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  bf16* xs = reinterpret_cast<bf16*>(c.smem);
  float* ys = linear_ytile(c.smem, ROW_TILE, K);  // (ROW_TILE, D) fp32
  float* red = ys + ROW_TILE * MAX_HEAD_DIM;       // Tensor Core k-slice partials (8 x 16 x 8 fp32)
  for (int g0 = 0; g0 < M; g0 += ROW_TILE) {
    const int Mg = min(ROW_TILE, M - g0);
    load_rows_norm(xs, K, x + (int64_t)g0 * K, Mg, K, 0, 1, nw, eps);
    if (Mg >= TC_MIN_M && K % 32 == 0)
      linear_tc_rows8(xs, K, Mg, K, w, 0, D, ys, red);
    else
      linear_core<false>(xs, Mg, K, w, nullptr, 0, D, 1, ys, nullptr);
    for (int i = threadIdx.x; i < Mg * D; i += THREADS) ys[i] = bf(ys[i]);  // the bf16 matmul result
    __syncthreads();
    for (int m = warp; m < Mg; m += nwarps) {
      const int row = g0 + m;  // decode: row == sequence
      const int64_t pos = seq_pos(c, row);
      float* y = ys + m * D;
      if (which != WHICH_V) {
        if (hn != nullptr) {
          float ss = 0.f;
          for (int d = lane; d < D; d += 32) ss = fmaf(y[d], y[d], ss);
          ss = warp_sum(ss);
          const float r = rsqrtf(ss / (float)D + eps);
          for (int d = lane; d < D; d += 32) y[d] = bf(w_bf16(hn + d) * bf(y[d] * r));
          __syncwarp();
        }
        const int h2 = D / 2;
        for (int i = lane; i < h2; i += 32) {
          const float ang = (float)pos * inv_freq[i];
          const float cs = bf(cosf(ang)), sn = bf(sinf(ang));
          const float x1 = y[i], x2 = y[i + h2];
          y[i] = bf(bf(x1 * cs) + bf(-x2 * sn));
          y[i + h2] = bf(bf(x2 * cs) + bf(x1 * sn));
        }
        __syncwarp();
      }
      if (which == WHICH_Q) {
        bf16* q = ptr<bf16>(a[A_QKV_ROPE_Q]) + row * ldq + (int64_t)head * D;
        for (int d = lane; d < D; d += 32) q[d] = __float2bfloat16_rn(y[d]);
      } else if (pos >= 0) {
        const int64_t page = ld_act_s64(bt + row * max_pages + pos / ps);
        bf16* dst = ptr<bf16>(a[A_QKV_ROPE_CACHE]) + ((page * ps + pos % ps) * n_kv + head) * D;
        for (int d = lane; d < D; d += 32) dst[d] = __float2bfloat16_rn(y[d]);
      }
    }
    __syncthreads();
  }
}

}  // namespace mpk
