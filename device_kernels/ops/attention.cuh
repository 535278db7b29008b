// attention: split-KV causal GQA decode attention over the paged cache   (tasks/ops/attention.py)
// attn_partial(b, g, s): warps take 32-key blocks of chunk s round-robin (lane = key for the scores, lane =
// element pairs d = 2*lane + 64*i for the output), online softmax per q head, warps merged in shared memory.
// Keep in sync: runtime/megakernel.py _pack_attn_partial sizes the shared memory from ATT_WARP_FLOATS.
#pragma once
#include "../common.cuh"

namespace mpk {

constexpr int ATT_PAIRS = (MAX_HEAD_DIM + 63) / 64;  // bf16 pairs per lane
constexpr int ATT_WARP_FLOATS = MAX_GS * (2 + 32 + MAX_HEAD_DIM);  // per-warp softmax state in shared memory

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
  float* qs = reinterpret_cast<float*>(c.smem);   // (gs, D)
  float* wst = qs + MAX_GS * MAX_HEAD_DIM;        // per warp: mx (gs), l (gs), p (gs, 32), acc (gs, D)
  constexpr int WSTRIDE = ATT_WARP_FLOATS;
  float* wmx = wst + warp * WSTRIDE;
  float* wl = wmx + MAX_GS;
  float* wp = wl + MAX_GS;
  float* wacc = wp + MAX_GS * 32;
  // A 32-key block: lane = key. The page-table entry and the key's whole K row ; scores and online-softmax statistics for every head; then the V element pairs of all 32 keys
  // in one batch of loads, and P.V per head: three dependent memory round trips per block.
  constexpr int KV8 = MAX_HEAD_DIM / 8;
  uint4 kr[KV8];
  long long off = 0;
  int nk = 0;
  auto issue = [&](int64_t j0) {
    nk = (int)min((int64_t)32, hi - j0);   // warp-uniform
    const int64_t j = j0 + lane;
    off = 0;
    if (lane < nk) {
      const int64_t page = ld_act_s64(bt + j / ps);
      off = ((page * ps + j % ps) * n_kv + g) * D;
    }
#pragma unroll
    for (int e = 0; e < KV8; ++e) kr[e] = (lane < nk && e * 8 < D) ? ld_act16(kc + off + e * 8) : make_uint4(0, 0, 0, 0);
  };
  int64_t j0 = lo + (int64_t)warp * 32;
#pragma unroll 1
  for (int i = threadIdx.x; i < gs * D; i += THREADS)
    qs[i] = ld_act_bf16(q + m0 * (int64_t)nq * D + (int64_t)(g * gs) * D + i);
#pragma unroll 1
  for (int h = 0; h < gs; ++h) {
    if (lane == 0) { wmx[h] = -INFINITY; wl[h] = 0.f; }
#pragma unroll 1
    for (int d = lane; d < D; d += 32) wacc[h * D + d] = 0.f;
  }
  __syncthreads();
  for (; j0 < hi; j0 += (int64_t)nwarps * 32) {
    issue(j0);
    const bool valid = lane < nk;
#pragma unroll 1
    for (int h = 0; h < gs; ++h) {
      const float* qh = qs + h * D;
      float sc = 0.f;
#pragma unroll
      for (int e = 0; e < KV8; ++e) {
        if (e * 8 < D) {
          const uint32_t u[4] = {kr[e].x, kr[e].y, kr[e].z, kr[e].w};
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            sc = fmaf(qh[e * 8 + 2 * t], bf16_lo(u[t]), sc);
            sc = fmaf(qh[e * 8 + 2 * t + 1], bf16_hi(u[t]), sc);
          }
        }
      }
      sc = valid ? sc * scale : -INFINITY;
      const float mo = wmx[h];
      const float mn = fmaxf(mo, warp_max(sc));   // finite: lane 0 always holds a key
      const float corr = expf(mo - mn);
      const float p = valid ? expf(sc - mn) : 0.f;
      const float ln = wl[h] * corr + warp_sum(p);
      wp[h * 32 + lane] = p;
#pragma unroll
      for (int i = 0; i < ATT_PAIRS; ++i) {   // rescale this lane's accumulator pairs
        const int d = 2 * lane + 64 * i;
        if (d < D) { wacc[h * D + d] *= corr; wacc[h * D + d + 1] *= corr; }
      }
      __syncwarp();
      if (lane == 0) { wmx[h] = mn; wl[h] = ln; }
    }
    // V rows of the block, all its keys in one batch of loads: lane owns element pairs d = 2 * lane + 64 * i; keys past
    // nk load 0 (and have p == 0)
#pragma unroll 1
    for (int kb = 0; kb < nk; kb += 32) {
      uint32_t vu[32][ATT_PAIRS];
#pragma unroll
      for (int u = 0; u < 32; ++u) {
        const long long o = __shfl_sync(0xffffffffu, off, kb + u);
#pragma unroll
        for (int i = 0; i < ATT_PAIRS; ++i) {
          const int d = 2 * lane + 64 * i;
          vu[u][i] = (kb + u < nk && d < D) ? __ldcg(reinterpret_cast<const unsigned int*>(vc + o + d)) : 0u;
        }
      }
      __syncwarp();
#pragma unroll 1
      for (int h = 0; h < gs; ++h) {
        float ac[2 * ATT_PAIRS];
#pragma unroll
        for (int i = 0; i < ATT_PAIRS; ++i) {
          const int d = 2 * lane + 64 * i;
          ac[2 * i] = d < D ? wacc[h * D + d] : 0.f;
          ac[2 * i + 1] = d < D ? wacc[h * D + d + 1] : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 32; ++u) {
          const float pu = wp[h * 32 + kb + u];
#pragma unroll
          for (int i = 0; i < ATT_PAIRS; ++i) {
            ac[2 * i] = fmaf(pu, bf16_lo(vu[u][i]), ac[2 * i]);
            ac[2 * i + 1] = fmaf(pu, bf16_hi(vu[u][i]), ac[2 * i + 1]);
          }
        }
#pragma unroll
        for (int i = 0; i < ATT_PAIRS; ++i) {
          const int d = 2 * lane + 64 * i;
          if (d < D) { wacc[h * D + d] = ac[2 * i]; wacc[h * D + d + 1] = ac[2 * i + 1]; }
        }
      }
    }
    __syncwarp();
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
    float mx = -INFINITY;
    for (int s = 0; s < S; ++s) mx = fmaxf(mx, ld_act_f32(lse + hq * S + s));
    if (isinf(mx)) mx = 0.f;
    float ws = 0.f, o = 0.f;
    for (int s = 0; s < S; ++s) {
      const float wgt = expf(ld_act_f32(lse + hq * S + s) - mx);
      ws += wgt;
      o += ld_act_f32(part + (hq * S + s) * D + d) * wgt;
    }
    out[m0 * (int64_t)nq * D + (int64_t)(g * gs + h) * D + d] = __float2bfloat16_rn(o / fmaxf(ws, 1e-30f));
  }
}

}  // namespace mpk
