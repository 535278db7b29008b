// embed: out (M, H) = table[max(tokens, 0)]  (tasks/ops/embed.py)
#pragma once
#include "../common.cuh"

namespace mpk {
__device__ inline void op_embed(const Ctx& c) {
  const int64_t* a = c.rec;
  const int64_t* tokens = ptr<const int64_t>(a[A_EMBED_TOKENS]);
  const bf16* table = ptr<const bf16>(a[A_EMBED_TABLE]);
  bf16* out = ptr<bf16>(a[A_EMBED_OUT]);
  const int M = (int)a[A_EMBED_M], H = (int)a[A_EMBED_H];
  const int vec = H / 8;
  for (int i = threadIdx.x; i < M * vec; i += THREADS) {
    const int m = i / vec, k = (i % vec) * 8;
    int64_t t = ld_act_s64(tokens + m);
    t = t < 0 ? 0 : t;
    *reinterpret_cast<uint4*>(out + (int64_t)m * H + k) = ld_weight16(table + t * H + k);
  }
}
}  // namespace mpk
