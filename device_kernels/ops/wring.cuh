// Per-warp weight page rings for batch-1 linear and qkv_rope tiles (experimental build -DMPK_WRING=<KB>;
// runtime/wring.py lays out the pages and documents the scheme). Warp w owns RING_SLOTS slots of MPK_RING_SLOT bytes
// at dynamic shared byte P_RING_OFF + (w * RING_SLOTS + slot) * MPK_RING_SLOT, each with an mbarrier (arrival
// count 1 + transaction bytes).
// Page q of the warp's sequence (its pages of one step, wrapping each step) lives in slot q % RING_SLOTS, phase
// (q / RING_SLOTS) & 1. Lane 0 issues page q + RING_SLOTS into a slot as soon as the warp has read page q from it:
// weights never depend on events, so the copies run ahead across task boundaries and waits. The pages are cut here
// from one descriptor per (warp, tile) segment, the next one prefetched a segment ahead (session 28's first build
// read a table entry per page from HBM before each copy: +77% at 1.75 KB pages), and load L2 evict-first.
// The rings sit inside the launch's shared memory, above the ring tiles' own layouts, so they share bytes with the
// larger layouts of other ops (attention's K/V buffers, the LM head's and argmax's rows): those tasks carry
// RING_CLOB_BIT, and a segment's descriptor word 3 gates its pages (runtime/wring.py lay_out): they are issued only
// once the warp has seen the clobbering tasks before its tile finish (ring_resume), so no copy is in flight while such
// a task runs (session 29: rings above every layout cost L1 more than their lookahead bought).
#pragma once
#include "../common.cuh"

#if MPK_WRING
#ifndef MPK_RING_SLOT
#define MPK_RING_SLOT 4096
#endif

namespace mpk {
constexpr int RING_NW = THREADS / 32;
constexpr int RING_SLOTS = MPK_WRING * 1024 / RING_NW / MPK_RING_SLOT;   // runtime/wring.py RingConfig.slots
static_assert(RING_SLOTS >= 1, "MPK_WRING too small for one MPK_RING_SLOT page per warp");
static_assert(MPK_RING_SLOT % 32 == 0, "two-weight pages split into 16-byte multiples");
constexpr int64_t RING_BIT = 1LL << RING_SHIFT;
constexpr int64_t RING_CLOB_BIT = 1LL << RING_CLOB_SHIFT;
constexpr int64_t RING_OPEN_BIT = 1LL << RING_OPEN_SHIFT;

__shared__ __align__(8) uint64_t mpk_ring_bar[RING_NW][RING_SLOTS];
// per warp: the next page to read (q) and to issue (iq); the issue cursor: segment (counted over the launch's steps)
// and byte offset in it; the warp's first segment in the table, its segments a step and this launch
__shared__ int64_t mpk_ring_q[RING_NW], mpk_ring_iq[RING_NW], mpk_ring_seg[RING_NW], mpk_ring_off[RING_NW];
__shared__ int64_t mpk_ring_base[RING_NW], mpk_ring_n[RING_NW], mpk_ring_lim[RING_NW];
// per warp: the clobbering tasks (RING_CLOB_BIT) of its SM finished in this launch, and how many the cursor's
// segment waits for (ring_gate)
__shared__ int64_t mpk_ring_done[RING_NW], mpk_ring_need[RING_NW];
// the cursor's segment descriptor and the next one (runtime/wring.py SEG_WORDS: w0, w1 or 0, bytes of each, pad),
// the next one copied in by cp.async a segment ahead
__shared__ __align__(16) int64_t mpk_ring_cur[RING_NW][4], mpk_ring_nxt[RING_NW][4];

// bytes from global src into shared dst on bar, L2 evict-first (the direct path's .cs loads keep x, partials and
// K/V resident in L2 the same way)
__device__ __forceinline__ void ring_g2s(uint32_t dst, int64_t src, uint32_t bytes, uint32_t bar, uint64_t pol) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol) : "memory");
}

// Lane 0: segment s's descriptor into the warp's `nxt` (cp.async; waited for when the cursor reaches it).
__device__ __forceinline__ void ring_prefetch(const int64_t* P, int w, int64_t s) {
  const int64_t* d = ptr<const int64_t>(P[P_RING_SEGS]) + (mpk_ring_base[w] + s % mpk_ring_n[w]) * 4;
  cp_async16(&mpk_ring_nxt[w][0], d, true);
  cp_async16(&mpk_ring_nxt[w][2], d + 2, true);
  cp_async_commit();
}

