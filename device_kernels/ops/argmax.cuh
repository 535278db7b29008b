// argmax_partial / argmax_reduce: the next token over a vocab-parallel LM head (tasks/ops/argmax.py), greedy
// or sampled on device (mpk_runtime/ir/sampling.py is the definition; the CPU semantics mirror this file op for
// op). Greedy ties go to the lowest index, as torch.argmax. Sampling uses only single IEEE fp32 operations
// (__fadd_rn / __fmul_rn / __fdiv_rn: no contraction into FMA, no library exp) so pyvm draws the same tokens.
#pragma once
#include "../common.cuh"
#include "sample_select.cuh"

namespace mpk {

static_assert(SAMPLE_C <= THREADS, "argmax.cuh: one candidate per thread");

__device__ __forceinline__ bool better(float v, float i, float bv, float bi) { return v > bv || (v == bv && i < bi); }

// --- the draw (each helper has a twin in tasks/ops/argmax.py; constants from ir/sampling.py) ---------------
__device__ __forceinline__ uint32_t hash32(uint32_t x) {   // lowbias32
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}
// u in [0, 1) from 24 bits of hash(seed, position of the row's last token)
__device__ __forceinline__ float sample_uniform(int64_t seed, int64_t pos) {
  const uint64_t s = static_cast<uint64_t>(seed);
  uint32_t h = hash32(static_cast<uint32_t>(pos) + 0x9e3779b9u);
  h = hash32(h ^ static_cast<uint32_t>(s >> 32));
  h = hash32(h ^ static_cast<uint32_t>(s));
  return __fmul_rn(static_cast<float>(h >> 8), 0x1p-24f);
}
// 2^t for t <= 0: 2^floor(t) from the exponent bits times a degree-6 Horner polynomial of the fraction
__device__ __forceinline__ float exp2_neg(float t) {
  if (!(t >= -126.0f)) return 0.0f;
  const float n = floorf(t);
  const float f = __fsub_rn(t, n);
  float p = 0x1.cacdf6p-13f;
  p = __fadd_rn(__fmul_rn(p, f), 0x1.44bd44p-10f);
  p = __fadd_rn(__fmul_rn(p, f), 0x1.3d5826p-7f);
  p = __fadd_rn(__fmul_rn(p, f), 0x1.c67ee4p-5f);
  p = __fadd_rn(__fmul_rn(p, f), 0x1.ebfdf8p-3f);
  p = __fadd_rn(__fmul_rn(p, f), 0x1.62e428p-1f);
  p = __fadd_rn(__fmul_rn(p, f), 0x1.000000p+0f);
  return __fmul_rn(p, __int_as_float((static_cast<int>(n) + 127) << 23));
}
// The two ops are __noinline__: inlined into the megakernel's switch they pushed the kernel's register allocation
// (255 max at 1 CTA/SM) into spills.
__device__ __noinline__ void op_argmax_partial(const Ctx& c) {
  const int64_t* a = c.rec;
  const float* logits = ptr<const float>(a[A_ARGMAX_PARTIAL_LOGITS]);
  const int B = (int)a[A_ARGMAX_PARTIAL_B], b0 = (int)a[A_ARGMAX_PARTIAL_B0], nb = (int)a[A_ARGMAX_PARTIAL_NB];
  // vocabulary slices [sl * V, (sl + 1) * V) of the rank's logits (row stride ld), sl < nsl: slot `slot + sl`
  const int64_t V = a[A_ARGMAX_PARTIAL_V], ld = a[A_ARGMAX_PARTIAL_LD];
  const int nsl = (int)a[A_ARGMAX_PARTIAL_NSLICES];
  const int64_t* peers = ptr<const int64_t>(a[A_ARGMAX_PARTIAL_PEERS]);
  const int npeers = (int)a[A_ARGMAX_PARTIAL_NPEERS], slot = (int)a[A_ARGMAX_PARTIAL_SLOT];
  const int64_t sym_off = c.parity * a[A_ARGMAX_PARTIAL_PAR_STRIDE];
  const float* temp = ptr<const float>(a[A_ARGMAX_PARTIAL_TEMP]);   // nullptr: every row greedy
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  // smem (packer.py _pack_argmax_partial): sv, si [nwarps] | hist [256] | scan [2 (nwarps + 1)] | misc [8]
  // | cv, ci [SAMPLE_C] | (16-byte aligned) cand_k, cand_i [SAMPLE_CAP + 4] | keys [stage_slot(V) + 1] (the last
  // two when sampling and V <= SAMPLE_STAGE)
  float* sv = reinterpret_cast<float*>(dyn_smem());
  float* si = sv + nwarps;
  int* hist = reinterpret_cast<int*>(si + nwarps);
  int* scan = hist + 256;
  int* misc = scan + 2 * (nwarps + 1);
  float* cv = reinterpret_cast<float*>(misc + 8);
  float* ci = cv + SAMPLE_C;
  static_assert(SAMPLE_CAP % 4 == 0, "argmax.cuh: candidate arrays are read 16 bytes at a time");
  uint32_t* cand_k = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(ci + SAMPLE_C) + 15) & ~uintptr_t(15));
  int* cand_i = reinterpret_cast<int*>(cand_k + SAMPLE_CAP + 4);
  uint32_t* keys = reinterpret_cast<uint32_t*>(cand_i + SAMPLE_CAP + 4);
  for (int q = 0; q < nsl * nb; ++q) {
    const int sl = q / nb, b = b0 + q % nb;
    const float* lb = logits + b * ld + sl * V;
    const int64_t vocab0 = a[A_ARGMAX_PARTIAL_VOCAB0] + sl * V;
    const int64_t row = ((int64_t)(slot + sl) * B + b) * SAMPLE_C * 2;   // this slice's candidates of row b
    if (temp != nullptr && temp[b] > 0.f) {
      if (V <= SAMPLE_STAGE)
        staged_top_candidates(lb, V, vocab0, hist, scan, misc, cv, ci, cand_k, cand_i, keys, peers, npeers,
                              sym_off + row * (int64_t)sizeof(float));
      else
        partial_top_candidates(lb, V, vocab0, hist, scan, misc, cv, ci, peers, npeers,
                               sym_off + row * (int64_t)sizeof(float));
      continue;
    }
    float bv = -INFINITY, bi = 3.0e38f;
    int64_t v0 = 0;
    if (((V | ld) & 3) == 0) {   // 16-byte loads, 4 vectors in flight per thread (one CTA reads the whole vocab)
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
      for (int p = 0; p < npeers; ++p) {   // greedy: entry 0 only
        float* dst = ptr<float>(peers[p] + sym_off) + row;
        dst[0] = bv;
        dst[1] = bi + (float)vocab0;
      }
    }
    __syncthreads();
  }
}

