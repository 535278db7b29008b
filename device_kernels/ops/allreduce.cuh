// allreduce (reduce half): out[:, n0:n1] = residual + sum over ranks of part[parity][r]  (tasks/ops/allreduce.py)
#pragma once
#include "../common.cuh"

namespace mpk {
__device__ inline void op_allreduce(const Ctx& c) {
  const int64_t* a = c.rec;
  const float* part = ptr<const float>(a[A_ALLREDUCE_PART] + c.parity * a[A_ALLREDUCE_PAR_STRIDE]);  // (W, M, N)
  const bf16* res = ptr<const bf16>(a[A_ALLREDUCE_RESIDUAL]);
  bf16* out = ptr<bf16>(a[A_ALLREDUCE_OUT]);
  const int W = (int)a[A_ALLREDUCE_WORLD], M = (int)a[A_ALLREDUCE_M], N = (int)a[A_ALLREDUCE_N];
  const int n0 = (int)a[A_ALLREDUCE_N0], n1 = (int)a[A_ALLREDUCE_N1], w = n1 - n0;
  for (int i = threadIdx.x; i < M * w; i += THREADS) {
    const int64_t m = i / w, n = n0 + i % w;
    float acc = ld_act_f32(part + m * N + n);
    for (int r = 1; r < W; ++r) acc += ld_act_f32(part + ((int64_t)r * M + m) * N + n);
    out[m * N + n] = __float2bfloat16_rn(ld_act_bf16(res + m * N + n) + bf(acc));
  }
}
}  // namespace mpk
