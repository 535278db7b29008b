// attention's merge of key chunks: out[b, group g's heads] = the chunks of part weighted by exp(lse_s - max)
// (tasks/ops/attention.py _merge): the attn_merge task, and the folded merge an attn_partial runs when it takes its
// group's last ticket (attention.cuh op_attn_partial)
#pragma once
#include "../common.cuh"

namespace mpk {
constexpr int MERGE_CHUNK = 8;   // splits whose lse / partial loads are issued together
// out[b, group g's heads] = the chunks of part weighted by exp(lse_s - max) (tasks/ops/attention.py _merge).
__device__ inline void attn_merge_group(const float* part, const float* lse, bf16* out, int b, int g, int gs, int D,
                                        int nq, int S) {
  const int64_t m0 = b;
  for (int i = threadIdx.x; i < gs * D; i += THREADS) {
    const int h = i / D, d = i % D;
    const int64_t hq = m0 * nq + g * gs + h;
    // The splits in chunks of MERGE_CHUNK whose loads fly together: 2 S / MERGE_CHUNK round trips instead of 2 S
    // dependent ones; the arithmetic (max in split order, then weights and sums in split order) is unchanged.
    float mx = -INFINITY;
#pragma unroll 1
    for (int s0 = 0; s0 < S; s0 += MERGE_CHUNK) {
      float l[MERGE_CHUNK];
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u) l[u] = s0 + u < S ? ld_act_f32(lse + hq * S + s0 + u) : -INFINITY;
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u)
        if (s0 + u < S) mx = fmaxf(mx, l[u]);
    }
    if (isinf(mx)) mx = 0.f;
    if (i == 0) MPK_STAMP(10);   // (stage builds with K >= 16) thread 0's first output: the lse max (its 1st round trip)
    float ws = 0.f, o = 0.f;
#pragma unroll 1
    for (int s0 = 0; s0 < S; s0 += MERGE_CHUNK) {
      float l[MERGE_CHUNK], pv[MERGE_CHUNK];
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u) {
        l[u] = s0 + u < S ? ld_act_f32(lse + hq * S + s0 + u) : 0.f;
        pv[u] = s0 + u < S ? ld_act_f32(part + (hq * S + s0 + u) * D + d) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u) {
        if (s0 + u < S) {
          const float wgt = expf(l[u] - mx);
          ws += wgt;
          o += pv[u] * wgt;
        }
      }
    }
    out[m0 * (int64_t)nq * D + (int64_t)(g * gs + h) * D + d] = __float2bfloat16_rn(o / fmaxf(ws, 1e-30f));
    if (i == 0) MPK_STAMP(11);   // ... its first output written (the parts' round trip and the arithmetic)
  }
  MPK_STAMP(12);   // ... every output of thread 0 (qwen3-8b's 4 x 128 outputs are two a thread)
}

__device__ inline void op_attn_merge(const Ctx& c) {
  const int64_t* a = c.rec;
  MPK_STAMP(0);
  attn_merge_group(ptr<const float>(a[A_ATTN_MERGE_PART]), ptr<const float>(a[A_ATTN_MERGE_LSE]),
                   ptr<bf16>(a[A_ATTN_MERGE_OUT]), (int)a[A_ATTN_MERGE_B], (int)a[A_ATTN_MERGE_G],
                   (int)a[A_ATTN_MERGE_GS], (int)a[A_ATTN_MERGE_D], (int)a[A_ATTN_MERGE_NQ],
                   (int)a[A_ATTN_MERGE_SPLITS]);
  MPK_STAMP(1);
}

}  // namespace mpk
