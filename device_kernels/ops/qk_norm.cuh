// Qwen3's per-head q / k RMSNorm and RoPE of one whole head row from qk_raw (bf16 projections, as the whole-head
// qkv_rope path rounds them): op_qk_norm_rope's tasks (qkv_rope.cuh) and, with -DMPK_ATT_QKNORM=1, the attention
// partials that finish their own heads (attention.cuh; tasks/ops/attention.py) run the same code, so q and k are
// the same values either way.
#pragma once
#include "../common.cuh"

namespace mpk {

// One warp: the D values at src -> RMSNorm (weights hn, eps) -> RoPE at position pos -> dst (global or shared
// memory; nullptr: nothing stored, as for an inactive row's k), where `at(pos)` sets pos and returns dst (called
// after the sums). Lane owns head rows d = lane + 32 t of each half (the pairs RoPE mixes), so the sum of squares,
// the norm and RoPE run in the order of op_qkv_rope's whole-head branch. Every lane of the warp calls it (warp_sum).
template <typename At>
__device__ __forceinline__ void qk_norm_rope_head(const bf16* src, const bf16* hn, float eps, int D,
                                                  const float* inv_freq, At at) {
  constexpr int J = MAX_HEAD_DIM / 64;   // values per lane per half
  const int lane = threadIdx.x & 31, h2 = D / 2;
  float y0[J], y1[J];
  float ss = 0.f;
#pragma unroll
  for (int t = 0; t < J; ++t) {
    const int d = lane + 32 * t;
    y0[t] = d < h2 ? ld_act_bf16(src + d) : 0.f;
    y1[t] = d < h2 ? ld_act_bf16(src + h2 + d) : 0.f;
    if (d < h2) { ss = fmaf(y0[t], y0[t], ss); ss = fmaf(y1[t], y1[t], ss); }
  }
  ss = warp_sum(ss);
  const float r = rsqrtf(ss / (float)D + eps);
  int64_t pos = 0;
  bf16* dst = at(pos);
  if (dst == nullptr) return;
#pragma unroll
  for (int t = 0; t < J; ++t) {
    const int d = lane + 32 * t;
    if (d >= h2) continue;
    const float x1 = bf(w_bf16(hn + d) * bf(y0[t] * r)), x2 = bf(w_bf16(hn + h2 + d) * bf(y1[t] * r));
    const float ang = (float)pos * inv_freq[d];
    const float cs = bf(cosf(ang)), sn = bf(sinf(ang));
    dst[d] = __float2bfloat16_rn(bf(bf(x1 * cs) + bf(-x2 * sn)));
    dst[h2 + d] = __float2bfloat16_rn(bf(bf(x2 * cs) + bf(x1 * sn)));
  }
}

#if MPK_ATT_QKNORM
// n consecutive heads (D apart at src and at dst), one warp per head; a call of its own, so it stays out of the
// attention pass loop's register allocation (as attn_append_new_row).
__device__ __noinline__ void qk_norm_rope_heads(const bf16* src, const bf16* hn, float eps, int D, int64_t pos,
                                                const float* inv_freq, int n, bf16* dst) {
#pragma unroll 1
  for (int h = threadIdx.x >> 5; h < n; h += THREADS / 32)
    qk_norm_rope_head(src + (int64_t)h * D, hn, eps, D, inv_freq, [&](int64_t& p) { p = pos; return dst + (int64_t)h * D; });
}
#endif

}  // namespace mpk
