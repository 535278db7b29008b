// embed: out (M, H) = table[clamp(tokens, 0, rows - 1)]  (tasks/ops/embed.py: a NaN row's PAD_INDEX fed back)
#pragma once
#include "../common.cuh"

namespace mpk {
__device__ inline void op_embed(const Ctx& c) {
  const int64_t* a = c.rec;
  const int64_t* tokens = ptr<const int64_t>(a[A_EMBED_TOKENS]);
  const bf16* table = ptr<const bf16>(a[A_EMBED_TABLE]);
  bf16* out = ptr<bf16>(a[A_EMBED_OUT]);
  const int M = (int)a[A_EMBED_M], H = (int)a[A_EMBED_H];
  const int64_t last = a[A_EMBED_ROWS] - 1;
  const int vec = H / 8;
  for (int i = threadIdx.x; i < M * vec; i += THREADS) {
    const int m = i / vec, k = (i % vec) * 8;
    int64_t t = ld_act_s64(tokens + m);
    t = t < 0 ? 0 : (t > last ? last : t);
    *reinterpret_cast<uint4*>(out + (int64_t)m * H + k) = ld_weight16(table + t * H + k);
  }
}
}  // namespace mpk