// Lane 0, when the cursor enters a segment: the clobbers its pages wait for. Descriptor word 3 (runtime/wring.py
// lay_out): the tile's clobbering tasks before it in a step (low 32 bits) and the SM's in a step (high 32); 0: none.
__device__ __forceinline__ void ring_gate(int w) {
  const int64_t g = mpk_ring_cur[w][3];
  mpk_ring_need[w] = g == 0 ? 0 : (mpk_ring_seg[w] / mpk_ring_n[w]) * (g >> 32) + (g & 0xffffffffLL);
}

// Lane 0: the warp's next page (the cursor's next part of each weight) into its slot, then the cursor moves on.
// Nothing past the launch's last segment, and nothing of a segment whose gate is closed (its tile comes after a
// clobbering task that has not finished: ring_gate). False when nothing was issued.
__device__ __forceinline__ bool ring_issue(const int64_t* P, int w) {
  const int64_t seg = mpk_ring_seg[w];
  if (seg >= mpk_ring_lim[w]) return false;
  if (mpk_ring_done[w] < mpk_ring_need[w]) return false;
  const int64_t s0 = mpk_ring_cur[w][0], s1 = mpk_ring_cur[w][1], tot = mpk_ring_cur[w][2], off = mpk_ring_off[w];
  const int64_t part = s1 != 0 ? MPK_RING_SLOT / 2 : MPK_RING_SLOT;
  const uint32_t nb = (uint32_t)min(part, tot - off);
  const int64_t iq = mpk_ring_iq[w];
  const int slot = (int)(iq % RING_SLOTS);
  const uint32_t bar = smem_addr(&mpk_ring_bar[w][slot]);
  const uint32_t dst = smem_addr(dyn_smem() + P[P_RING_OFF]) + (uint32_t)((w * RING_SLOTS + slot) * MPK_RING_SLOT);
  uint64_t pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  // this warp's reads of the slot (generic proxy, ordered before lane 0 by the __syncwarp) come before the copy
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect_tx(bar, s1 != 0 ? 2u * nb : nb);
  ring_g2s(dst, s0 + off, nb, bar, pol);
  if (s1 != 0) ring_g2s(dst + MPK_RING_SLOT / 2, s1 + off, nb, bar, pol);
  mpk_ring_iq[w] = iq + 1;
  if (off + nb < tot) {
    mpk_ring_off[w] = off + nb;
    return true;
  }
  mpk_ring_off[w] = 0;   // the segment is issued: the next one's descriptor (prefetched) becomes the cursor's
  mpk_ring_seg[w] = seg + 1;
  if (seg + 1 < mpk_ring_lim[w]) {
    cp_async_wait_all();
#pragma unroll
    for (int j = 0; j < 4; ++j) mpk_ring_cur[w][j] = mpk_ring_nxt[w][j];
    ring_gate(w);
    if (seg + 2 < mpk_ring_lim[w]) ring_prefetch(P, w, seg + 2);
  }
  return true;
}

// Every warp's lane 0, once per launch: the barriers, the warp's segments, the first descriptor (and the next one in
// flight), and its first RING_SLOTS pages.
__device__ __noinline__ void ring_start(const int64_t* P, int sm, int nsteps) {
  if ((threadIdx.x & 31) != 0) return;
  const int w = threadIdx.x >> 5;
  const int32_t* offs = ptr<const int32_t>(P[P_RING_OFFS]);
  const int64_t b = offs[sm * RING_NW + w], n = offs[sm * RING_NW + w + 1] - b;
  mpk_ring_base[w] = b;
  mpk_ring_n[w] = n;
  mpk_ring_lim[w] = n * nsteps;
  mpk_ring_q[w] = mpk_ring_iq[w] = mpk_ring_seg[w] = mpk_ring_off[w] = mpk_ring_done[w] = 0;
  for (int s = 0; s < RING_SLOTS; ++s) mbar_init(smem_addr(&mpk_ring_bar[w][s]));
  if (n == 0) return;
  const int64_t* d = ptr<const int64_t>(P[P_RING_SEGS]) + b * 4;
#pragma unroll
  for (int j = 0; j < 4; ++j) mpk_ring_cur[w][j] = d[j];
  ring_gate(w);
  if (mpk_ring_lim[w] > 1) ring_prefetch(P, w, 1);
  for (int s = 0; s < RING_SLOTS && ring_issue(P, w); ++s) {}
}

