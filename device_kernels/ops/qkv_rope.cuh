// qkv_rope: part of a head (RoPE pairs [r0, r0+nr): head rows r0+i and D/2+r0+i): RMSNorm(x) @ W_rows.T ->
// [q/k RMSNorm, whole head only] -> RoPE -> q or paged KV cache; or (which == raw) only the projection of a normed
// head's part, into qk_raw, and op_qk_norm_rope finishes whole normed heads  (tasks/ops/qkv_rope.py)
#pragma once
#include "../common.cuh"
#include "linear.cuh"
#include "qk_norm.cuh"

namespace mpk {

// (Qwen2) the bias of a part's rows added to one row's rounded product and rounded again, bf16(bf16(x W^T) + b) as
// torch's y + b (a warp: lanes over the nr pairs). Only in a -DMPK_QKV_BIAS=1 build: the default build is at its
// register limit (the branch alone spills a few bytes), and a model without biases never needs it. Not inlined:
// inlined into op_qkv_rope (its row loop or its rounding loop) the bias build spills 8-100 bytes, called it does not.
__device__ __noinline__ void add_row_bias(float* y0, float* y1, int nr, int lane, const bf16* b0, const bf16* b1) {
  for (int i = lane; i < nr; i += 32) {
    y0[i] = bf(y0[i] + w_bf16(b0 + i));
    y1[i] = bf(y1[i] + w_bf16(b1 + i));
  }
}

__device__ inline void op_qkv_rope(const Ctx& c) {
  const int64_t* a = c.rec;
  const bf16* x = ptr<const bf16>(a[A_QKV_ROPE_X]);
  const bf16* nw = ptr<const bf16>(a[A_QKV_ROPE_NORM]);
  const bf16* w = ptr<const bf16>(a[A_QKV_ROPE_W]);          // (D, K): this head's rows
  const bf16* hn = ptr<const bf16>(a[A_QKV_ROPE_HEAD_NORM]);  // (D,) or null (then nr == D / 2)
  const int which = (int)a[A_QKV_ROPE_WHICH], head = (int)a[A_QKV_ROPE_HEAD];
  const int M = (int)a[A_QKV_ROPE_M], K = (int)a[A_QKV_ROPE_K], D = (int)a[A_QKV_ROPE_D];
  const int r0 = (int)a[A_QKV_ROPE_R0], nr = (int)a[A_QKV_ROPE_NR], h2 = D / 2;
  const int n_kv = (int)a[A_QKV_ROPE_N_KV];
  const int64_t ldq = a[A_QKV_ROPE_LDQ];
  const float eps = f32(a[A_QKV_ROPE_EPS]);
  const float* inv_freq = ptr<const float>(c.P[P_INV_FREQ]);
  const int64_t* bt = ptr<const int64_t>(c.P[P_BLOCK_TABLES]);
  const int64_t max_pages = c.P[P_MAX_PAGES], ps = c.P[P_PAGE_SIZE];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  bf16* xs = reinterpret_cast<bf16*>(dyn_smem());
  float* y0s = linear_ytile(dyn_smem(), cc_xrows(M), K);  // (ROW_TILE, nr) fp32: head rows r0 + i
  float* y1s = y0s + ROW_TILE * nr;                // (ROW_TILE, nr) fp32: head rows h2 + r0 + i
  float* red = y0s + ROW_TILE * MAX_HEAD_DIM;      // Tensor Core k-slice partials (2 x 8 x 16 x 8 fp32)
  MPK_STAMP(0);
  for (int g0 = 0; g0 < M; g0 += ROW_TILE) {
    const int Mg = min(ROW_TILE, M - g0);
    load_rows_norm(xs, K, x + (int64_t)g0 * K, Mg, K, 0, 1, nw, eps);
    MPK_STAMP(1);
    if (Mg >= TC_MIN_M && K % 32 == 0)
      linear_tc_rows8(xs, K, Mg, K, w, w + (int64_t)h2 * K, r0, r0 + nr, (int)a[A_QKV_ROPE_KSLICES], y0s,
                      y1s, red);
    else
      linear_core<true>(xs, Mg, K, w, w + (int64_t)h2 * K, r0, r0 + nr, 1, y0s, y1s,
                        stage_off(a[T_STAGE]), stage_rows(a[T_STAGE]), c.stage_bar, c.stage_par);
    MPK_STAMP(2);
    for (int i = threadIdx.x; i < Mg * nr; i += THREADS) { y0s[i] = bf(y0s[i]); y1s[i] = bf(y1s[i]); }  // bf16 matmul result
    __syncthreads();
    for (int m = warp; m < Mg; m += nwarps) {
      const int row = g0 + m;  // decode: row == sequence
      const int64_t pos = seq_pos(c, row);
      float* y0 = y0s + m * nr;
      float* y1 = y1s + m * nr;
#if MPK_QKV_BIAS   // (Qwen2's build: the packer's needs) + the head's bias, before norm / rope
      if (a[A_QKV_ROPE_BIAS] != 0) {
        const bf16* hb = ptr<const bf16>(a[A_QKV_ROPE_BIAS]);
        add_row_bias(y0, y1, nr, lane, hb + r0, hb + h2 + r0);
        __syncwarp();
      }
#endif
      if (which == WHICH_Q || which == WHICH_K) {
        if (hn != nullptr) {  // whole head here (nr == h2): y0 = rows [0, h2), y1 = rows [h2, D)
          float ss = 0.f;
          for (int d = lane; d < nr; d += 32) { ss = fmaf(y0[d], y0[d], ss); ss = fmaf(y1[d], y1[d], ss); }
          ss = warp_sum(ss);
          const float r = rsqrtf(ss / (float)D + eps);
          for (int d = lane; d < nr; d += 32) {
            y0[d] = bf(w_bf16(hn + d) * bf(y0[d] * r));
            y1[d] = bf(w_bf16(hn + h2 + d) * bf(y1[d] * r));
          }
          __syncwarp();
        }
        for (int i = lane; i < nr; i += 32) {
          const float ang = (float)pos * inv_freq[r0 + i];
          const float cs = bf(cosf(ang)), sn = bf(sinf(ang));
          const float x1 = y0[i], x2 = y1[i];
          y0[i] = bf(bf(x1 * cs) + bf(-x2 * sn));
          y1[i] = bf(bf(x2 * cs) + bf(x1 * sn));
        }
        __syncwarp();
      }
      bf16* dst = nullptr;
      if (which == WHICH_Q || which == WHICH_RAW) {   // raw: q = the head's column block of qk_raw
        dst = ptr<bf16>(a[A_QKV_ROPE_Q]) + row * ldq + (int64_t)head * D;
      } else if (pos >= 0) {
        const int64_t page = ld_const_s64(bt + row * max_pages + pos / ps);
        dst = ptr<bf16>(a[A_QKV_ROPE_CACHE]) + kv_row(page, pos % ps, head, n_kv, ps, D);
      }
      if (dst != nullptr) {
        for (int i = lane; i < nr; i += 32) {
          dst[r0 + i] = __float2bfloat16_rn(y0[i]);
          dst[h2 + r0 + i] = __float2bfloat16_rn(y1[i]);
        }
      }
    }
    __syncthreads();
  }
}

// Whole normed heads from qk_raw: one warp per (row, head), qk_norm_rope_head (qk_norm.cuh) each.
__device__ inline void op_qk_norm_rope(const Ctx& c) {
  const int64_t* a = c.rec;
  const bf16* raw = ptr<const bf16>(a[A_QK_NORM_ROPE_RAW]);
  const int64_t ldraw = a[A_QK_NORM_ROPE_LDRAW], ldq = a[A_QK_NORM_ROPE_LDQ];
  const bf16* qn = ptr<const bf16>(a[A_QK_NORM_ROPE_Q_NORM]);
  const bf16* kn = ptr<const bf16>(a[A_QK_NORM_ROPE_K_NORM]);
  bf16* q = ptr<bf16>(a[A_QK_NORM_ROPE_Q]);
  bf16* cache = ptr<bf16>(a[A_QK_NORM_ROPE_CACHE]);
  const int M = (int)a[A_QK_NORM_ROPE_M], D = (int)a[A_QK_NORM_ROPE_D];
  const int n_kv = (int)a[A_QK_NORM_ROPE_N_KV], nq = (int)a[A_QK_NORM_ROPE_NQ];
  const int qh0 = (int)a[A_QK_NORM_ROPE_QH0], nqh = (int)a[A_QK_NORM_ROPE_NQH];
  const int kh0 = (int)a[A_QK_NORM_ROPE_KH0], nkh = (int)a[A_QK_NORM_ROPE_NKH];
  const float eps = f32(a[A_QK_NORM_ROPE_EPS]);
  const float* inv_freq = ptr<const float>(c.P[P_INV_FREQ]);
  const int64_t* bt = ptr<const int64_t>(c.P[P_BLOCK_TABLES]);
  const int64_t max_pages = c.P[P_MAX_PAGES], ps = c.P[P_PAGE_SIZE];
  const int warp = threadIdx.x >> 5, nwarps = THREADS / 32;
  const int heads = nqh + nkh;
  for (int it = warp; it < M * heads; it += nwarps) {
    const int row = it / heads, j = it % heads;
    const bool is_q = j < nqh;
    const int head = is_q ? qh0 + j : kh0 + (j - nqh);
    qk_norm_rope_head(raw + (int64_t)row * ldraw + (int64_t)(is_q ? head : nq + head) * D, is_q ? qn : kn, eps, D,
                      inv_freq, [&](int64_t& pos) -> bf16* {
      pos = seq_pos(c, row);   // decode: row == sequence
      if (is_q) return q + row * ldq + (int64_t)head * D;
      if (pos < 0) return nullptr;
      const int64_t page = ld_const_s64(bt + row * max_pages + pos / ps);
      return cache + kv_row(page, pos % ps, head, n_kv, ps, D);
    });
  }
}

}  // namespace mpk