// Steps 3-5 of ir/sampling.py for one row, on merged candidates mv/mi [C] (best first): the weights e_j by C
// threads at once, the serial sums and the draw by thread 0 (returns the token there; called by every thread).
__device__ inline int64_t sample_from_candidates(const float* mv, const float* mi, float* es, float* cs, float T,
                                                 int64_t top_k, float top_p, int64_t seed, int64_t pos) {
  constexpr int C = SAMPLE_C;
  const int k = (top_k >= 1 && top_k <= C) ? static_cast<int>(top_k) : C;
  const float LOG2E = 0x1.715476p+0f;
  const int j = threadIdx.x;
  if (j < C) {
    const float d = __fdiv_rn(__fsub_rn(mv[j], mv[0]), T);
    const float t = __fmul_rn(d, LOG2E);
    es[j] = j == 0 ? 1.0f : (j < k ? exp2_neg(t) : 0.0f);
  }
  __syncthreads();
  int64_t tok = -1;
  if (j == 0) {
    cs[0] = 0.0f;
    for (int q = 0; q < C; ++q) cs[q + 1] = __fadd_rn(cs[q], es[q]);
    const float thr = __fmul_rn(top_p, cs[k]);
    int m = 1;
    while (m < k && cs[m] < thr) ++m;            // c is non-decreasing: the kept set is a prefix
    const float r = __fmul_rn(sample_uniform(seed, pos), cs[m]);
    int chosen = -1, last = 0;
    for (int q = 0; q < m; ++q) {
      if (es[q] > 0.0f) last = q;
      if (chosen < 0 && r < cs[q + 1]) chosen = q;
    }
    if (chosen < 0) chosen = last;
    // a best candidate that is not finite (NaN, +-inf) leaves no distribution: PAD_INDEX, no token (the engine
    // fails the request), as for a greedy row holding NaN
    tok = isfinite(mv[0]) ? static_cast<int64_t>(mi[chosen]) : static_cast<int64_t>(SAMPLE_PAD_INDEX);
  }
  return tok;
}

