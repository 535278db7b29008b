// attention: split-KV causal GQA decode attention over the paged cache   (tasks/ops/attention.py)
// attn_partial(b, g, s): warps take 32-key blocks of chunk s round-robin; a block's K and V rows are copied into
// the warp's shared memory (cp.async, one round trip after the page-table load, which runs a block ahead); scores
// with lane = key, online softmax per q head, P.V with lane = element pairs d = 2*lane + 64*i; warps merged in
// shared memory at the end.
// Keep in sync: runtime/megakernel.py _pack_attn_partial sizes the shared memory (ATT_WARP_FLOATS, K/V rows).
#pragma once
#include "../common.cuh"

namespace mpk {

constexpr int ATT_PAIRS = (MAX_HEAD_DIM + 63) / 64;  // bf16 pairs per lane
constexpr int ATT_WARP_FLOATS = MAX_GS * (2 + 32 + MAX_HEAD_DIM);  // per-warp softmax state in shared memory
static_assert(MAX_GS % 4 == 0, "attention reads p of (key, heads) as 16-byte vectors");

// Code size matters as much as work here: every attn_partial runs its body about once per SM per layer, so
// each instruction is an instruction-cache miss (the fully unrolled v3 body was 120 KB and cost ~18 us per task
// whatever the key count). Heads are therefore a runtime loop and the per-warp online-softmax state (max, sum,
// probabilities, accumulator) lives in shared memory; only the per-key dot products are unrolled.
__device__ inline void op_attn_partial(const Ctx& c) {
  const int64_t* a = c.rec;
  const bf16* q = ptr<const bf16>(a[A_ATTN_PARTIAL_Q]);
  const bf16* kc = ptr<const bf16>(a[A_ATTN_PARTIAL_K_CACHE]);
  const bf16* vc = ptr<const bf16>(a[A_ATTN_PARTIAL_V_CACHE]);
  float* part = ptr<float>(a[A_ATTN_PARTIAL_PART]);
  float* lse = ptr<float>(a[A_ATTN_PARTIAL_LSE]);
  const int b = (int)a[A_ATTN_PARTIAL_B], g = (int)a[A_ATTN_PARTIAL_G], s = (int)a[A_ATTN_PARTIAL_SPLIT];
  const int S = (int)a[A_ATTN_PARTIAL_SPLITS], gs = (int)a[A_ATTN_PARTIAL_GS], D = (int)a[A_ATTN_PARTIAL_D];
  const int nq = (int)a[A_ATTN_PARTIAL_NQ], n_kv = (int)a[A_ATTN_PARTIAL_N_KV];
  const float scale = f32(a[A_ATTN_PARTIAL_SCALE]);
  const int64_t* bt = ptr<const int64_t>(c.P[P_BLOCK_TABLES]) + b * c.P[P_MAX_PAGES];
  const int64_t ps = c.P[P_PAGE_SIZE];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = THREADS / 32;
  const int64_t m0 = b;  // decode: T == 1
  const int64_t pos = seq_pos(c, b);
  const int64_t L = pos + 1;
  const int64_t lo = (L * s) / S, hi = (L * (s + 1)) / S;
  if (pos < 0 || hi <= lo) {  // inactive sequence or empty chunk
#pragma unroll 1
    for (int i = threadIdx.x; i < gs * D; i += THREADS)
      part[((m0 * nq + g * gs + i / D) * S + s) * D + i % D] = 0.f;
    for (int i = threadIdx.x; i < gs; i += THREADS) lse[(m0 * nq + g * gs + i) * S + s] = -INFINITY;
    return;
  }
  float* qs = reinterpret_cast<float*>(dyn_smem());   // (gs, D)
  float* wst = qs + MAX_GS * MAX_HEAD_DIM;        // per warp: mx (gs), l (gs), p (32, MAX_GS), acc (gs, D)
  constexpr int WSTRIDE = ATT_WARP_FLOATS;
  float* wmx = wst + warp * WSTRIDE;
  float* wl = wmx + MAX_GS;
  float* wp = wl + MAX_GS;
  float* wacc = wp + MAX_GS * 32;
  // Per warp, the K and V rows of its current 32-key block, copied global -> shared by cp.async (no registers held
  // while the loads fly: register-held loads made the compiler issue the 32 V loads of a block one after another,
  // ~15 us per block). K rows are padded by 16 bytes so that lanes (= keys) reading their rows hit distinct banks.
  // Shared-memory and load/store-unit traffic is what a block costs once its loads are asynchronous, so: copies
  // are coalesced (consecutive lanes take consecutive 16-byte pieces of the rows), each K piece and each V element
  // is read from shared memory once for all heads, q is read as broadcast 16-byte vectors, and the softmax state
  // and accumulators stay in registers until the end.
  const int KST = D + 8, CPR = D >> 3;   // bf16 per K row in shared memory; 16-byte pieces per row
  bf16* ks = reinterpret_cast<bf16*>(wst + nwarps * WSTRIDE) + (int64_t)warp * 32 * (KST + D);
  bf16* vs = ks + 32 * KST;
  const int64_t kstep = (int64_t)nwarps * 32;
  const int psi = (int)ps;
  // lane's key of the block at j0: its element offset in the caches, or -1 past the chunk
  auto key_off = [&](int64_t j0) -> long long {
    const int j = (int)(j0 + lane);
    if (j >= hi) return -1;
    const int pg = j / psi;
    const int64_t page = ld_const_s64(bt + pg);
    return ((page * ps + (j - pg * psi)) * n_kv + g) * D;
  };
  // one instruction covers 32 pieces = kpi keys (CPR a power of two <= 32), else lane = key
  const bool coal = (CPR & (CPR - 1)) == 0;
  const int kpi = coal ? 32 / CPR : 1, lkey = coal ? lane / CPR : 0, lpart = coal ? lane % CPR : 0;
  auto issue = [&](long long off) {   // the block's K and V rows (zeros past the chunk)
    if (coal) {
#pragma unroll 1
      for (int u0 = 0; u0 < 32; u0 += kpi) {
        const int u = u0 + lkey;
        const long long o = __shfl_sync(0xffffffffu, off, u);
        const bool ok = o >= 0;
        const long long src = (ok ? o : 0) + lpart * 8;
        cp_async16(ks + u * KST + lpart * 8, kc + src, ok);
        cp_async16(vs + u * D + lpart * 8, vc + src, ok);
      }
    } else {
      const bool ok = off >= 0;
      const long long src = ok ? off : 0;
#pragma unroll 1
      for (int e = 0; e < CPR; ++e) {
        cp_async16(ks + lane * KST + e * 8, kc + src + e * 8, ok);
        cp_async16(vs + lane * D + e * 8, vc + src + e * 8, ok);
      }
    }
  };
  int64_t j0 = lo + (int64_t)warp * 32;
  if (j0 < hi) issue(key_off(j0));   // the first block flies while q is staged
#pragma unroll 1
  for (int i = threadIdx.x; i < gs * D; i += THREADS)
    qs[i] = ld_act_bf16(q + m0 * (int64_t)nq * D + (int64_t)(g * gs) * D + i);
  __syncthreads();
  float mx[MAX_GS], sl[MAX_GS], acc[MAX_GS][2 * ATT_PAIRS];
#pragma unroll
  for (int h = 0; h < MAX_GS; ++h) {
    mx[h] = -INFINITY; sl[h] = 0.f;
#pragma unroll
    for (int i = 0; i < 2 * ATT_PAIRS; ++i) acc[h][i] = 0.f;
  }
  for (; j0 < hi; j0 += kstep) {
    const bool valid = j0 + lane < hi;
    const long long off_next = key_off(j0 + kstep);   // the next block's page-table entry, in flight meanwhile
    cp_async_wait_all();
    __syncwarp();
    // scores of this lane's key, every head: d = 0 .. D-1 in order (as the reference)
    float sc[MAX_GS];
#pragma unroll
    for (int h = 0; h < MAX_GS; ++h) sc[h] = 0.f;
#pragma unroll 1
    for (int e = 0; e < CPR; ++e) {
      const uint4 kv = *reinterpret_cast<const uint4*>(ks + lane * KST + e * 8);
#pragma unroll
      for (int h = 0; h < MAX_GS; ++h) {
        if (h < gs) {
          const float4 qa = *reinterpret_cast<const float4*>(qs + h * D + e * 8);
          const float4 qb = *reinterpret_cast<const float4*>(qs + h * D + e * 8 + 4);
          float t = sc[h];
          t = fmaf(qa.x, bf16_lo(kv.x), t); t = fmaf(qa.y, bf16_hi(kv.x), t);
          t = fmaf(qa.z, bf16_lo(kv.y), t); t = fmaf(qa.w, bf16_hi(kv.y), t);
          t = fmaf(qb.x, bf16_lo(kv.z), t); t = fmaf(qb.y, bf16_hi(kv.z), t);
          t = fmaf(qb.z, bf16_lo(kv.w), t); t = fmaf(qb.w, bf16_hi(kv.w), t);
          sc[h] = t;
        }
      }
    }
    // online softmax per head; p of (key, head) to shared memory for P.V
#pragma unroll
    for (int h = 0; h < MAX_GS; ++h) {
      if (h < gs) {
        const float s1 = valid ? sc[h] * scale : -INFINITY;
        const float mn = fmaxf(mx[h], warp_max(s1));   // finite: lane 0 always holds a key
        const float corr = expf(mx[h] - mn);
        const float p = valid ? expf(s1 - mn) : 0.f;
        sl[h] = sl[h] * corr + warp_sum(p);
        mx[h] = mn;
#pragma unroll
        for (int i = 0; i < 2 * ATT_PAIRS; ++i) acc[h][i] *= corr;
        wp[lane * MAX_GS + h] = p;
      }
    }
    __syncwarp();
    // P.V: lane owns element pairs d = 2 * lane + 64 * i; keys past the chunk are zero rows with p == 0
#pragma unroll 4
    for (int u = 0; u < 32; ++u) {
      float pu[MAX_GS];
#pragma unroll
      for (int h = 0; h < MAX_GS; h += 4) {
        const float4 p4 = *reinterpret_cast<const float4*>(wp + u * MAX_GS + h);
        pu[h] = p4.x; pu[h + 1] = p4.y; pu[h + 2] = p4.z; pu[h + 3] = p4.w;
      }
#pragma unroll
      for (int i = 0; i < ATT_PAIRS; ++i) {
        const int d = 2 * lane + 64 * i;
        if (d < D) {
          const uint32_t v2 = *reinterpret_cast<const uint32_t*>(vs + u * D + d);
          const float vlo = bf16_lo(v2), vhi = bf16_hi(v2);
#pragma unroll
          for (int h = 0; h < MAX_GS; ++h) {
            if (h < gs) {
              acc[h][2 * i] = fmaf(pu[h], vlo, acc[h][2 * i]);
              acc[h][2 * i + 1] = fmaf(pu[h], vhi, acc[h][2 * i + 1]);
            }
          }
        }
      }
    }
    __syncwarp();   // every lane is done with ks / vs / wp before the next block's copies and scores land there
    if (j0 + kstep < hi) issue(off_next);
  }
  // this warp's state for the cross-warp merge
#pragma unroll
  for (int h = 0; h < MAX_GS; ++h) {
    if (h < gs) {
      if (lane == 0) { wmx[h] = mx[h]; wl[h] = sl[h]; }
#pragma unroll
      for (int i = 0; i < ATT_PAIRS; ++i) {
        const int d = 2 * lane + 64 * i;
        if (d < D) { wacc[h * D + d] = acc[h][2 * i]; wacc[h * D + d + 1] = acc[h][2 * i + 1]; }
      }
    }
  }
  __syncthreads();
#pragma unroll 1
  for (int i = threadIdx.x; i < gs * D; i += THREADS) {
    const int h = i / D, d = i % D;
    float M = -INFINITY;
#pragma unroll 1
    for (int w = 0; w < nwarps; ++w) M = fmaxf(M, wst[w * WSTRIDE + h]);
    float den = 0.f, o = 0.f;
#pragma unroll 1
    for (int w = 0; w < nwarps; ++w) {
      const float* ws = wst + w * WSTRIDE;
      const float wm = ws[h];
      if (wm == -INFINITY) continue;  // a warp that saw no key
      const float e = expf(wm - M);
      den += ws[MAX_GS + h] * e;
      o += ws[2 * MAX_GS + MAX_GS * 32 + h * D + d] * e;
    }
    const int64_t hq = m0 * nq + g * gs + h;
    part[(hq * S + s) * D + d] = o / fmaxf(den, 1e-30f);
    if (d == 0) lse[hq * S + s] = M + logf(den);
  }
}

constexpr int MERGE_CHUNK = 8;   // splits whose lse / partial loads are issued together
__device__ inline void op_attn_merge(const Ctx& c) {
  const int64_t* a = c.rec;
  const float* part = ptr<const float>(a[A_ATTN_MERGE_PART]);
  const float* lse = ptr<const float>(a[A_ATTN_MERGE_LSE]);
  bf16* out = ptr<bf16>(a[A_ATTN_MERGE_OUT]);
  const int b = (int)a[A_ATTN_MERGE_B], g = (int)a[A_ATTN_MERGE_G], gs = (int)a[A_ATTN_MERGE_GS];
  const int D = (int)a[A_ATTN_MERGE_D], nq = (int)a[A_ATTN_MERGE_NQ], S = (int)a[A_ATTN_MERGE_SPLITS];
  const int64_t m0 = b;
  for (int i = threadIdx.x; i < gs * D; i += THREADS) {
    const int h = i / D, d = i % D;
    const int64_t hq = m0 * nq + g * gs + h;
    // The splits in chunks of MERGE_CHUNK whose loads fly together: 2 S / MERGE_CHUNK round trips instead of 2 S
    // dependent ones; the arithmetic (max in split order, then weights and sums in split order) is unchanged.
    float mx = -INFINITY;
#pragma unroll 1
    for (int s0 = 0; s0 < S; s0 += MERGE_CHUNK) {
      float l[MERGE_CHUNK];
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u) l[u] = s0 + u < S ? ld_act_f32(lse + hq * S + s0 + u) : -INFINITY;
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u)
        if (s0 + u < S) mx = fmaxf(mx, l[u]);
    }
    if (isinf(mx)) mx = 0.f;
    float ws = 0.f, o = 0.f;
#pragma unroll 1
    for (int s0 = 0; s0 < S; s0 += MERGE_CHUNK) {
      float l[MERGE_CHUNK], pv[MERGE_CHUNK];
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u) {
        l[u] = s0 + u < S ? ld_act_f32(lse + hq * S + s0 + u) : 0.f;
        pv[u] = s0 + u < S ? ld_act_f32(part + (hq * S + s0 + u) * D + d) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < MERGE_CHUNK; ++u) {
        if (s0 + u < S) {
          const float wgt = expf(l[u] - mx);
          ws += wgt;
          o += pv[u] * wgt;
        }
      }
    }
    out[m0 * (int64_t)nq * D + (int64_t)(g * gs + h) * D + d] = __float2bfloat16_rn(o / fmaxf(ws, 1e-30f));
  }
}

}  // namespace mpk
