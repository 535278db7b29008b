// argmax_partial / argmax_reduce: the next token over a vocab-parallel LM head (tasks/ops/argmax.py), greedy
// or sampled on device (mpk_runtime/ir/sampling.py is the definition; the CPU semantics mirror this file op for
// op). Greedy ties go to the lowest index, as torch.argmax. Sampling uses only single IEEE fp32 operations
// (__fadd_rn / __fmul_rn / __fdiv_rn: no contraction into FMA, no library exp) so pyvm draws the same tokens.
#pragma once
#include "../common.cuh"

namespace mpk {

static_assert(THREADS == 256, "argmax.cuh: one histogram bin (radix digit) per thread");
static_assert(SAMPLE_C <= THREADS, "argmax.cuh: one candidate per thread");

__device__ __forceinline__ bool better(float v, float i, float bv, float bi) { return v > bv || (v == bv && i < bi); }

// --- sampling helpers (each has a twin in tasks/ops/argmax.py; constants from ir/sampling.py) -----------------
constexpr float SAMPLE_PAD_INDEX = 16777215.0f;   // ir/sampling.py PAD_INDEX

// order-preserving key of an fp32 bit pattern: larger key = larger float
__device__ __forceinline__ uint32_t order_key(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
// candidate order: key descending, then index ascending
__device__ __forceinline__ bool cand_before(uint32_t ka, float ia, uint32_t kb, float ib) {
  return ka > kb || (ka == kb && ia < ib);
}
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
// inclusive sum over threadIdx order; *total = the block's sum. Two __syncthreads (sc reusable on return).
__device__ __forceinline__ int block_incl_scan(int x, int* sc, int* total) {
  constexpr int NW = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) sc[warp] = x;
  __syncthreads();
  int off = 0, tot = 0;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    const int s = sc[w];
    off += (w < warp) ? s : 0;
    tot += s;
  }
  __syncthreads();
  *total = tot;
  return x + off;
}

