// Micro-benchmark of a batch-1 MLP block at real shapes (scripts/bench_mlp.py): gate_up with SiLU-and-mul, then
// down with the residual, one CTA a tile, timed on the device (%globaltimer) from the first CTA's start to the
// block's last output. The question (docs/perf-notes.md sessions 36-37): what does the down projection cost when it
// is split along K and fused into the gate_up tile, against today's two dependent phases? Session 38 (H200): fused /
// phases 1.052 at llama-3.2-1b (+1.66 us a layer), 1.049 at qwen3-8b (+3.97 us), so MPK_MLP_FUSE was removed.
//   mode 0 "phases": today's megakernel structure. CTA b runs gate_up tile b with the megakernel's own core
//                    (linear_core<true>), writes its bf16 intermediate columns, signals a counter (release add);
//                    every CTA waits for all gate_up tiles (acquire spin, as wait_counter), loads the intermediate
//                    row and runs down tile b (linear_core<false> over K = I) + residual -> out.
//   mode 1 "fused":  CTA b runs gate_up tile b, keeps its intermediate columns [n0, n1) in shared memory, streams
//                    rows n0 .. n1 of the transposed down weight WdT (I, H): warp w owns output columns
//                    [w H / 8, (w + 1) H / 8), each lane 8 VPL of them, summed in fp32 over the tile's rows in order
//                    (no cross-warp reduction), adds them into the fp32 row acc (red.global.add.v4.f32: the
//                    cross-CTA order is the hardware's), and takes a ticket; the last CTA writes out = bf16(h + bf16(acc))
//                    and zeroes acc for the next launch.
//   mode 2 "fused, no finisher": mode 1 up to the atomics, then a release add on a counter (the event a consumer
//                    would wait on) and no ticket: the consumers would read h + acc themselves (session 36's form,
//                    which needs the residual stream in fp32). acc is left for the host (out is not written).
// Stamps per CTA (stamps[3 b + i]): 0 start, 1 gate_up tile done (its columns written / in shared memory), 2 done
// (mode 0: its down columns written; mode 1: its ticket taken, and for the last CTA out written; mode 2: its
// counter add issued).
// (Mode 3 "inplace", the down weight read in its own (H, I) layout by MPK_MLP_FUSE's down share, measured 1.155 /
// 1.223 in session 38 and went with it; git history has it.)
// Batch 1 only (the design's target); every CTA must be resident (grid <= SMs: the mode-0 barrier spins).
#include "common.cuh"
#include "ops/linear.cuh"

using namespace mpk;

namespace {
constexpr int MAX_H = 4096, MAX_I = 12288, MAX_COLS = 256;

__device__ __forceinline__ float silu_mul(float g, float u) {   // bf16 rounding points of the linear epilogue
  const float gb = bf(g), ub = bf(u);
  return bf(bf(gb / (1.f + __expf(-gb))) * ub);
}

__device__ __forceinline__ void red_add_v4(float* p, float a, float b, float c, float d) {   // no return value
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}

__device__ __forceinline__ void stamp(uint64_t* stamps, int i) {
  if (threadIdx.x == 0) stamps[3 * blockIdx.x + i] = globaltimer();
}

// Lane-owned output columns of the fused down slice: warp w's columns start at w * H / nwarps; lane l's vector v
// (v < VPL) covers columns c0 + 8 (l + 32 v) .. + 7. R rows' loads in flight (R x VPL 16-byte vectors a lane).
template <int VPL, int R>
__device__ __forceinline__ void down_slice(const bf16* __restrict__ WdT, int H, const float* a, int rows,
                                           float (&acc)[VPL][8], int c0) {
  const int lane = threadIdx.x & 31;
  for (int r0 = 0; r0 < rows; r0 += R) {
    uint4 v[R][VPL];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int q = 0; q < VPL; ++q)
        v[r][q] = r0 + r < rows ? ld_weight_stream16(WdT + (int64_t)(r0 + r) * H + c0 + 8 * (lane + 32 * q))
                                : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = r0 + r < rows ? a[r0 + r] : 0.f;
#pragma unroll
      for (int q = 0; q < VPL; ++q) {
        const uint32_t w[4] = {v[r][q].x, v[r][q].y, v[r][q].z, v[r][q].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          acc[q][2 * j] = fmaf(s, bf16_lo(w[j]), acc[q][2 * j]);
          acc[q][2 * j + 1] = fmaf(s, bf16_hi(w[j]), acc[q][2 * j + 1]);
        }
      }
    }
  }
}

