// attention: split-KV causal GQA decode attention over the paged cache   (tasks/ops/attention.py)
// attn_partial(b, g, s): warps take 32-key blocks of chunk s round-robin (lane = key for the scores, lane =
// element pairs d = 2*lane + 64*i for the output), online softmax per q head, warps merged in shared memory.
#pragma once
#include "../common.cuh"

namespace mpk {

constexpr int ATT_PAIRS = (MAX_HEAD_DIM + 63) / 64;  // bf16 pairs per lane

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
    for (int i = threadIdx.x; i < gs * D; i += THREADS)
      part[((m0 * nq + g * gs + i / D) * S + s) * D + i % D] = 0.f;
    for (int i = threadIdx.x; i < gs; i += THREADS) lse[(m0 * nq + g * gs + i) * S + s] = -INFINITY;
    return;
  }
  float* qs = reinterpret_cast<float*>(c.smem);  // (gs, D)
  float* wst = qs + MAX_GS * MAX_HEAD_DIM;       // per warp: (gs) max, (gs) sum, (gs, D) acc
  const int wstride = MAX_GS * (MAX_HEAD_DIM + 2);
  for (int i = threadIdx.x; i < gs * D; i += THREADS)
    qs[i] = ld_act_bf16(q + m0 * (int64_t)nq * D + (int64_t)(g * gs) * D + i);
  __syncthreads();
  float mx[MAX_GS], l[MAX_GS], acc[MAX_GS][2 * ATT_PAIRS];
#pragma unroll
  for (int h = 0; h < MAX_GS; ++h) {
    mx[h] = -INFINITY; l[h] = 0.f;
#pragma unroll
    for (int i = 0; i < 2 * ATT_PAIRS; ++i) acc[h][i] = 0.f;
  }
  // Lane-parallel keys: a warp takes 32 consecutive keys, lane j scores key j0 + j against every q head of the
  // group (whole K row, 16-byte loads), one warp max/sum per head per 32 keys; then V rows are read coalesced
  // (lane owns element pairs) with p broadcast by shuffles. ~3 memory round trips per 32 keys, not 2 per key.
  constexpr int KV8 = MAX_HEAD_DIM / 8;
  for (int64_t j0 = lo + (int64_t)warp * 32; j0 < hi; j0 += (int64_t)nwarps * 32) {
    const int nk = (int)min((int64_t)32, hi - j0);   // warp-uniform
    const int64_t j = j0 + lane;
    const bool valid = lane < nk;
    long long off = 0;
    if (valid) {
      const int64_t page = ld_act_s64(bt + j / ps);
      off = ((page * ps + j % ps) * n_kv + g) * D;
    }
    uint4 kr[KV8];
#pragma unroll
    for (int e = 0; e < KV8; ++e) kr[e] = (valid && e * 8 < D) ? ld_act16(kc + off + e * 8) : make_uint4(0, 0, 0, 0);
    float pr[MAX_GS];
#pragma unroll
    for (int h = 0; h < MAX_GS; ++h) {
      pr[h] = 0.f;
      if (h < gs) {
        float sc = 0.f;
        const float* qh = qs + h * D;
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
        const float mn = fmaxf(mx[h], warp_max(sc));     // finite: lane 0 always holds a key
        const float corr = expf(mx[h] - mn);
        const float p = valid ? expf(sc - mn) : 0.f;
        l[h] = l[h] * corr + warp_sum(p);
#pragma unroll
        for (int i = 0; i < 2 * ATT_PAIRS; ++i) acc[h][i] *= corr;
        mx[h] = mn;
        pr[h] = p;
      }
    }
    for (int jb = 0; jb < nk; jb += 8) {   // V rows, 8 keys' loads in flight per lane
      uint32_t vu[8][ATT_PAIRS];
#pragma unroll
      for (int u = 0; u < 8; ++u) {
        const long long o = __shfl_sync(0xffffffffu, off, jb + u);
#pragma unroll
        for (int i = 0; i < ATT_PAIRS; ++i) {
          const int d = 2 * lane + 64 * i;
          vu[u][i] = (jb + u < nk && d < D) ? __ldcg(reinterpret_cast<const unsigned int*>(vc + o + d)) : 0u;
        }
      }
#pragma unroll
      for (int u = 0; u < 8; ++u) {
#pragma unroll
        for (int h = 0; h < MAX_GS; ++h) {
          if (h < gs) {
            const float p = __shfl_sync(0xffffffffu, pr[h], jb + u);   // 0 for keys past nk
#pragma unroll
            for (int i = 0; i < ATT_PAIRS; ++i) {
              acc[h][2 * i] = fmaf(p, bf16_lo(vu[u][i]), acc[h][2 * i]);
              acc[h][2 * i + 1] = fmaf(p, bf16_hi(vu[u][i]), acc[h][2 * i + 1]);
            }
          }
        }
      }
    }
  }
  float* my = wst + warp * wstride;
#pragma unroll
  for (int h = 0; h < MAX_GS; ++h) {
    if (h < gs) {
      if (lane == 0) { my[h] = mx[h]; my[MAX_GS + h] = l[h]; }
#pragma unroll
      for (int i = 0; i < ATT_PAIRS; ++i) {
        const int d = 2 * lane + 64 * i;
        if (d < D) {
          my[2 * MAX_GS + h * D + d] = acc[h][2 * i];
          my[2 * MAX_GS + h * D + d + 1] = acc[h][2 * i + 1];
        }
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < gs * D; i += THREADS) {
    const int h = i / D, d = i % D;
    float M = -INFINITY;
    for (int w = 0; w < nwarps; ++w) M = fmaxf(M, wst[w * wstride + h]);
    float den = 0.f, o = 0.f;
    for (int w = 0; w < nwarps; ++w) {
      const float wm = wst[w * wstride + h];
      if (wm == -INFINITY) continue;  // a warp that saw no key
      const float e = expf(wm - M);
      den += wst[w * wstride + MAX_GS + h] * e;
      o += wst[w * wstride + 2 * MAX_GS + h * D + d] * e;
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
