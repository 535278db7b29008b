// weight_prefetch: up to 11 weight byte ranges pulled into L2 (tasks/ops/prefetch.py): thread 0 issues bulk L2
// prefetches (cp.async.bulk.prefetch.L2, 32 KB each; no completion, no shared memory, no registers held) and the
// task ends; the linear tiles that stream those rows later find them in L2.
#pragma once
#include "../common.cuh"

namespace mpk {

__device__ inline void op_weight_prefetch(const Ctx& c) {
  if (threadIdx.x != 0) return;
  const int64_t* a = c.rec;
  const int n = (int)a[A_WEIGHT_PREFETCH_N];
  // the split of common.cuh prefetch_l2_range, written out: using the helper changes this reachable op's code, so
  // it waits for the next GPU-verified device change (session 10 kept the default build identical to 566c577's)
  for (int i = 0; i < n; ++i) {
    const int64_t base = a[A_WEIGHT_PREFETCH_P0 + 2 * i], nb = a[A_WEIGHT_PREFETCH_B0 + 2 * i];
    for (int64_t o = 0; o < nb; o += 32768) {
      const int64_t len = (nb - o) < 32768 ? (nb - o) : 32768;
      prefetch_l2_bulk(reinterpret_cast<const void*>(static_cast<uintptr_t>(base + o)), (uint32_t)len);
    }
  }
}

}  // namespace mpk
