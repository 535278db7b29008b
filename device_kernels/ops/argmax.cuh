// argmax_partial / argmax_reduce: greedy next token over a vocab-parallel LM head  (tasks/ops/argmax.py)
// Ties go to the lowest index, as torch.argmax.
#pragma once
#include "../common.cuh"

namespace mpk {

__device__ __forceinline__ bool better(float v, float i, float bv, float bi) { return v > bv || (v == bv && i < bi); }

__device__ inline void op_argmax_partial(const Ctx& c) {
  const int64_t* a = c.rec;
  const float* logits = ptr<const float>(a[A_ARGMAX_PARTIAL_LOGITS]);
  const int B = (int)a[A_ARGMAX_PARTIAL_B];
  const int64_t V = a[A_ARGMAX_PARTIAL_V], vocab0 = a[A_ARGMAX_PARTIAL_VOCAB0];
  const int64_t* peers = ptr<const int64_t>(a[A_ARGMAX_PARTIAL_PEERS]);
  const int npeers = (int)a[A_ARGMAX_PARTIAL_NPEERS], slot = (int)a[A_ARGMAX_PARTIAL_SLOT];
  const int64_t sym_off = c.parity * a[A_ARGMAX_PARTIAL_PAR_STRIDE];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  float* sv = reinterpret_cast<float*>(c.smem);
  float* si = sv + nwarps;
  for (int b = 0; b < B; ++b) {
    float bv = -INFINITY, bi = 3.0e38f;
    const float* lb = logits + b * V;
    int64_t v0 = 0;
    if ((V & 3) == 0) {   // 16-byte loads, 4 vectors in flight per thread (one CTA reads the whole vocab)
      const float4* l4 = reinterpret_cast<const float4*>(lb);
      const int64_t V4 = V >> 2;
      for (int64_t q = threadIdx.x; q < V4; q += 4 * THREADS) {
        float4 x[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) x[u] = (q + u * THREADS < V4) ? __ldcg(l4 + q + u * THREADS) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float i0 = (float)(4 * (q + u * THREADS));
          if (better(x[u].x, i0, bv, bi)) { bv = x[u].x; bi = i0; }
          if (better(x[u].y, i0 + 1.f, bv, bi)) { bv = x[u].y; bi = i0 + 1.f; }
          if (better(x[u].z, i0 + 2.f, bv, bi)) { bv = x[u].z; bi = i0 + 2.f; }
          if (better(x[u].w, i0 + 3.f, bv, bi)) { bv = x[u].w; bi = i0 + 3.f; }
        }
      }
      v0 = V;
    }
    for (int64_t v = v0 + threadIdx.x; v < V; v += THREADS) {
      const float x = ld_act_f32(lb + v);
      if (better(x, (float)v, bv, bi)) { bv = x; bi = (float)v; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o), oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (better(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < nwarps; ++w)
        if (better(sv[w], si[w], bv, bi)) { bv = sv[w]; bi = si[w]; }
      for (int p = 0; p < npeers; ++p) {
        float* dst = ptr<float>(peers[p] + sym_off) + ((int64_t)slot * B + b) * 2;
        dst[0] = bv;
        dst[1] = bi + (float)vocab0;
      }
    }
    __syncthreads();
  }
}

__device__ inline void op_argmax_reduce(const Ctx& c) {
  const int64_t* a = c.rec;
  const float* part = ptr<const float>(a[A_ARGMAX_REDUCE_PART] + c.parity * a[A_ARGMAX_REDUCE_PAR_STRIDE]);
  int64_t* out = ptr<int64_t>(a[A_ARGMAX_REDUCE_OUT]);
  int64_t* tokens = ptr<int64_t>(a[A_ARGMAX_REDUCE_TOKENS]);
  const int W = (int)a[A_ARGMAX_REDUCE_WORLD], B = (int)a[A_ARGMAX_REDUCE_B];
  for (int b = threadIdx.x; b < B; b += THREADS) {
    float bv = ld_act_f32(part + (int64_t)b * 2), bi = ld_act_f32(part + (int64_t)b * 2 + 1);
    for (int r = 1; r < W; ++r) {
      const float v = ld_act_f32(part + ((int64_t)r * B + b) * 2), i = ld_act_f32(part + ((int64_t)r * B + b) * 2 + 1);
      if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    out[b] = (int64_t)bi;
    if (tokens != nullptr) tokens[b] = (int64_t)bi;
  }
}

}  // namespace mpk
