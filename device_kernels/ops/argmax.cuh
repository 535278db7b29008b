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

// One sampled row, slice of V <= SAMPLE_STAGE logits, read once (16-byte loads, 4 in flight per thread) into
// shared memory as order keys. Each thread keeps the largest key of the logits it read (a group of ~V / THREADS);
// the want-th largest of those group maxima, L, has at least `want` keys >= L, so the top `want` are among the
// keys >= L (typically ~1-2% of the slice). Those candidates are compacted and ranked by (key desc, index asc)
// against each other, and each one of rank < want is pushed straight to its position. If more than SAMPLE_CAP
// keys are >= L (heavy ties), the exact radix select over the staged keys takes over.
__device__ inline void staged_top_candidates(const float* lb, int64_t V, int64_t vocab0, int* hist, int* scan,
                                             int* misc, float* cv, float* ci, uint32_t* cand_k, int* cand_i,
                                             uint32_t* keys, const int64_t* peers, int npeers, int64_t dst_off) {
  const int tid = threadIdx.x;
  const int n = static_cast<int>(V);
  const bool vec = (reinterpret_cast<uintptr_t>(lb) & 15) == 0;
  const int V4 = vec ? n >> 2 : 0;
  uint32_t gmax = 0;
  {
    const float4* l4 = reinterpret_cast<const float4*>(lb);
#pragma unroll 4
    for (int q = tid; q < V4; q += THREADS) {
      const float4 x = __ldcg(l4 + q);
      uint32_t* d = keys + stage_slot(4 * q);   // 4 | 32: a group never straddles a pad word
      const uint32_t k0 = order_key(x.x), k1 = order_key(x.y), k2 = order_key(x.z), k3 = order_key(x.w);
      d[0] = k0;
      d[1] = k1;
      d[2] = k2;
      d[3] = k3;
      gmax = max(gmax, max(max(k0, k1), max(k2, k3)));
    }
  }
  for (int v = 4 * V4 + tid; v < n; v += THREADS) {
    const uint32_t k = order_key(ld_act_f32(lb + v));
    keys[stage_slot(v)] = k;
    gmax = max(gmax, k);
  }
  uint32_t* gm = reinterpret_cast<uint32_t*>(hist);   // THREADS group maxima (0: a thread that read nothing)
  gm[tid] = gmax;
  __syncthreads();
  MPK_STAMP(0);   // (stage-stamp builds, the task's last sampled slice) keys staged
  const int want = n < SAMPLE_C ? n : SAMPLE_C;
  {
    // rank of this group's maximum among all (desc, ties by thread): a permutation of 0..THREADS-1; 16-byte
    // reads, four independent counts
    const uint4* g4 = reinterpret_cast<const uint4*>(gm);
    int r0 = 0, r1 = 0, r2 = 0, r3 = 0;
#pragma unroll 4
    for (int j = 0; j < THREADS / 4; ++j) {
      const uint4 o = g4[j];
      const int t = 4 * j;
      r0 += (o.x > gmax || (o.x == gmax && t < tid)) ? 1 : 0;
      r1 += (o.y > gmax || (o.y == gmax && t + 1 < tid)) ? 1 : 0;
      r2 += (o.z > gmax || (o.z == gmax && t + 2 < tid)) ? 1 : 0;
      r3 += (o.w > gmax || (o.w == gmax && t + 3 < tid)) ? 1 : 0;
    }
    if (r0 + r1 + r2 + r3 == want - 1) misc[0] = static_cast<int>(gmax);
  }
  __syncthreads();
  const uint32_t L = static_cast<uint32_t>(misc[0]);
  int cnt = 0;   // this thread's keys >= L (the logits it staged)
  for (int q = tid; q < V4; q += THREADS) {
    const uint32_t* d = keys + stage_slot(4 * q);
    cnt += (d[0] >= L) + (d[1] >= L) + (d[2] >= L) + (d[3] >= L);
  }
  for (int v = 4 * V4 + tid; v < n; v += THREADS) cnt += keys[stage_slot(v)] >= L;
  int total;
  int at = block_incl_scan(cnt, scan, &total) - cnt;
  MPK_STAMP(1);   // threshold L and the candidate count
  if (total > SAMPLE_CAP) {   // block-uniform: exact radix select over the staged keys, chunked compaction
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
    return;
  }
  for (int q = tid; q < V4; q += THREADS) {
    const uint32_t* d = keys + stage_slot(4 * q);
#pragma unroll
    for (int u = 0; u < 4; ++u)
      if (d[u] >= L) {
        cand_k[at] = d[u];
        cand_i[at++] = 4 * q + u;
      }
  }
  for (int v = 4 * V4 + tid; v < n; v += THREADS)
    if (keys[stage_slot(v)] >= L) {
      cand_k[at] = keys[stage_slot(v)];
      cand_i[at++] = v;
    }
  if (tid < 3) {   // pad to a multiple of 4 (arrays of SAMPLE_CAP + 4): key 0, index INT_MAX never rank before
    cand_k[total + tid] = 0u;
    cand_i[total + tid] = 0x7fffffff;
  }
  __syncthreads();
  MPK_STAMP(2);   // candidates compacted
  const int total4 = (total + 3) >> 2;
  const uint4* ck4 = reinterpret_cast<const uint4*>(cand_k);
  const int4* ci4 = reinterpret_cast<const int4*>(cand_i);
  for (int e = tid; e < total; e += THREADS) {   // rank among the candidates (indices are distinct)
    const uint32_t k = cand_k[e];
    const int i = cand_i[e];
    int rank = 0;
    for (int j = 0; j < total4 && rank < want; ++j) {
      const uint4 kj = ck4[j];
      const int4 ij = ci4[j];
      rank += ((kj.x > k || (kj.x == k && ij.x < i)) ? 1 : 0) + ((kj.y > k || (kj.y == k && ij.y < i)) ? 1 : 0) +
              ((kj.z > k || (kj.z == k && ij.z < i)) ? 1 : 0) + ((kj.w > k || (kj.w == k && ij.w < i)) ? 1 : 0);
    }
    if (rank < want) {
      const float x = key_value(k), fi = static_cast<float>(i + vocab0);
      for (int p = 0; p < npeers; ++p) {
        float* dst = ptr<float>(peers[p] + dst_off) + rank * 2;
        dst[0] = x;
        dst[1] = fi;
      }
    }
  }
  if (tid >= want && tid < SAMPLE_C) {   // padding (a slice of fewer than C logits)
    for (int p = 0; p < npeers; ++p) {
      float* dst = ptr<float>(peers[p] + dst_off) + tid * 2;
      dst[0] = -INFINITY;
      dst[1] = SAMPLE_PAD_INDEX;
    }
  }
  __syncthreads();
  MPK_STAMP(3);   // ranked and pushed
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
