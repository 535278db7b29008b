// allreduce (reduce half): out[:, n0:n1] = residual + sum over ranks of part[parity][r]  (tasks/ops/allreduce.py)
#pragma once
#include "../common.cuh"

namespace mpk {
#if MPK_AR_LL
// LL words (fp32, step flag), polled until each flag is this step's (tasks/ops/allreduce.py). Out of line: the
// kernel's registers are at their limit.
__device__ __noinline__ void allreduce_ll(const Ctx& c) {
  const int64_t* a = c.rec;
  const bf16* res = ptr<const bf16>(a[A_ALLREDUCE_RESIDUAL]);
  bf16* out = ptr<bf16>(a[A_ALLREDUCE_OUT]);
  const int W = (int)a[A_ALLREDUCE_WORLD], M = (int)a[A_ALLREDUCE_M], N = (int)a[A_ALLREDUCE_N];
  const int n0 = (int)a[A_ALLREDUCE_N0], n1 = (int)a[A_ALLREDUCE_N1], w = n1 - n0;
  const uint32_t* words = ptr<const uint32_t>(a[A_ALLREDUCE_PART] + c.parity * a[A_ALLREDUCE_PAR_STRIDE]);
  const uint32_t flag = (uint32_t)c.step;
  int64_t* status = ptr<int64_t>(c.P[P_STATUS]);
  const uint64_t timeout_ns = (uint64_t)c.P[P_TIMEOUT_NS];
  for (int i = threadIdx.x; i < M * w; i += THREADS) {
    const int64_t m = i / w, n = n0 + i % w;
    float acc = 0.f;
    for (int r = 0; r < W; ++r) {
      const uint32_t* wd = words + (((int64_t)r * M + m) * N + n) * 2;
      uint32_t v, f;
      const uint64_t t0 = globaltimer();
      for (uint32_t k = 1;; ++k) {
        asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v), "=r"(f) : "l"(wd) : "memory");
        if (f == flag) break;
        if ((k & 1023) == 0) {   // bounded, as every wait: record it (the event field names no event: -1)
          if (ld_volatile_s64(status + S_FLAG) != STATUS_OK) return;
          const uint64_t el = globaltimer() - t0;
          if (el > timeout_ns) {
            if (atomicCAS(reinterpret_cast<unsigned long long*>(status + S_FLAG), 0ull,
                          (unsigned long long)STATUS_TIMEOUT) == 0ull) {
              status[S_SM] = blockIdx.x; status[S_TASK] = c.rec[T_TASK_ID]; status[S_EVENT] = -1;
              status[S_COUNTER] = (int64_t)f; status[S_NEEDED] = (int64_t)flag; status[S_STEP] = c.step;
              status[S_ELAPSED_NS] = (int64_t)el;
              __threadfence();
            }
            return;
          }
        }
      }
      acc = r == 0 ? __uint_as_float(v) : acc + __uint_as_float(v);
    }
    out[m * N + n] = __float2bfloat16_rn(ld_act_bf16(res + m * N + n) + bf(acc));
  }
}
#endif

__device__ inline void op_allreduce(const Ctx& c) {
  const int64_t* a = c.rec;
  const float* part = ptr<const float>(a[A_ALLREDUCE_PART] + c.parity * a[A_ALLREDUCE_PAR_STRIDE]);  // (W, M, N)
  const bf16* res = ptr<const bf16>(a[A_ALLREDUCE_RESIDUAL]);
  bf16* out = ptr<bf16>(a[A_ALLREDUCE_OUT]);
  const int W = (int)a[A_ALLREDUCE_WORLD], M = (int)a[A_ALLREDUCE_M], N = (int)a[A_ALLREDUCE_N];
  const int n0 = (int)a[A_ALLREDUCE_N0], n1 = (int)a[A_ALLREDUCE_N1], w = n1 - n0;
#if MPK_AR_LL
  if (a[A_ALLREDUCE_LL] != 0) {
    allreduce_ll(c);
    return;
  }
#endif
  for (int i = threadIdx.x; i < M * w; i += THREADS) {
    const int64_t m = i / w, n = n0 + i % w;
    float acc = ld_act_f32(part + m * N + n);
    for (int r = 1; r < W; ++r) acc += ld_act_f32(part + ((int64_t)r * M + m) * N + n);
    out[m * N + n] = __float2bfloat16_rn(ld_act_bf16(res + m * N + n) + bf(acc));
  }
}
}  // namespace mpk
