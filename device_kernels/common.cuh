// Shared device helpers: memory-model primitives, bf16 rounding, vector loads, reductions.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>
#include "mpk_generated.h"

namespace mpk {

typedef __nv_bfloat16 bf16;

// Per-task context: the parameter block, the task's record, the global step and the step inside the launch; the
// shared address of the CTA's weight-stage mbarrier and the phase parity this task's staged rows complete.
struct Ctx {
  const int64_t* P;
  const int64_t* rec;
  int64_t step;
  int64_t lstep;
  int parity;
  uint32_t stage_bar;
  uint32_t stage_par;
};

// The CTA's dynamic shared memory. Ops take their shared-memory pointers from here, never through a pointer passed
// in a struct: across an out-of-line call the compiler cannot tell a struct member's pointer is shared, and it
// emitted generic LD/ST (long-scoreboard latency) for every shared access of op_linear_tc and of attention.
__device__ __forceinline__ unsigned char* dyn_smem() {
  extern __shared__ __align__(16) unsigned char mpk_dyn_smem[];
  return mpk_dyn_smem;
}

template <typename T>
__device__ __forceinline__ T* ptr(int64_t v) { return reinterpret_cast<T*>(static_cast<uintptr_t>(v)); }
__device__ __forceinline__ float f32(int64_t v) { return __int_as_float(static_cast<int>(v & 0xffffffff)); }

__device__ __forceinline__ uint64_t ld_acquire_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_add_u64(uint64_t* p, uint64_t v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// --- cross-rank (system scope) counterparts, for counters on the symmetric heap (world size > 1) -------------
// A wait on an event that another rank signals acquires at system scope (the remote producer releases there).
__device__ __forceinline__ uint64_t ld_acquire_sys_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_acquire_scoped_u64(const uint64_t* p, bool sys) {
  return sys ? ld_acquire_sys_u64(p) : ld_acquire_u64(p);
}
__device__ __forceinline__ void red_release_sys_add_u64(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
// One signal word of the task record (codegen/layout.py SIGNAL_REMOTE_BIT): a counter address; bit 0 set = the
// counter is a peer rank's (an nvshmem_ptr peer address over NVLink). Called by thread 0 after the CTA's barrier:
// the release add is cumulative over the CTA's stores that the barrier ordered before it (some of them peer
// stores), at system scope for a peer's counter, at gpu scope for a local one. No separate fence: each release
// add already compiles to its MEMBAR (.SYS / .GPU) before the RED.
__device__ __forceinline__ void signal_counter(int64_t word) {
  if (word & SIGNAL_REMOTE_BIT) {
    red_release_sys_add_u64(reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(word & ~(int64_t)SIGNAL_REMOTE_BIT)), 1ull);
  } else {
    red_release_add_u64(reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(word)), 1ull);
  }
}
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Stage stamps (diagnostic builds only: MPK_NVCC_DEFINES="-DMPK_STAGE_WORDS=K"): thread 0 writes the globaltimer
// at MPK_STAMP(k) points inside an op into this task's row of K words (after the trace's start/end words; the
// host reads them with Megakernel.stage_stamps()). Default builds compile every stamp to nothing.
#ifndef MPK_STAGE_WORDS
#define MPK_STAGE_WORDS 0
#endif
#if MPK_STAGE_WORDS > 0
__shared__ uint64_t* mpk_stage_row;   // set by thread 0 after the task's waits; null when this step is untraced
#define MPK_STAMP(k)                                                                              \
  do {                                                                                            \
    if (threadIdx.x == 0 && (k) < MPK_STAGE_WORDS && mpk_stage_row != nullptr)                    \
      mpk_stage_row[(k)] = globaltimer();                                                         \
  } while (0)
#else
#define MPK_STAMP(k) \
  do {               \
  } while (0)
#endif
__device__ __forceinline__ int64_t ld_volatile_s64(const int64_t* p) {
  int64_t v;
  asm volatile("ld.volatile.global.s64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// A word of the kernel's parameter block (the kernel's shared-memory copy), loaded where it is used (volatile: never
// hoisted into a register that would live across the task loop).
__device__ __forceinline__ int64_t param(const int64_t* P, int k) {
  return *reinterpret_cast<const volatile int64_t*>(P + k);
}

// Weights are immutable for the kernel's lifetime: read-only path, no L1 allocation (streamed once).
__device__ __forceinline__ uint4 ld_weight16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// The linear tiles' weight stream, loaded "cache streaming" (.cs: lines allocated evict-first in L1 and L2): a step
// streams far more weight bytes than L2 holds, and with the default policy they evict what is re-read - the
// kernel's instructions, activations, KV, counters - so a task's code and inputs would come from HBM again.
// (.cs rather than an L2::cache_hint policy operand: the policy's register made the kernel spill at 255; and
// L1::no_allocate with L2's default priority measured 22% slower at qwen3-8b batch 8, session 11.)
__device__ __forceinline__ uint4 ld_weight_stream16(const void* p) {
  uint4 r;
  asm volatile("ld.global.cs.nc.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
// L2 prefetch (no completion, no register result): a bulk range through the TMA unit, or one 128-byte line.
__device__ __forceinline__ void prefetch_l2_bulk(const void* p, uint32_t bytes) {  // p, bytes: multiples of 16
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}
__device__ __forceinline__ void prefetch_l2_line(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
// bytes of [p, p + bytes) into L2 in bulk prefetches of up to 32 KB (p and bytes multiples of 16).
__device__ __forceinline__ void prefetch_l2_range(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 32768) {
    const int64_t len = (bytes - o) < 32768 ? (bytes - o) : 32768;
    prefetch_l2_bulk(reinterpret_cast<const unsigned char*>(p) + o, (uint32_t)len);
  }
}
// Prefetch bytes [from, to) of each of a task's (up to two) weight ranges, pf = {ptr0, n0, ptr1, n1}.
__device__ inline void prefetch_task_weights(const int64_t* pf, int64_t from, int64_t to) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t base = pf[2 * r], n = pf[2 * r + 1];
    const int64_t e = to < n ? to : n;
    if (base == 0 || from >= e) continue;
    prefetch_l2_range(reinterpret_cast<const void*>(static_cast<uintptr_t>(base + from)), (e - from) & ~15LL);
  }
}

// --- weight staging (codegen/layout.py TASK_HEADER "stage"): TMA bulk copies global -> shared that complete on an
// mbarrier (transaction bytes), so they neither hold registers nor join the cp.async groups that load_rows_norm
// waits on. One mbarrier per CTA, arrival count 1; each staged task is one phase.
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// bytes (a multiple of 16, 16-byte aligned ends) from global src to shared dst, completing on bar
__device__ __forceinline__ void bulk_g2s(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
// Until the phase of parity `par` has completed (its bytes are then visible to the waiting thread).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t par) {
  uint32_t done;
  do {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(par) : "memory");
  } while (!done);
}
// The stage word's fields (codegen/layout.py pack_stage): rows staged per weight range, byte offset in shared memory.
__device__ __forceinline__ int stage_rows(int64_t sw) { return (int)(sw & 0xffffff); }
__device__ __forceinline__ int stage_off(int64_t sw) { return (int)((sw >> STAGE_OFF_SHIFT) & 0xffffff); }
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// x rows a CUDA-core linear / qkv_rope tile keeps in shared memory (codegen/layout.py cc_xrows)
__device__ __forceinline__ int cc_xrows(int M) { return M < TC_MIN_M ? M : ROW_TILE; }

// 16 bytes global -> shared without registers (cp.async.cg: L2 only, so it reads what other SMs wrote in this launch
// after an acquire, like ld.cg); ok == false zero-fills the 16 bytes and reads nothing.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* src, bool ok) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
// the same with the shared-memory address already converted (issue loops that advance it by a constant)
__device__ __forceinline__ void cp_async16_s(uint32_t smem_dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// 8 bytes through L1 (read-only data the host wrote before the launch: page tables)
__device__ __forceinline__ void cp_async8_ca(void* smem_dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Activations / KV / counters-protected data written earlier in this launch by other SMs: L2 (coherent) loads.
__device__ __forceinline__ uint4 ld_act16(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ float ld_act_bf16(const bf16* p) {
  unsigned short u = __ldcg(reinterpret_cast<const unsigned short*>(p));
  return __uint_as_float(static_cast<uint32_t>(u) << 16);
}
__device__ __forceinline__ float ld_act_f32(const float* p) { return __ldcg(p); }
__device__ __forceinline__ int64_t ld_act_s64(const int64_t* p) { return __ldcg(reinterpret_cast<const long long*>(p)); }

// D += A . B on Tensor Cores, one warp: m16n8k16 bf16 x bf16, fp32 accumulate (linear tiles, attention). Fragment
// layout: PTX ISA, "Matrix Fragments for mma.m16n8k16".
__device__ __forceinline__ void mma_bf16_16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                               uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Four 8x8 b16 matrices from shared memory, transposed (lanes 8i .. 8i + 7 address matrix i's rows): the A fragment
// of an m16n8k16 whose rows are the stored matrix's columns (attention's V^T).
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}
__device__ __forceinline__ float bf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }  // round to bf16
__device__ __forceinline__ float bf16_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
__device__ __forceinline__ float w_bf16(const bf16* p) { return __bfloat162float(*p); }  // weight scalar

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// dot of 8 bf16 weights (one 16-byte vector) with 8 bf16 activations
__device__ __forceinline__ float dot8(const uint4& w, const uint4& x, float acc) {
  acc = fmaf(bf16_lo(w.x), bf16_lo(x.x), acc); acc = fmaf(bf16_hi(w.x), bf16_hi(x.x), acc);
  acc = fmaf(bf16_lo(w.y), bf16_lo(x.y), acc); acc = fmaf(bf16_hi(w.y), bf16_hi(x.y), acc);
  acc = fmaf(bf16_lo(w.z), bf16_lo(x.z), acc); acc = fmaf(bf16_hi(w.z), bf16_hi(x.z), acc);
  acc = fmaf(bf16_lo(w.w), bf16_lo(x.w), acc); acc = fmaf(bf16_hi(w.w), bf16_hi(x.w), acc);
  return acc;
}

// Host-written, constant for a launch (positions, page tables): the read-only path, so an SM that reads the same
// words every layer hits L1 instead of making an L2 round trip before its first KV access.
__device__ __forceinline__ int64_t ld_const_s64(const int64_t* p) {
  int64_t v;
  asm volatile("ld.global.nc.s64 %0, [%1];" : "=l"(v) : "l"(p));
  return v;
}

// Row position of sequence b at this step (decode: T == 1); < 0 = inactive sequence. P_POS holds the launch's
// first-step positions (the kernel never writes it), so it is read as a launch constant.
__device__ __forceinline__ int64_t seq_pos(const Ctx& c, int b) {
  int64_t p = ld_const_s64(ptr<const int64_t>(c.P[P_POS]) + b);
  return p >= 0 ? p + c.lstep : p;
}

// Element offset of row (page, slot, head) of a paged K or V cache (runtime/memory.py KVStore): pages of
// (page, slot, head, D).
__device__ __forceinline__ int64_t kv_row(int64_t page, int64_t slot, int head, int n_kv, int64_t ps, int D) {
  return ((page * ps + slot) * n_kv + head) * (int64_t)D;
}

// One 16-byte vector of a normed row: xn = bf16(w * bf16(x * r)), in place in shared memory.
__device__ __forceinline__ void norm_vec16(bf16* dst, const uint4& wv, float r) {
  const uint4 v = *reinterpret_cast<const uint4*>(dst);
  const uint32_t u[4] = {v.x, v.y, v.z, v.w}, wu[4] = {wv.x, wv.y, wv.z, wv.w};
  uint32_t o[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float lo = bf(bf16_lo(wu[j]) * bf(bf16_lo(u[j]) * r));
    const float hi = bf(bf16_hi(wu[j]) * bf(bf16_hi(u[j]) * r));
    o[j] = (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
}

// Load rows [0, M) (M <= MAX_PASS_ROWS) of x (bf16, row r at x + (row_off + r*row_stride)*K), optionally RMSNorm'd
// with weight nw, into shared memory as bf16 rows of stride ldx (K, ldx multiples of 8). All threads share every row (16-byte vectors),
// so a batch-1 norm costs one pass over K by the whole CTA. Numerics of tasks/ops/common.py rms_norm:
// xn = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))). The norm weight does not depend on x: its first NORM_PRE vectors
// per thread are loaded with x and the rest prefetched to L1, so the norm pass does not start a second round trip.
// Ends with __syncthreads().
constexpr int NORM_PRE = 1;
__device__ inline void load_rows_norm(bf16* xs, int ldx, const bf16* x, int M, int K, int64_t row_off,
                                      int64_t row_stride, const bf16* nw, float eps) {
  __shared__ float red[MAX_PASS_ROWS][THREADS / 32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, KV = K >> 3;
  uint4 wpre[NORM_PRE];
#pragma unroll
  for (int j = 0; j < NORM_PRE; ++j) {
    const int k8 = threadIdx.x + j * THREADS;
    wpre[j] = (nw != nullptr && k8 < KV) ? ld_weight16(nw + k8 * 8) : make_uint4(0, 0, 0, 0);
  }
  if (nw != nullptr)  // the rest of this thread's norm weight towards L1 (no registers held), read after the barrier
    for (int k8 = threadIdx.x + NORM_PRE * THREADS; k8 < KV; k8 += THREADS) prefetch_l1(nw + k8 * 8);
  // Every row's vectors of this thread in flight at once (cp.async.cg: L2, as ld_act16; no registers held), one wait:
  // one round trip for the M x K tile instead of one per row and k step (session 10 stage stamps: 8-10 us per
  // Tensor Core tile at batch 8 before). A thread reads back only the vectors it copied, so its own wait orders them.
  for (int m = 0; m < M; ++m) {
    const bf16* xr = x + (row_off + m * row_stride) * (int64_t)K;
    bf16* dst = xs + (int64_t)m * ldx;
    for (int k8 = threadIdx.x; k8 < KV; k8 += THREADS) cp_async16(dst + k8 * 8, xr + k8 * 8, true);
  }
  cp_async_commit();
  cp_async_wait_all();
  MPK_STAMP(4);   // (stage-stamp builds) thread 0's x vectors landed
  for (int m = 0; m < M; ++m) {
    const bf16* dst = xs + (int64_t)m * ldx;
    float ss = 0.f;
    for (int k8 = threadIdx.x; k8 < KV; k8 += THREADS) {
      const uint4 v = *reinterpret_cast<const uint4*>(dst + k8 * 8);
      const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float a = bf16_lo(u[j]), b = bf16_hi(u[j]);
        ss = fmaf(a, a, ss); ss = fmaf(b, b, ss);
      }
    }
    if (nw != nullptr) {
      ss = warp_sum(ss);
      if (lane == 0) red[m][warp] = ss;
    }
  }
  __syncthreads();
  MPK_STAMP(5);   // every row's sums of squares
  if (nw == nullptr) return;
  // Each row's rstd once (thread m), then the norm weight vector by vector, each vector applied to all M rows: the
  // weight is read once per tile, not once per row (M dependent reads when the L1 prefetch does not hold).
  __shared__ float s_rstd[MAX_PASS_ROWS];
  if (threadIdx.x < M) {
    float tot = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) tot += red[threadIdx.x][w];
    s_rstd[threadIdx.x] = rsqrtf(tot / (float)K + eps);
  }
  __syncthreads();
  MPK_STAMP(6);   // rstd per row
#pragma unroll
  for (int j = 0; j < NORM_PRE; ++j) {  // same thread wrote these vectors above
    const int k8 = threadIdx.x + j * THREADS;
    if (k8 < KV)
      for (int m = 0; m < M; ++m) norm_vec16(xs + (int64_t)m * ldx + k8 * 8, wpre[j], s_rstd[m]);
  }
  constexpr int NWC = 4;   // weight vectors loaded together
  for (int k0 = threadIdx.x + NORM_PRE * THREADS; k0 < KV; k0 += NWC * THREADS) {
    uint4 wv[NWC];
#pragma unroll
    for (int c = 0; c < NWC; ++c) {
      const int k8 = k0 + c * THREADS;
      wv[c] = k8 < KV ? ld_weight16(nw + k8 * 8) : make_uint4(0, 0, 0, 0);   // L1 hits where the prefetch held
    }
#pragma unroll
    for (int c = 0; c < NWC; ++c) {
      const int k8 = k0 + c * THREADS;
      if (k8 < KV)
        for (int m = 0; m < M; ++m) norm_vec16(xs + (int64_t)m * ldx + k8 * 8, wv[c], s_rstd[m]);
    }
  }
  __syncthreads();
}

}  // namespace mpk
