// Micro-benchmark of the megakernel's in-kernel all-reduce (scripts/bench_allreduce.py): the same device path
// as a row-parallel linear tile + allreduce task — fp32 partials stored into slot `me` of every rank's
// parity-doubled symmetric buffer through nvshmem_ptr peer addresses, a barrier, then signal_counter() on every
// rank's counter (red.release.sys for peers: cumulative over the barrier-ordered stores, no separate fence, as the
// megakernel since v17), ld.acquire.sys bounded spin, sum of the slots in rank order.
// CTA b owns elements [b*chunk, (b+1)*chunk); each iteration feeds the previous result back (a dependent chain),
// so iterations cannot overlap: (t_end - t_first) / (iters - 1) is the latency of one all-reduce.
#include "common.cuh"

using namespace mpk;

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    mpk_bench_allreduce(const int64_t* __restrict__ peers, const int64_t* __restrict__ ctr_peers, float* x,
                        float* out, int n, int chunk, int W, int me, int iters, int64_t step0, int64_t par_stride,
                        uint64_t timeout_ns, int64_t* status, uint64_t* times) {
  __shared__ int s_abort;
  const int b = blockIdx.x;
  const int i0 = b * chunk, i1 = min(n, i0 + chunk);
  uint64_t* my_ctr = ptr<uint64_t>(ctr_peers[me]) + b;
  for (int it = 0; it < iters; ++it) {
    const int64_t s = step0 + it;
    const int parity = (int)(s & 1);
    const float* src = it == 0 ? x : out;
    for (int i = i0 + threadIdx.x * 4; i < i1; i += THREADS * 4) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(src + i));
      for (int p = 0; p < W; ++p)
        *reinterpret_cast<float4*>(ptr<float>(peers[p] + parity * par_stride) + (int64_t)me * n + i) = v;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int p = 0; p < W; ++p)
        signal_counter(p == me ? (int64_t)(uintptr_t)my_ctr
                               : ((ctr_peers[p] + 8 * (int64_t)b) | SIGNAL_REMOTE_BIT));
      const int64_t need = (int64_t)W * s;
      int abort = 0;
      const uint64_t t0 = globaltimer();
      for (uint32_t k = 1; (int64_t)ld_acquire_sys_u64(my_ctr) < need; ++k) {
        if ((k & 255) == 0 && globaltimer() - t0 > timeout_ns) {
          atomicExch(reinterpret_cast<unsigned long long*>(status), 1ull);
          abort = 1;
          break;
        }
      }
      s_abort = abort;
      if (b == 0 && it == 0) times[0] = globaltimer();
    }
    __syncthreads();
    if (s_abort) return;
    const float* buf = ptr<const float>(peers[me] + parity * par_stride);
    for (int i = i0 + threadIdx.x * 4; i < i1; i += THREADS * 4) {
      float4 acc = __ldcg(reinterpret_cast<const float4*>(buf + i));
      for (int r = 1; r < W; ++r) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(buf + (int64_t)r * n + i));
        acc.x += v.x; acc.y += v.y; acc.z += v.z; acc.w += v.w;
      }
      acc.x *= 0.5f; acc.y *= 0.5f; acc.z *= 0.5f; acc.w *= 0.5f;
      *reinterpret_cast<float4*>(out + i) = acc;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0 && b == 0) times[1] = globaltimer();
}

// The LL ("low latency") protocol, as a candidate for the megakernel's all-reduce: every 8 bytes a rank stores into
// a peer's slot carry a 4-byte fp32 partial and a 4-byte flag (the step number), two pairs per 16-byte volatile
// store; the receiver polls its own buffer until every pair it reads carries this step's flag, then sums the
// slots in rank order. No fence and no counter: one NVLink trip instead of the data's trip, the fence's acks and
// the counter add. A 16-byte store may land as two 8-byte halves, so each half has its own flag. Flags are step
// numbers (never reset, never 0), slots are parity-doubled (a rank can be at most one step ahead: it needs the
// peer's data of this step before it writes the next). Thread t sends and receives the same elements, so no
// barrier is needed between steps. par_stride: bytes of one parity (W slots x n elements x 8 bytes).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    mpk_bench_allreduce_ll(const int64_t* __restrict__ peers, float* x, float* out, int n, int chunk, int W, int me,
                           int iters, int64_t step0, int64_t par_stride, uint64_t timeout_ns, int64_t* status,
                           uint64_t* times) {
  const int b = blockIdx.x;
  const int i0 = b * chunk, i1 = min(n, i0 + chunk);
  for (int it = 0; it < iters; ++it) {
    const int64_t s = step0 + it;
    const uint32_t flag = (uint32_t)s;
    const int64_t poff = (s & 1) * par_stride;
    const float* src = it == 0 ? x : out;
    for (int i = i0 + threadIdx.x * 2; i < i1; i += THREADS * 2) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(src + i));
      for (int p = 0; p < W; ++p) {
        uint32_t* dst = reinterpret_cast<uint32_t*>(peers[p] + poff) + ((int64_t)me * n + i) * 2;
        asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(__float_as_uint(v.x)),
                     "r"(flag), "r"(__float_as_uint(v.y)), "r"(flag) : "memory");
      }
    }
    const uint32_t* buf = reinterpret_cast<const uint32_t*>(peers[me] + poff);
    for (int i = i0 + threadIdx.x * 2; i < i1; i += THREADS * 2) {
      float ax = 0.f, ay = 0.f;
      for (int r = 0; r < W; ++r) {
        uint32_t v0, f0, v1, f1;
        const uint64_t t0 = globaltimer();
        for (uint32_t k = 1;; ++k) {
          asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                       : "=r"(v0), "=r"(f0), "=r"(v1), "=r"(f1) : "l"(buf + ((int64_t)r * n + i) * 2) : "memory");
          if (f0 == flag && f1 == flag) break;
          if ((k & 1023) == 0 && globaltimer() - t0 > timeout_ns) {
            atomicExch(reinterpret_cast<unsigned long long*>(status), 1ull);
            return;
          }
        }
        ax = r == 0 ? __uint_as_float(v0) : ax + __uint_as_float(v0);
        ay = r == 0 ? __uint_as_float(v1) : ay + __uint_as_float(v1);
      }
      *reinterpret_cast<float2*>(out + i) = make_float2(ax * 0.5f, ay * 0.5f);
    }
    if (b == 0 && threadIdx.x == 0 && it == 0) times[0] = globaltimer();
  }
  if (threadIdx.x == 0 && b == 0) times[1] = globaltimer();
}
