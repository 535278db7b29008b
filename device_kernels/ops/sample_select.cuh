// The top-C sampling candidates of one row's vocabulary slice (argmax_partial, argmax.cuh): order keys, the
// block scan, the radix select, and the two selections - staged in shared memory (slices of <= SAMPLE_STAGE
// logits) or straight from global memory. Each keeps the CPU semantics' order (tasks/ops/argmax.py
// partial_candidates: key desc, index asc), so the pushed candidates are bit for bit those of the spec.
#pragma once
#include "../common.cuh"

namespace mpk {

static_assert(THREADS == 256, "sample_select.cuh: one histogram bin (radix digit) per thread");
static_assert(SAMPLE_C <= THREADS, "sample_select.cuh: one candidate per thread");

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

}  // namespace mpk