__device__ __noinline__ void op_argmax_reduce(const Ctx& c) {
  constexpr int C = SAMPLE_C;
  const int64_t* a = c.rec;
  const float* part = ptr<const float>(a[A_ARGMAX_REDUCE_PART] + c.parity * a[A_ARGMAX_REDUCE_PAR_STRIDE]);
  int64_t* out = ptr<int64_t>(a[A_ARGMAX_REDUCE_OUT]);
  int64_t* tokens = ptr<int64_t>(a[A_ARGMAX_REDUCE_TOKENS]);
  const int W = (int)a[A_ARGMAX_REDUCE_WORLD], B = (int)a[A_ARGMAX_REDUCE_B];
  const int b0 = (int)a[A_ARGMAX_REDUCE_B0], b1 = b0 + (int)a[A_ARGMAX_REDUCE_NB];   // this task's rows
  const float* temp = ptr<const float>(a[A_ARGMAX_REDUCE_TEMP]);     // nullptr: every row greedy
  const int64_t* top_k = ptr<const int64_t>(a[A_ARGMAX_REDUCE_TOP_K]);
  const float* top_p = ptr<const float>(a[A_ARGMAX_REDUCE_TOP_P]);
  const int64_t* seed = ptr<const int64_t>(a[A_ARGMAX_REDUCE_SEED]);
  for (int b = b0 + threadIdx.x; b < b1; b += THREADS) {   // greedy rows: best entry 0 over the slots
    if (temp != nullptr && temp[b] > 0.f) continue;
    float bv = ld_act_f32(part + (int64_t)b * C * 2), bi = ld_act_f32(part + (int64_t)b * C * 2 + 1);
    for (int r = 1; r < W; ++r) {
      const float* e = part + ((int64_t)r * B + b) * C * 2;
      const float v = ld_act_f32(e), i = ld_act_f32(e + 1);
      if (better(v, i, bv, bi)) { bv = v; bi = i; }
    }
    out[b] = (int64_t)bi;
    if (tokens != nullptr) tokens[b] = (int64_t)bi;
  }
  if (temp == nullptr) return;
  // smem (packer.py _pack_argmax_reduce): pv, pi [W C] | mv, mi [C] | es [C] | cs [C + 1] | heads [W] |
  // scan [2 (nwarps + 1)] | (16-byte aligned) ck, cx, ce [RED_CAP + 4]
  float* pv = reinterpret_cast<float*>(dyn_smem());
  float* pi = pv + W * C;
  float* mv = pi + W * C;
  float* mi = mv + C;
  float* es = mi + C;
  float* cs = es + C;
  int* heads = reinterpret_cast<int*>(cs + C + 1);
  int* scan = heads + W;
  constexpr int RED_CAP = 4 * SAMPLE_C;   // candidates ranked against each other at most (~2 C typical)
  uint32_t* ck = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(scan + 2 * (THREADS / 32 + 1)) + 15) &
                                             ~uintptr_t(15));
  float* cx = reinterpret_cast<float*>(ck + RED_CAP + 4);
  int* ce = reinterpret_cast<int*>(cx + RED_CAP + 4);
  for (int b = b0; b < b1; ++b) {
    if (!(temp[b] > 0.f)) continue;
    for (int e = threadIdx.x; e < W * C; e += THREADS) {
      const float2 x = __ldcg(reinterpret_cast<const float2*>(part + (((int64_t)(e / C) * B + b) * C + e % C) * 2));
      pv[e] = x.x;
      pi[e] = x.y;
    }
    __syncthreads();
    MPK_STAMP(4);   // (stage-stamp builds, the task's last sampled row) candidates of every slot loaded
    // merge. Each slot's candidates are sorted (key desc, index asc), so every slot has ps + 1 entries >= its entry
    // ps = ceil(C / W) - 1, and L = the smallest of those W entries has >= C entries >= it: the global top C are
    // among the entries >= L (typically ~2 C). Those are compacted and ranked against each other by (key desc,
    // index asc, position asc: identical padding entries); more than RED_CAP of them (ties): warp 0 merges the
    // slots instead, taking the best head C times.
    if (threadIdx.x < 32) {
      const int ps = (C + W - 1) / W - 1;
      uint32_t m = 0xffffffffu;
      for (int q = threadIdx.x; q < W; q += 32) m = min(m, order_key(pv[q * C + ps]));
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) m = min(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (threadIdx.x == 0) heads[0] = static_cast<int>(m);
    }
    __syncthreads();
    const uint32_t L = static_cast<uint32_t>(heads[0]);
    int cnt = 0;
    for (int e = threadIdx.x; e < W * C; e += THREADS) cnt += order_key(pv[e]) >= L;
    int total;
    int at = block_incl_scan(cnt, scan, &total) - cnt;
    if (total <= RED_CAP) {
      for (int e = threadIdx.x; e < W * C; e += THREADS) {
        const uint32_t k = order_key(pv[e]);
        if (k >= L) {
          ck[at] = k;
          cx[at] = pi[e];
          ce[at++] = e;
        }
      }
      if (threadIdx.x < 3) {   // pad to a multiple of 4: never ranked before a real entry
        ck[total + threadIdx.x] = 0u;
        cx[total + threadIdx.x] = 3.0e38f;
        ce[total + threadIdx.x] = 0x7fffffff;
      }
      __syncthreads();
      const int total4 = (total + 3) >> 2;
      const uint4* k4 = reinterpret_cast<const uint4*>(ck);
      const float4* x4 = reinterpret_cast<const float4*>(cx);
      const int4* e4 = reinterpret_cast<const int4*>(ce);
      for (int t = threadIdx.x; t < total; t += THREADS) {
        const uint32_t k = ck[t];
        const float i = cx[t];
        const int e = ce[t];
        int rank = 0;
        for (int j = 0; j < total4 && rank < C; ++j) {
          const uint4 kj = k4[j];
          const float4 ij = x4[j];
          const int4 ej = e4[j];
          rank += ((kj.x > k || (kj.x == k && (ij.x < i || (ij.x == i && ej.x < e)))) ? 1 : 0) +
                  ((kj.y > k || (kj.y == k && (ij.y < i || (ij.y == i && ej.y < e)))) ? 1 : 0) +
                  ((kj.z > k || (kj.z == k && (ij.z < i || (ij.z == i && ej.z < e)))) ? 1 : 0) +
                  ((kj.w > k || (kj.w == k && (ij.w < i || (ij.w == i && ej.w < e)))) ? 1 : 0);
        }
        if (rank < C) {
          mv[rank] = pv[e];
          mi[rank] = i;
        }
      }
    } else if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      for (int q = lane; q < W; q += 32) heads[q] = 0;
      __syncwarp();
      for (int j = 0; j < C; ++j) {
        uint32_t bk = 0;
        float bi = 0.f;
        int bs = -1;
        for (int q = lane; q < W; q += 32) {
          const int h = heads[q];
          if (h >= C) continue;
          const uint32_t k = order_key(pv[q * C + h]);
          const float i = pi[q * C + h];
          if (bs < 0 || k > bk || (k == bk && i < bi)) { bk = k; bi = i; bs = q; }   // q ascending: ties keep the lower slot
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const uint32_t ok = __shfl_xor_sync(0xffffffffu, bk, o);
          const float oi = __shfl_xor_sync(0xffffffffu, bi, o);
          const int os = __shfl_xor_sync(0xffffffffu, bs, o);
          if (os >= 0 && (bs < 0 || ok > bk || (ok == bk && (oi < bi || (oi == bi && os < bs))))) {
            bk = ok; bi = oi; bs = os;
          }
        }
        if (lane == (bs & 31)) {   // the winner's owner lane: record it and advance that slot
          const int h = heads[bs];
          mv[j] = pv[bs * C + h];
          mi[j] = pi[bs * C + h];
          heads[bs] = h + 1;
        }
        __syncwarp();
      }
    }
    __syncthreads();
    MPK_STAMP(5);   // merged
    const int64_t tok = sample_from_candidates(mv, mi, es, cs, temp[b], top_k[b], top_p[b], seed[b], seq_pos(c, b));
    if (threadIdx.x == 0) {
      out[b] = tok;
      if (tokens != nullptr) tokens[b] = tok;
    }
    __syncthreads();
    MPK_STAMP(6);   // drawn
  }
}

}  // namespace mpk
