// Micro-benchmark of weight-streaming access patterns (scripts/bench_stream.py): does the order in which a linear
// tile's loads reach HBM, not the bytes in flight, set the Tensor Core tiles' rate? CTA b streams rows
// [b * rows, (b + 1) * rows) of a (N, K) bf16 matrix with the megakernel's evict-first 16-byte loads and folds every
// loaded word into a checksum (so each load is waited for, like an mma operand), three ways:
//   mode 0 "tc":   linear_tc_t's pattern: a warp owns a (16-row n-tile, k-slice) unit; per 32-wide k round
//                  thread (g, t) loads 16 B of rows g and g + 8 at k = 8t: one instruction = 8 rows x 64 B;
//                  two stages of H = 2 rounds in flight (v18c's software pipeline).
//   mode 1 "frag": the same units, stages and bytes, from a fragment-major layout (each 16-row x 32-k block of
//                  1 KB stored contiguously, in the order the lanes load it): one instruction = 512 B contiguous.
//   mode 2 "row":  linear_core_t's CUDA-core pattern: a warp streams one row at a time, 16 B per lane,
//                  UN = 8 vectors per lane in flight (4 KB of one row).
// The matrix is only memory here: modes 0 and 1 read the same bytes in different orders.
#include "common.cuh"

using namespace mpk;

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    mpk_bench_stream(const bf16* __restrict__ W, int N, int K, int rows, int mode, int wk, int iters,
                     unsigned* __restrict__ sink) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  const int g = lane >> 2, t = lane & 3;
  const int n0 = blockIdx.x * rows, n1 = min(N, n0 + rows);
  unsigned acc = 0;
  for (int it = 0; it < iters; ++it) {
    if (mode == 2) {
      constexpr int UN = 8;
      const int KV = K >> 3;   // 16-byte vectors per row
      for (int n = n0 + warp; n < n1; n += nwarps) {
        for (int base = lane; base < KV; base += 32 * UN) {
          uint4 v[UN];
#pragma unroll
          for (int u = 0; u < UN; ++u)
            v[u] = base + u * 32 < KV ? ld_weight_stream16(W + (int64_t)n * K + (base + u * 32) * 8) : make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int u = 0; u < UN; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
      }
      continue;
    }
    const int ntn = (n1 - n0) / 16, R = K / 32;
    const int ks = warp % wk, r0 = (R * ks) / wk, r1 = (R * (ks + 1)) / wk;
    constexpr int H = 2;
    for (int u = warp / wk; u < ntn; u += nwarps / wk) {
      const bf16* wa;
      const bf16* wb;
      int64_t step;   // elements between consecutive rounds
      if (mode == 0) {
        wa = W + (int64_t)(n0 + u * 16 + g) * K + 8 * t;
        wb = wa + 8 * (int64_t)K;
        step = 32;
      } else {
        wa = W + ((int64_t)(n0 / 16 + u) * R) * 512 + lane * 8;   // block (n-tile, round 0): 16 x 32 bf16
        wb = wa + 256;
        step = 512;
      }
      auto load = [&](int rr, uint4 (&A)[H], uint4 (&B)[H]) {
#pragma unroll
        for (int i = 0; i < H; ++i) {
          const bool ok = rr + i < r1;
          A[i] = ok ? ld_weight_stream16(wa + (rr + i) * step) : make_uint4(0, 0, 0, 0);
          B[i] = ok ? ld_weight_stream16(wb + (rr + i) * step) : make_uint4(0, 0, 0, 0);
        }
      };
      auto use = [&](const uint4 (&A)[H], const uint4 (&B)[H]) {
#pragma unroll
        for (int i = 0; i < H; ++i) acc += (A[i].x ^ A[i].y ^ A[i].z ^ A[i].w) + (B[i].x ^ B[i].y ^ B[i].z ^ B[i].w);
      };
      uint4 pa[H], pb[H], qa[H], qb[H];
      load(r0, pa, pb);
      for (int r = r0; r < r1; r += 2 * H) {
        load(r + H, qa, qb);
        use(pa, pb);
        load(r + 2 * H, pa, pb);
        use(qa, qb);
      }
    }
  }
  sink[blockIdx.x * THREADS + threadIdx.x] = acc;
}

