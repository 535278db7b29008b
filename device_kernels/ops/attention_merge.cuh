// attention's merge of key chunks: out[b, group g's heads] = the chunks of part weighted by exp(lse_s - max)
// (tasks/ops/attention.py _merge): the attn_merge task, and the folded merge an attn_partial runs when it takes its
// group's last ticket (attention.cuh op_attn_partial)
#pragma once
#include "../common.cuh"

namespace mpk {
constexpr int MERGE_CHUNK = 8;   // splits whose lse / partial loads are issued together
// out[b, group g's heads] = the chunks of part weighted by exp(lse_s - max) (tasks/ops/attention.py _merge).
// MPK_ATT_MERGE1=1 (opt-in; session 34, measured -0.1% at llama-3.2-1b in session 35 and removed, restored in session
// 36 for qwen3-8b): with S <= MERGE_CHUNK and at most two outputs a thread, every load of a thread's outputs (S lse and
// S parts each) is issued at once: one round trip where the loop below takes two per output (lse for the max, then
// lse and parts), i.e. two for llama's group (gs D = 256) and four for qwen3-8b's (512); the same arithmetic in the
// same order, so the same bits. Session 36's stamps (10-12 below) measured the loop's round trips at B=1 ctx 512:
// 0.64 us (lse) + 0.93-0.99 (parts, first output) + 1.50 (qwen3-8b's second output) after the ticket.
#ifndef MPK_ATT_MERGE1
#define MPK_ATT_MERGE1 0
#endif
__device__ inline void attn_merge_group(const float* part, const float* lse, bf16* out, int b, int g, int gs, int D,
                                        int nq, int S) {
  const int64_t m0 = b;
#if MPK_ATT_MERGE1
  if (S <= MERGE_CHUNK && gs * D <= 2 * THREADS) {
    float l[2][MERGE_CHUNK], pv[2][MERGE_CHUNK];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = threadIdx.x + e * THREADS, h = i / D, d = i % D;
      const int64_t hq = m0 * nq + g * gs + h;
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u) {
        const bool ok = i < gs * D && u < S;
        l[e][u] = ok ? ld_act_f32(lse + hq * S + u) : -INFINITY;
        pv[e][u] = ok ? ld_act_f32(part + (hq * S + u) * D + d) : 0.f;
      }
    }
    MPK_STAMP(10);   // (stage builds with K >= 16) every load issued
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = threadIdx.x + e * THREADS, h = i / D, d = i % D;
      if (i >= gs * D) break;
      float mx = -INFINITY;
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u)
        if (u < S) mx = fmaxf(mx, l[e][u]);
      if (isinf(mx)) mx = 0.f;
      float ws = 0.f, o = 0.f;
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u) {
        if (u < S) {
          const float wgt = expf(l[e][u] - mx);
          ws += wgt;
          o += pv[e][u] * wgt;
        }
      }
      out[m0 * (int64_t)nq * D + (int64_t)(g * gs + h) * D + d] = __float2bfloat16_rn(o / fmaxf(ws, 1e-30f));
      if (e == 0) MPK_STAMP(11);
    }
    MPK_STAMP(12);
    return;
  }
#endif
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