// Every warp's lane 0, after a clobbering task (RING_CLOB_BIT) and the barrier that ended it, or when an opening
// task (RING_OPEN_BIT) starts: one more gate passed, then the warp's slots refilled as far as the gates now allow (the pages its reads skipped while closed).
__device__ __noinline__ void ring_resume(const int64_t* P) {
  const int w = threadIdx.x >> 5;
  ++mpk_ring_done[w];
  while (mpk_ring_iq[w] < mpk_ring_q[w] + RING_SLOTS && ring_issue(P, w)) {}
}

// Lane 0 of every warp, before an aborting CTA exits: wait for the copies still in flight into its slots.
__device__ __noinline__ void ring_drain() {
  if ((threadIdx.x & 31) != 0) return;
  const int w = threadIdx.x >> 5;
  for (int64_t q = mpk_ring_q[w]; q < mpk_ring_iq[w]; ++q)
    mbar_wait(smem_addr(&mpk_ring_bar[w][q % RING_SLOTS]), (uint32_t)((q / RING_SLOTS) & 1));
  cp_async_wait_all();
}

// y0s[n - n0] (and y1s with w1: TWO) = xs . w[n] for the warp's rows [ra, rb) (codegen/layout.py ring_rows), one row
// of x (K bf16 in shared memory), the weights from the warp's ring pages (a page may end inside a row). Each lane
// accumulates its vectors k = lane, lane + 32, ... of a row in order, then a warp butterfly: linear_pass's sums
// (one K segment), bit for bit. Ends with __syncthreads().
template <bool TWO>
__device__ __noinline__ void linear_ring_core(const int64_t* P, const bf16* xs, int K, int n0, int n1, float* y0s,
                                              float* y1s) {
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int rpw = (n1 - n0 + RING_NW - 1) / RING_NW;
  const int ra = n0 + w * rpw, rb = min(n1, ra + rpw);
  if (ra < rb) {
    const int RV = K >> 3;                                      // 16-byte vectors a row
    constexpr int PV = (TWO ? MPK_RING_SLOT / 2 : MPK_RING_SLOT) / 16;   // vectors of each weight a page
    const int TV = (rb - ra) * RV;
    const unsigned char* ring = dyn_smem() + P[P_RING_OFF];
    int64_t q = mpk_ring_q[w];
    float a0 = 0.f, a1 = 0.f;
    for (int vb = 0; vb < TV; vb += PV, ++q) {
      const int slot = (int)(q % RING_SLOTS);
      mbar_wait(smem_addr(&mpk_ring_bar[w][slot]), (uint32_t)((q / RING_SLOTS) & 1));
      const uint4* s0 = reinterpret_cast<const uint4*>(ring + (w * RING_SLOTS + slot) * MPK_RING_SLOT) - vb;
      const uint4* s1 = s0 + MPK_RING_SLOT / 2 / 16;
      const int ve = min(vb + PV, TV);
      for (int r = vb / RV; r * RV < ve; ++r) {   // the rows the page holds (part of)
        const int kb = max(vb - r * RV, 0), ke = min(ve - r * RV, RV);
        const uint4* w0r = s0 + r * RV;
        const uint4* w1r = s1 + r * RV;
#pragma unroll 4
        for (int kk = kb + ((lane - kb) & 31); kk < ke; kk += 32) {   // this lane's k = lane mod 32, in order
          const uint4 xv = *reinterpret_cast<const uint4*>(xs + kk * 8);
          a0 = dot8(w0r[kk], xv, a0);
          if (TWO) a1 = dot8(w1r[kk], xv, a1);
        }
        if (ke == RV) {   // the row is complete
          const float t0 = warp_sum(a0);
          const float t1 = TWO ? warp_sum(a1) : 0.f;
          if (lane == 0) {
            y0s[ra + r - n0] = t0;
            if (TWO) y1s[ra + r - n0] = t1;
          }
          a0 = 0.f;
          a1 = 0.f;
        }
      }
      __syncwarp();   // every lane has read the page
      if (lane == 0) ring_issue(P, w);   // page q + RING_SLOTS (the warp issues its pages in order)
    }
    if (lane == 0) mpk_ring_q[w] = q;
  }
  __syncthreads();
}
}  // namespace mpk
#endif