// Radix select of the want-th largest key (4 passes of 8-bit digits, one histogram bin per thread) over keys
// key_at(v), v < V. Returns the threshold key in *prefix_out and, in *need_out, how many keys equal to it belong
// to the top `want` (every key above it does).
template <class KeyAt>
__device__ inline void radix_threshold(KeyAt key_at, int64_t V, int want, int* hist, int* scan, int* misc,
                                       uint32_t* prefix_out, int* need_out) {
  const int tid = threadIdx.x;
  uint32_t prefix = 0, mask = 0;
  int need = want;
  for (int shift = 24; shift >= 0; shift -= 8) {
    hist[tid] = 0;
    __syncthreads();
    for (int64_t base = 0; base < V; base += THREADS) {   // warp-uniform trip count (__match_any_sync)
      const int64_t v = base + tid;
      uint32_t bin = 256u;                                 // 256: out of range or not under the prefix
      if (v < V) {
        const uint32_t k = key_at(v);
        if ((k & mask) == prefix) bin = (k >> shift) & 255u;
      }
      const unsigned same = __match_any_sync(0xffffffffu, bin);   // one shared-memory atomic per distinct bin
      if (bin < 256u && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(&hist[bin], __popc(same));
    }
    __syncthreads();
    const int d = 255 - tid;           // thread order = digits descending: the scan counts digits >= d
    const int h = hist[d];
    int tot;
    const int s = block_incl_scan(h, scan, &tot);
    if (s >= need && s - h < need) {
      misc[0] = d;
      misc[1] = need - (s - h);
    }
    __syncthreads();
    prefix |= static_cast<uint32_t>(misc[0]) << shift;
    mask |= 255u << shift;
    need = misc[1];
    __syncthreads();
  }
  *prefix_out = prefix;
  *need_out = need;
}

__device__ __forceinline__ float key_value(uint32_t k) {   // inverse of order_key
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
__device__ __forceinline__ int stage_slot(int v) { return v + (v >> 5); }   // one pad word per 32: conflict-free chunks

// The `want` selected candidates cv/ci [want] (any order): sorted by (key desc, index asc) and pushed, with
// padding to C, into every peer's slot (dst_off: parity offset of the buffer + this row's slot, in bytes).
__device__ inline void push_candidates(const float* cv, const float* ci, int want, int64_t vocab0,
                                       const int64_t* peers, int npeers, int64_t dst_off) {
  const int tid = threadIdx.x;
  if (tid < SAMPLE_C) {
    float x = -INFINITY, i = SAMPLE_PAD_INDEX;
    int rank = tid;
    if (tid < want) {
      x = cv[tid];
      i = ci[tid];
      const uint32_t k = order_key(x);
      rank = 0;
      for (int j = 0; j < want; ++j) rank += cand_before(order_key(cv[j]), ci[j], k, i) ? 1 : 0;
      i += static_cast<float>(vocab0);
    }
    for (int p = 0; p < npeers; ++p) {
      float* dst = ptr<float>(peers[p] + dst_off) + rank * 2;
      dst[0] = x;
      dst[1] = i;
    }
  }
  __syncthreads();
}

// One sampled row, slice of V <= SAMPLE_STAGE logits: the slice is read once (16-byte loads, 4 in flight per
// thread) into shared memory as order keys, the radix select runs there, and the compaction gives each thread a
// contiguous chunk (index order = thread order, so the `need` keys equal to the threshold taken are the lowest
// indices): two block scans instead of a vote and two scans per 256 logits.
__device__ inline void staged_top_candidates(const float* lb, int64_t V, int64_t vocab0, int* hist, int* scan,
                                             int* misc, float* cv, float* ci, uint32_t* keys, const int64_t* peers,
                                             int npeers, int64_t dst_off) {
  const int tid = threadIdx.x;
  const int n = static_cast<int>(V);
  int v_done = 0;
  if ((reinterpret_cast<uintptr_t>(lb) & 15) == 0) {
    const float4* l4 = reinterpret_cast<const float4*>(lb);
    const int V4 = n >> 2;
#pragma unroll 4
    for (int q = tid; q < V4; q += THREADS) {
      const float4 x = __ldcg(l4 + q);
      uint32_t* d = keys + stage_slot(4 * q);   // 4 | 32: a group never straddles a pad word
      d[0] = order_key(x.x);
      d[1] = order_key(x.y);
      d[2] = order_key(x.z);
      d[3] = order_key(x.w);
    }
    v_done = 4 * V4;
  }
  for (int v = v_done + tid; v < n; v += THREADS) keys[stage_slot(v)] = order_key(ld_act_f32(lb + v));
  __syncthreads();
  const int want = n < SAMPLE_C ? n : SAMPLE_C;
  uint32_t prefix;
  int need;
  radix_threshold([&](int64_t v) { return keys[stage_slot(static_cast<int>(v))]; }, V, want, hist, scan, misc,
                  &prefix, &need);
  const int chunk = (n + THREADS - 1) / THREADS;
  const int lo = tid * chunk < n ? tid * chunk : n, hi = lo + chunk < n ? lo + chunk : n;
  int gt = 0, eq = 0;
  for (int v = lo; v < hi; ++v) {
    const uint32_t k = keys[stage_slot(v)];
    gt += k > prefix;
    eq += k == prefix;
  }
  int gt_tot, eq_tot;
  const int gt_at = block_incl_scan(gt, scan, &gt_tot) - gt;   // exclusive: this chunk's first slot
  int eq_at = block_incl_scan(eq, scan, &eq_tot) - eq;         // equal keys before this chunk
  int g = gt_at;
  for (int v = lo; v < hi && (g < gt_at + gt || eq_at < need); ++v) {
    const uint32_t k = keys[stage_slot(v)];
    if (k > prefix) {
      cv[g] = key_value(k);
      ci[g++] = static_cast<float>(v);
    } else if (k == prefix) {
      if (eq_at < need) {
        cv[gt_tot + eq_at] = key_value(k);
        ci[gt_tot + eq_at] = static_cast<float>(v);
      }
      ++eq_at;
    }
  }
  __syncthreads();
  push_candidates(cv, ci, want, vocab0, peers, npeers, dst_off);
}

// One sampled row, any V (the slice is longer than SAMPLE_STAGE): the radix select and an ordered compaction
// (groups of 4 x THREADS logits in index order, one block vote per group, scans only where candidates are)
// straight from global memory.
__device__ inline void partial_top_candidates(const float* lb, int64_t V, int64_t vocab0, int* hist, int* scan,
                                              int* misc, float* cv, float* ci, const int64_t* peers, int npeers,
                                              int64_t dst_off) {
  const int tid = threadIdx.x;
  const int want = V < SAMPLE_C ? static_cast<int>(V) : SAMPLE_C;
  uint32_t prefix;
  int need;
  radix_threshold([&](int64_t v) { return order_key(ld_act_f32(lb + v)); }, V, want, hist, scan, misc, &prefix,
                  &need);
  // prefix = the threshold key: every key above it, and the `need` lowest-index keys equal to it
  int n_sel = 0, eq_seen = 0;
  for (int64_t base = 0; base < V; base += 4 * THREADS) {
    float xs[4];
    bool hit = false;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t v = base + u * THREADS + tid;
      xs[u] = v < V ? ld_act_f32(lb + v) : 0.f;
      hit |= v < V && order_key(xs[u]) >= prefix;
    }
    if (!__syncthreads_or(hit)) continue;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int64_t v = base + u * THREADS + tid;
      const uint32_t k = order_key(xs[u]);
      const bool gt = v < V && k > prefix, eq = v < V && k == prefix;
      if (!__syncthreads_or(gt || eq)) continue;
      int eq_tot, sel_tot;
      const int eq_incl = block_incl_scan(eq ? 1 : 0, scan, &eq_tot);
      const bool sel = gt || (eq && eq_seen + eq_incl - 1 < need);
      const int sel_incl = block_incl_scan(sel ? 1 : 0, scan, &sel_tot);
      if (sel) {
        cv[n_sel + sel_incl - 1] = xs[u];
        ci[n_sel + sel_incl - 1] = static_cast<float>(v);
      }
      n_sel += sel_tot;
      eq_seen += eq_tot;
    }
  }
  __syncthreads();
  push_candidates(cv, ci, want, vocab0, peers, npeers, dst_off);
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
  // | cv, ci [SAMPLE_C] | keys [stage_slot(V) + 1] when sampling and V <= SAMPLE_STAGE
  float* sv = reinterpret_cast<float*>(dyn_smem());
  float* si = sv + nwarps;
  int* hist = reinterpret_cast<int*>(si + nwarps);
  int* scan = hist + 256;
  int* misc = scan + 2 * (nwarps + 1);
  float* cv = reinterpret_cast<float*>(misc + 8);
  float* ci = cv + SAMPLE_C;
  uint32_t* keys = reinterpret_cast<uint32_t*>(ci + SAMPLE_C);
  for (int q = 0; q < nsl * nb; ++q) {
    const int sl = q / nb, b = b0 + q % nb;
    const float* lb = logits + b * ld + sl * V;
    const int64_t vocab0 = a[A_ARGMAX_PARTIAL_VOCAB0] + sl * V;
    const int64_t row = ((int64_t)(slot + sl) * B + b) * SAMPLE_C * 2;   // this slice's candidates of row b
    if (temp != nullptr && temp[b] > 0.f) {
      if (V <= SAMPLE_STAGE)
        staged_top_candidates(lb, V, vocab0, hist, scan, misc, cv, ci, keys, peers, npeers,
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
    tok = static_cast<int64_t>(mi[chosen]);
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
  // smem (packer.py _pack_argmax_reduce): pv, pi [W C] | mv, mi [C] | es [C] | cs [C + 1]
  float* pv = reinterpret_cast<float*>(dyn_smem());
  float* pi = pv + W * C;
  float* mv = pi + W * C;
  float* mi = mv + C;
  float* es = mi + C;
  float* cs = es + C;
  for (int b = b0; b < b1; ++b) {
    if (!(temp[b] > 0.f)) continue;
    for (int e = threadIdx.x; e < W * C; e += THREADS) {
      const float2 x = __ldcg(reinterpret_cast<const float2*>(part + (((int64_t)(e / C) * B + b) * C + e % C) * 2));
      pv[e] = x.x;
      pi[e] = x.y;
    }
    __syncthreads();
    // merge: rank of each entry = its position in its (sorted) slot + the entries of other slots before it
    // (binary search; identical padding entries are ordered by slot)
    for (int e = threadIdx.x; e < W * C; e += THREADS) {
      const int r = e / C;
      const uint32_t k = order_key(pv[e]);
      const float i = pi[e];
      int rank = e % C;
      for (int q = 0; q < W && rank < C; ++q) {
        if (q == r) continue;
        int lo = 0, hi = C;
        while (lo < hi) {
          const int mid = (lo + hi) >> 1;
          const uint32_t km = order_key(pv[q * C + mid]);
          const float im = pi[q * C + mid];
          const bool before = km > k || (km == k && (im < i || (im == i && q < r)));
          if (before) lo = mid + 1; else hi = mid;
        }
        rank += lo;
      }
      if (rank < C) {
        mv[rank] = pv[e];
        mi[rank] = i;
      }
    }
    __syncthreads();
    const int64_t tok = sample_from_candidates(mv, mi, es, cs, temp[b], top_k[b], top_p[b], seed[b], seq_pos(c, b));
    if (threadIdx.x == 0) {
      out[b] = tok;
      if (tokens != nullptr) tokens[b] = tok;
    }
    __syncthreads();
  }
}

}  // namespace mpk