template <int VPL>
__device__ __forceinline__ void down_fused(const bf16* __restrict__ WdT, int H, const float* a, int rows,
                                           float* __restrict__ accg) {
  constexpr int R = 8 / VPL;   // 8 vectors a lane in flight, as the CUDA-core linear pass (UNROLL)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  const int c0 = warp * (H / nwarps);
  float acc[VPL][8];
#pragma unroll
  for (int q = 0; q < VPL; ++q)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[q][j] = 0.f;
  down_slice<VPL, R>(WdT, H, a, rows, acc, c0);
#pragma unroll
  for (int q = 0; q < VPL; ++q) {
    float* dst = accg + c0 + 8 * (lane + 32 * q);
    red_add_v4(dst, acc[q][0], acc[q][1], acc[q][2], acc[q][3]);
    red_add_v4(dst + 4, acc[q][4], acc[q][5], acc[q][6], acc[q][7]);
  }
}
}  // namespace

// x (H) bf16: the normed input row; Wg, Wu (I, H); Wd (H, I) (mode 0); WdT (I, H) (mode 1); h (H) the residual;
// inter (I) bf16 (mode 0's intermediate row); acc (H) fp32, zero on entry and left zero (mode 1); out (H) bf16;
// ctr: [0] mode 0's gate_up counter, [1] mode 1's ticket, both zero on entry; cols / dcols: gate_up / down columns
// a CTA (the last CTA's may be fewer).
extern "C" __global__ void __launch_bounds__(THREADS, 1)
    mpk_bench_mlp(const bf16* __restrict__ x, const bf16* __restrict__ Wg, const bf16* __restrict__ Wu,
                  const bf16* __restrict__ Wd, const bf16* __restrict__ WdT, const bf16* __restrict__ h,
                  bf16* __restrict__ inter, float* __restrict__ acc, bf16* __restrict__ out, uint64_t* ctr, int H,
                  int I, int cols, int dcols, int mode, uint64_t* __restrict__ stamps) {
  __shared__ __align__(16) bf16 xs[MAX_I];
  __shared__ float y0s[MAX_COLS], y1s[MAX_COLS], a[MAX_COLS];
  __shared__ int last;
  if (H > MAX_H || I > MAX_I || cols > MAX_COLS || dcols > MAX_COLS || H % (8 * THREADS) != 0) __trap();
  __syncthreads();
  stamp(stamps, 0);
  const int nb = gridDim.x;
  const int n0 = min(I, blockIdx.x * cols), n1 = min(I, n0 + cols);
  for (int k8 = threadIdx.x; k8 < H / 8; k8 += THREADS)
    reinterpret_cast<uint4*>(xs)[k8] = ld_act16(x + k8 * 8);
  __syncthreads();
  linear_core<true>(xs, 1, H, Wg, Wu, n0, n1, 1, y0s, y1s);   // ends with __syncthreads()
  for (int n = threadIdx.x; n < n1 - n0; n += THREADS) {
    const float v = silu_mul(y0s[n], y1s[n]);
    if (mode == 0) inter[n0 + n] = __float2bfloat16_rn(v);
    else a[n] = v;
  }
  __syncthreads();
  stamp(stamps, 1);
  if (mode == 0) {
    if (threadIdx.x == 0) {
      red_release_add_u64(ctr, 1ull);
      while (ld_acquire_u64(ctr) < (uint64_t)nb) {
      }
    }
    __syncthreads();
    for (int k8 = threadIdx.x; k8 < I / 8; k8 += THREADS)
      reinterpret_cast<uint4*>(xs)[k8] = ld_act16(inter + k8 * 8);
    __syncthreads();
    const int d0 = min(H, blockIdx.x * dcols), d1 = min(H, d0 + dcols);
    linear_core<false>(xs, 1, I, Wd, nullptr, d0, d1, 1, y0s, nullptr);
    for (int j = threadIdx.x; j < d1 - d0; j += THREADS)
      out[d0 + j] = __float2bfloat16_rn(__bfloat162float(h[d0 + j]) + bf(y0s[j]));
    __syncthreads();
    stamp(stamps, 2);
    return;
  }
  if (H / (THREADS / 32) == 256) {
    down_fused<1>(WdT + (int64_t)n0 * H, H, a, n1 - n0, acc);
  } else if (H / (THREADS / 32) == 512) {
    down_fused<2>(WdT + (int64_t)n0 * H, H, a, n1 - n0, acc);
  } else {
    __trap();
  }
  __syncthreads();
  if (mode == 2) {
    if (threadIdx.x == 0) red_release_add_u64(ctr + 1, 1ull);   // cumulative over the CTA's atomics (barrier above)
    stamp(stamps, 2);
    return;
  }
  if (threadIdx.x == 0) {
    __threadfence();   // this CTA's atomics before its ticket
    unsigned long long t;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;" : "=l"(t) : "l"(ctr + 1) : "memory");
    last = t == (unsigned long long)(nb - 1);
  }
  __syncthreads();
  if (!last) {
    stamp(stamps, 2);
    return;
  }
  __threadfence();
  for (int j = threadIdx.x; j < H; j += THREADS) {
    const float s = __ldcg(acc + j);
    out[j] = __float2bfloat16_rn(__bfloat162float(h[j]) + bf(s));
    __stcg(acc + j, 0.f);
  }
  __syncthreads();
  stamp(stamps, 2);
}