// The paged KV cache's access pattern (scripts/bench_stream.py --pieces): a buffer of `rows` rows, each `heads`
// pieces of `piece` bytes side by side (a token-major page: (slot, head, D) -> piece = D x 2 bytes of one head;
// head-major: (head, slot, D) -> piece = page_size x D x 2 bytes). CTA b reads head b % heads of its share of the rows
// (rows split over gridDim.x / heads CTAs), as an attention task reads one KV head of its sequences, with UN
// 16-byte loads in flight per thread; every byte of the buffer is read once per iteration, by some CTA. Only the
// piece size (the contiguous run one CTA reads before it jumps heads x piece bytes) differs between runs.
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    mpk_bench_pieces(const uint8_t* __restrict__ buf, int64_t rows, int piece, int heads, int iters,
                     unsigned* __restrict__ sink) {
  constexpr int UN = 8;
  const int h = blockIdx.x % heads, ng = gridDim.x / heads, gi = blockIdx.x / heads;
  const int64_t r0 = rows * gi / ng, r1 = rows * (gi + 1) / ng;
  const int vpp = piece / 16, sh = __ffs(vpp) - 1;      // 16-byte vectors per piece (a power of two)
  const int64_t nv = (r1 - r0) * vpp, row_bytes = (int64_t)heads * piece;
  const uint8_t* base = buf + r0 * row_bytes + (int64_t)h * piece;
  unsigned acc = 0;
  for (int it = 0; it < iters; ++it) {
    for (int64_t v0 = threadIdx.x; v0 < nv; v0 += (int64_t)THREADS * UN) {
      uint4 v[UN];
#pragma unroll
      for (int u = 0; u < UN; ++u) {
        const int64_t i = v0 + (int64_t)u * THREADS;
        v[u] = i < nv ? ld_weight_stream16(base + (i >> sh) * row_bytes + (i & (vpp - 1)) * 16) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < UN; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
  }
  sink[blockIdx.x * THREADS + threadIdx.x] = acc;
}

// A CTA's `bytes` from src streamed the batch-1 linear tiles' way (16-byte evict-first loads, UN per thread in
// flight), folded into a checksum (so every load is waited for).
template <int UN>
__device__ __forceinline__ unsigned fold_regs(const uint8_t* __restrict__ src, int64_t bytes) {
  unsigned acc = 0;
  const int64_t nv = bytes >> 4;
  for (int64_t v0 = threadIdx.x; v0 < nv; v0 += (int64_t)THREADS * UN) {
    uint4 v[UN];
#pragma unroll
    for (int u = 0; u < UN; ++u) {
      const int64_t i = v0 + (int64_t)u * THREADS;
      v[u] = i < nv ? ld_weight_stream16(src + i * 16) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UN; ++u) acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  return acc;
}

// One decode phase's weight stream (scripts/bench_stream.py --phase): every CTA streams `bytes` contiguous bytes of
// its own (CTA b: [b bytes, (b + 1) bytes) of W) once and folds them into a checksum, two ways:
//   mode 0 "regs": the CUDA-core tiles' way, 16-byte evict-first loads into registers, UN = 16 per thread in flight
//                  (64 KB a CTA, what linear_core_t keeps in flight at batch 1: 8 x 16 B x 2 columns x 256 threads);
//   mode 1 "tma":  a producer thread streams the range in `chunk`-byte bulk copies (cp.async.bulk, mbarrier
//                  transaction counts) into a ring of `stages` shared-memory buffers, up to stages x chunk bytes in
//                  flight, and the 8 warps read each buffer from shared memory once it has landed.
// The question it answers for batch 1 (issue 3): how long a phase of 32 KB .. 1 MB a SM takes from its first
// instruction to the last byte, with 64 KB in flight and with up to ~200 KB. Each CTA stamps %globaltimer at its
// start and after its last byte (stamps[2b], stamps[2b + 1]): the phase is max(end) - min(start), the time a
// megakernel phase of that size would take once its dependencies are met (no launch, no host timer in it).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    mpk_bench_phase(const uint8_t* __restrict__ W, int64_t bytes, int mode, int chunk, int stages,
                    unsigned* __restrict__ sink, uint64_t* __restrict__ stamps) {
  constexpr int UN = 16, MAX_STAGES = 16;
  __syncthreads();
  if (threadIdx.x == 0) stamps[2 * blockIdx.x] = globaltimer();
  const uint8_t* src = W + (int64_t)blockIdx.x * bytes;
  unsigned acc = 0;
  if (mode == 0) {
    acc = fold_regs<UN>(src, bytes);
  } else {
    __shared__ __align__(8) uint64_t bars[MAX_STAGES];
    if (stages > MAX_STAGES) __trap();
    const uint32_t buf = smem_addr(dyn_smem());
    const int chunks = (int)((bytes + chunk - 1) / chunk);
    if (threadIdx.x == 0) {
      for (int s = 0; s < stages; ++s) mbar_init(smem_addr(&bars[s]));
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto issue = [&](int c) {   // chunk c into stage c % stages (thread 0)
      const int s = c % stages;
      const uint32_t n = (uint32_t)min((int64_t)chunk, bytes - (int64_t)c * chunk), bar = smem_addr(&bars[s]);
      mbar_expect_tx(bar, n);
      bulk_g2s(buf + (uint32_t)s * chunk, src + (int64_t)c * chunk, n, bar);
    };
    if (threadIdx.x == 0)
      for (int c = 0; c < min(stages, chunks); ++c) issue(c);
    for (int c = 0; c < chunks; ++c) {
      const int s = c % stages;
      mbar_wait(smem_addr(&bars[s]), (uint32_t)((c / stages) & 1));
      const int n = (int)min((int64_t)chunk, bytes - (int64_t)c * chunk) >> 4;
      const uint4* p = reinterpret_cast<const uint4*>(dyn_smem() + (size_t)s * chunk);
      for (int i = threadIdx.x; i < n; i += THREADS) { const uint4 v = p[i]; acc += v.x ^ v.y ^ v.z ^ v.w; }
      __syncthreads();   // every warp is done with stage s: refill it
      if (threadIdx.x == 0 && c + stages < chunks) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic-proxy reads before the async write
        issue(c + stages);
      }
    }
  }
  sink[blockIdx.x * THREADS + threadIdx.x] = acc;
  __syncthreads();   // every thread's bytes have landed (each folded them into acc)
  if (threadIdx.x == 0) stamps[2 * blockIdx.x + 1] = globaltimer();
}

// A batch-1 layer's chain of dependent phases (scripts/bench_stream.py --chain): `P` phases a layer, `layers`
// layers; in phase p CTA b streams bytes[p] of its own (op-major: layer l's op p holds every CTA's share back to
// back, CTA b's at b x bytes[p], as a weight matrix's row tiles), and a CTA starts phase p only after every CTA has
// finished the phase before (a counter per phase: release add / acquire spin, as the megakernel's events). What it
// answers for batch 1 (issue 3): today's structure pays every phase's ramp and every wait with HBM idle; weights do
// not depend on activations, so a producer can stream the next phase's bytes during the wait.
//   mode 0 "regs":     all 8 warps, after the wait: 16-byte evict-first loads, UN = 16 per thread in flight (the
//                      batch-1 linear tiles' way, 64 KiB a CTA), folded into a checksum.
//   mode 1 "producer": one thread of warp 0 streams every phase of every layer in order, in `chunk`-byte bulk copies
//                      into a ring of `stages` shared buffers (a full mbarrier per stage: transaction bytes; an empty
//                      one: an arrive per consumer warp), and never waits on the phase counters; warps 1-7 wait for
//                      the phase's counter, then take the ring's chunks of that phase.
//   mode 2 "early":    mode 0 with each thread's first round (UN loads) of a phase issued before its wait.
//   mode 3 "task":     mode 0 plus a batch-1 linear task's two ends, the megakernel's own code where it has one: x
//                      (ks[p] bf16 of the phase before's output, L2) loaded and, at the phases in norm_mask, RMSNorm'd
//                      (load_rows_norm), every weight vector dotted with x from shared memory, the CTA's rows' sums
//                      through shared memory into its bf16 outputs (+ a residual read at the phases in res_mask),
//                      then the signal. So mode 3 against mode 0 is what a task's ends cost in the chain.
//   mode 4 "task early": mode 3 with the first weight round in flight before the wait and the x load (session 25's
//                      MPK_LIN_EARLY, here without the megakernel's register limit).
//   mode 5 "l2pf":     mode 0 with the first round's bytes (64 KiB) bulk-prefetched into L2 by thread 0 before the
//                      wait (the megakernel's PF_CUR path: no registers held across the wait).
//   mode 6 "l1pf":     mode 0 with each thread's first-round lines prefetched into L1 (prefetch.global.L1, every
//                      thread its own 16 loads' lines) before the wait: no registers held, the SM's own cache.
// act: three slabs of act_stride bf16 (phase i reads slab i & 1, writes slab (i + 1) & 1; slab 2 the residual).
// Stamps, per CTA (stamps[b * (2 + layers * P) + i]): 0 its start, 1 its end, 2 + l * P + p when it signalled phase
// (l, p) done. A wait past timeout_ns writes err[0] (1: a phase counter, 2: a free ring stage, 3: a landed chunk)
// and traps (the launch fails; a hung benchmark would hold the GPU).
namespace {
constexpr int CHAIN_MAX_P = 8, CHAIN_MAX_STAGES = 32;

__device__ __forceinline__ void mbar_init_n(uint32_t bar, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void chain_fail(int* err, int code) {
  atomicExch(err, code);
  __threadfence();
  __trap();
}
// mbar_wait with a deadline (globaltimer ns)
__device__ __forceinline__ void mbar_wait_until(uint32_t bar, uint32_t par, uint64_t deadline, int* err, int code) {
  uint32_t done;
  for (int i = 0;; ++i) {
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done) : "r"(bar), "r"(par) : "memory");
    if (done) return;
    if ((i & 255) == 255 && globaltimer() > deadline) chain_fail(err, code);
  }
}
__device__ __forceinline__ void counter_wait_until(const uint64_t* c, uint64_t target, uint64_t deadline, int* err) {
  for (int i = 0; ld_acquire_u64(c) < target; ++i)
    if ((i & 63) == 63 && globaltimer() > deadline) chain_fail(err, 1);
}
// One round of a thread's 16-byte evict-first loads (vectors v0, v0 + THREADS, ...), as fold_regs issues them
template <int UN>
__device__ __forceinline__ void load_round(const uint8_t* __restrict__ src, int64_t nv, int64_t v0, uint4 (&v)[UN]) {
#pragma unroll
  for (int u = 0; u < UN; ++u) {
    const int64_t i = v0 + (int64_t)u * THREADS;
    v[u] = i < nv ? ld_weight_stream16(src + i * 16) : make_uint4(0, 0, 0, 0);
  }
}
// ... and its use: folded into a checksum, or (xs: x in shared memory, kv = K / 8 >= THREADS vectors a row) dotted
// with x (vector i of the CTA's rows takes x's vector i mod kv: one modulo a round, then steps of THREADS)
template <int UN>
__device__ __forceinline__ unsigned use_round(const uint4 (&v)[UN], int64_t nv, int64_t v0, const bf16* xs,
                                              uint32_t kv, float& f) {
  unsigned acc = 0;
  uint32_t k8 = xs != nullptr ? (uint32_t)(v0 % kv) : 0u;
#pragma unroll
  for (int u = 0; u < UN; ++u) {
    const int64_t i = v0 + (int64_t)u * THREADS;
    if (xs == nullptr) {
      acc += v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    } else {
      if (i < nv) f = dot8(v[u], *reinterpret_cast<const uint4*>(xs + k8 * 8), f);
      k8 += THREADS;
      if (k8 >= kv) k8 -= kv;
    }
  }
  return acc;
}
__device__ __forceinline__ void consumers_sync() {   // warps 1-7 only (named barrier 1)
  asm volatile("bar.sync 1, %0;" ::"r"(THREADS - 32) : "memory");
}
}  // namespace

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    mpk_bench_chain(const uint8_t* __restrict__ W, const int64_t* __restrict__ bytes, int P, int layers, int mode,
                    int chunk, int stages, uint64_t* __restrict__ counters, unsigned* __restrict__ sink,
                    uint64_t* __restrict__ stamps, int* __restrict__ err, uint64_t timeout_ns,
                    const int64_t* __restrict__ ks, bf16* __restrict__ act, int64_t act_stride,
                    const bf16* __restrict__ gamma, int norm_mask, int res_mask) {
  constexpr int UN = 16;
  __shared__ __align__(8) uint64_t full[CHAIN_MAX_STAGES], empty[CHAIN_MAX_STAGES];
  __shared__ int64_t off[CHAIN_MAX_P + 1];   // op p of a layer starts at ncta x off[p]; a layer is ncta x off[P]
  const int b = blockIdx.x, ncta = gridDim.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int nst = 2 + layers * P;
  if (P > CHAIN_MAX_P || stages > CHAIN_MAX_STAGES) __trap();
  const uint64_t deadline = globaltimer() + timeout_ns;
  if (tid == 0) {
    stamps[(int64_t)b * nst] = globaltimer();
    off[0] = 0;
    for (int p = 0; p < P; ++p) off[p + 1] = off[p] + bytes[p];
  }
  const uint32_t buf = smem_addr(dyn_smem());
  if (mode == 1 && tid == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init_n(smem_addr(&full[s]), 1);
      mbar_init_n(smem_addr(&empty[s]), THREADS / 32 - 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto src = [&](int l, int p) { return W + (int64_t)ncta * (l * off[P] + off[p]) + (int64_t)b * bytes[p]; };
  unsigned acc = 0;
  if (mode != 1) {   // registers (mode 0: no extras; 2-6 as above)
    const bool early = mode == 2 || mode == 4, task = mode == 3 || mode == 4;
    __shared__ float fs[THREADS / 32];
    bf16* xs = reinterpret_cast<bf16*>(dyn_smem());
    for (int l = 0; l < layers; ++l) {
      for (int p = 0; p < P; ++p) {
        const int idx = l * P + p;
        const uint8_t* s = src(l, p);
        const int64_t nv = bytes[p] >> 4;
        const int K = task ? (int)ks[p] : 8;
        uint4 v[UN];
        if (early) load_round<UN>(s, nv, tid, v);
        if (mode == 5 && tid == 0) prefetch_l2_range(s, min(bytes[p], (int64_t)THREADS * UN * 16));
        if (mode == 6)   // a 128-byte line holds 8 threads' vectors: every 8th thread prefetches its line per load
#pragma unroll
          for (int u = 0; u < UN; ++u) {
            const int64_t i = tid + (int64_t)u * THREADS;
            if ((tid & 7) == 0 && i < nv) prefetch_l1(s + i * 16);
          }
        if (idx > 0) {
          if (tid == 0) counter_wait_until(&counters[idx - 1], (uint64_t)ncta, deadline, err);
          __syncthreads();
        }
        if (task)
          load_rows_norm(xs, K, act + (idx & 1) * act_stride, 1, K, 0, 0, (norm_mask >> p) & 1 ? gamma : nullptr,
                         1e-5f);
        if (!early) load_round<UN>(s, nv, tid, v);
        float f = 0.f;
        for (int64_t v0 = tid;;) {
          acc += use_round<UN>(v, nv, v0, task ? xs : nullptr, (uint32_t)(K >> 3), f);
          v0 += (int64_t)THREADS * UN;
          if (v0 >= nv) break;
          load_round<UN>(s, nv, v0, v);
        }
        if (task) {   // the rows' sums through shared memory into the CTA's outputs, as linear_epilogue's stores
          f = warp_sum(f);
          if (lane == 0) fs[warp] = f;
          __syncthreads();
          const int rows = max(1, (int)(bytes[p] / (2 * (int64_t)K)));
          bf16* out = act + ((idx + 1) & 1) * act_stride + (int64_t)b * rows;
          for (int t = tid; t < rows; t += THREADS) {
            float y = bf(fs[t & (THREADS / 32 - 1)]);
            if ((res_mask >> p) & 1) y += ld_act_bf16(act + 2 * act_stride + (int64_t)b * rows + t);
            out[t] = __float2bfloat16_rn(y);
          }
        }
        __syncthreads();   // the CTA's share of the phase is in
        if (tid == 0) {
          red_release_add_u64(&counters[idx], 1ull);
          stamps[(int64_t)b * nst + 2 + idx] = globaltimer();
        }
      }
    }
  } else if (warp == 0) {   // the producer: every chunk of every phase, in order, only ever waiting for a free stage
    if (lane == 0) {
      int c = 0;
      for (int l = 0; l < layers; ++l)
        for (int p = 0; p < P; ++p) {
          const uint8_t* s = src(l, p);
          for (int64_t o = 0; o < bytes[p]; o += chunk, ++c) {
            const int st = c % stages;
            if (c >= stages) mbar_wait_until(smem_addr(&empty[st]), (uint32_t)((c / stages - 1) & 1), deadline, err, 2);
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");   // generic reads before the async write
            const uint32_t n = (uint32_t)min((int64_t)chunk, bytes[p] - o), bar = smem_addr(&full[st]);
            mbar_expect_tx(bar, n);
            bulk_g2s(buf + (uint32_t)st * chunk, s + o, n, bar);
          }
        }
    }
    __syncwarp();
  } else {   // the consumers: warps 1-7
    const int ct = tid - 32, ncons = THREADS - 32;
    int c = 0;
    for (int l = 0; l < layers; ++l) {
      for (int p = 0; p < P; ++p) {
        const int idx = l * P + p;
        if (idx > 0) {
          if (ct == 0) counter_wait_until(&counters[idx - 1], (uint64_t)ncta, deadline, err);
          consumers_sync();
        }
        for (int64_t o = 0; o < bytes[p]; o += chunk, ++c) {
          const int st = c % stages;
          mbar_wait_until(smem_addr(&full[st]), (uint32_t)((c / stages) & 1), deadline, err, 3);
          const int n = (int)min((int64_t)chunk, bytes[p] - o) >> 4;
          const uint4* q = reinterpret_cast<const uint4*>(dyn_smem() + (size_t)st * chunk);
          for (int i = ct; i < n; i += ncons) { const uint4 v = q[i]; acc += v.x ^ v.y ^ v.z ^ v.w; }
          __syncwarp();
          if (lane == 0) mbar_arrive(smem_addr(&empty[st]));
        }
        consumers_sync();   // every consumer warp has taken the CTA's share of the phase
        if (ct == 0) {
          red_release_add_u64(&counters[idx], 1ull);
          stamps[(int64_t)b * nst + 2 + idx] = globaltimer();
        }
      }
    }
  }
  sink[(int64_t)b * THREADS + tid] = acc;
  __syncthreads();
  if (tid == 0) stamps[(int64_t)b * nst + 1] = globaltimer();
}
