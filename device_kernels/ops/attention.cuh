// attention: split-KV causal GQA decode attention over the paged cache   (tasks/ops/attention.py)
// attn_partial(b, g, s): the whole CTA walks chunk s of the keys in passes of up to ATT_KP keys. A pass's K and V
// rows are copied into shared memory (cp.async, double-buffered: the next pass's rows fly while this one
// computes). q, the sequence's page table and its position are fetched together, so the first K/V copy is one
// round trip after the task starts.
// Tensor Cores (v24): warp w owns keys [16 w, 16 w + 16) of every pass and keeps its own online softmax (running
// max and sum per head) and output, so a pass has no barrier between scores, softmax and P.V; the 8 warps' (max,
// sum, output) are merged once at the end through shared memory. Scores S = Q K^T by mma m16n8k16 (rows: the
// group's q heads, padded to 16; columns: 8 keys; the d order inside an mma permuted alike in both operands, as the
// linear tiles do), P.V as O^T = V^T P^T by mma m16n8k16 bf16 (rows: 16 d, columns: the 8 heads, k: the warp's 16
// keys), the thread's own probabilities feeding the B operand directly (its score columns are exactly its B
// fragment), each probability split into bf16 hi + lo (two mma's: P.V to ~2^-18 of fp32; a single rounded part
// moved the tiny configs 3-10x further from pyvm, docs/perf-notes.md v24), V^T fragments by ldmatrix.trans (v25:
// a quarter of v24b's tf32 tensor work, an eighth of its shared-memory loads).
// Keep in sync: codegen/layout.py att_smem_bytes (the packer sizes the shared memory with it).
#pragma once
#include "../common.cuh"
#include "attention_merge.cuh"
#include "qk_norm.cuh"

namespace mpk {

// MPK_ATT_WARP_PIPE (default 1 since session 17; -DMPK_ATT_WARP_PIPE=0 through MPK_NVCC_DEFINES for the CTA-barrier
// schedule): each warp streams its own 16 rows of every pass and a pass has no CTA barrier (session 16's stage
// stamps: at B=32-128 a pass took ~1.75 us for ~0.9 us of a warp's compute, the rest its two barriers and the
// CTA-wide copy issue between them). Measured (1x H200, cf19493, planned attn-mk): llama-3.2-1b B=128 ctx 512 / 4096
// -2.5% / -6.8%, qwen3-8b -2.3% / -7.1%; one megakernel at B=1, 8 within 1% (bench/results/s17).
#ifndef MPK_ATT_WARP_PIPE
#define MPK_ATT_WARP_PIPE 1
#endif
// MPK_ATT_STAGES=N (with the warp pipe; default 2): a ring of N K/V pass buffers, N - 1 passes in flight while one
// computes (two: the one pass in flight of the default schedule). Keep in sync: codegen/layout.py att_smem_bytes and
// packer.py (nvcc.define_int("MPK_ATT_STAGES")).
#ifndef MPK_ATT_STAGES
#define MPK_ATT_STAGES 2
#endif
static_assert(MPK_ATT_STAGES >= 2 && MPK_ATT_STAGES <= 6, "attention: 2 to 6 K/V stages");
static_assert(MPK_ATT_STAGES == 2 || MPK_ATT_WARP_PIPE, "attention: more than two K/V stages need the warp pipe (MPK_ATT_WARP_PIPE=1, the default)");
constexpr int ATT_NST = MPK_ATT_STAGES;
// MPK_ATT_DIAG_L2=1: a diagnostic build for A/B timing only (gpu_pending.sh ab diagl2; its attention output is
// wrong): every K/V row is read from its sequence's first page, so the copies hit L2 instead of HBM. If the wide
// passes get much faster, the HBM side of their scattered 128-byte rows is the limit; if not, the copy issue or
// the per-pass chain is (docs/perf-notes.md session 21).
#ifndef MPK_ATT_DIAG_L2
#define MPK_ATT_DIAG_L2 0
#endif
// MPK_ATT_PV_SPLIT=0 (opt-in, gpu_pending.sh ab pv1): P.V with the probabilities rounded to bf16 once (one mma per
// 16 d and tile instead of hi + lo; what FlashAttention and HF's eager attention do; ~2^-9 relative per probability).
// Session 20: -1.8% / -2.5% at llama B=32 / 128 ctx 4096, but 2 GPU tests' tokens differ from the pyvm twin, which
// models the hi + lo split. (Its companions, the copy-issue loop unrolled 4x and exp2f, cost ~3.5% and were removed.)
#ifndef MPK_ATT_PV_SPLIT
#define MPK_ATT_PV_SPLIT 1
#endif
// A task of ng > 1 KV groups (ng dividing the 8 warps; gwm below) runs its groups side by side. Warp w takes group
// w / wpg (wpg = 8 / ng warps a group) and that group's KW-key blocks w % wpg, w % wpg + wpg, ..., through its own
// rows of the K/V buffers, so the passes need no CTA barrier, and one merge at the end serves every group, over its
// wpg warps (finish_gw). Until session 24 each group finished before the next started (two CTA barriers and a
// cross-warp merge a group, ~3 us, with one pass in flight): side by side measured llama attn-mk B=128 -5.9% at ctx
// 512, -0.2% at 4096, B=32 -3.8% / +0.1%, qwen3-8b B=128 -4.5% / -1.1% (bench/results/s24/run1_gw), and that order
// was removed (codegen/nvcc.py REMOVED_DEFINES MPK_ATT_GW). It remains where groups cannot be split over the warps
// (ng not dividing 8, or without the warp pipe). Per group the sums run over wpg warps, so results depend on ng
// (fp32 reassociation): tp_invariant graphs keep ng = 1 (tasks/ops/attention.py).

// ATT_KP (keys per pass) and ATT_MAX_PAGES come from codegen/layout.py (mpk_generated.h)
// shared-memory layout (bytes): q (bf16, ATT_MAX_QH x MAX_HEAD_DIM: the task's ng groups) | page table (s64, ATT_MAX_PAGES) | K rows
// 2 x ATT_KP x (D + 8) | V rows 2 x ATT_KP x (D + 8) (bf16; padded: the V loads, lanes = (d, key pair), hit distinct
// banks). The end merge reuses the K buffers: outputs (f32, warps x MAX_GS x D), then maxima and sums.
constexpr int ATT_OFF_PAGES = ATT_MAX_QH * MAX_HEAD_DIM * 2;
constexpr int ATT_OFF_K = ATT_OFF_PAGES + ATT_MAX_PAGES * 8;
static_assert(ATT_OFF_PAGES % 16 == 0 && ATT_OFF_K % 16 == 0, "attention shared-memory layout");
static_assert(ATT_KP == 16 * (THREADS / 32) && MAX_GS <= 8, "attention: 16 keys of a pass per warp, <= 8 q heads");
static_assert(ATT_MAX_QH >= MAX_GS, "attention: a task holds at least one group's q heads");
// Wide passes (arg `wide` = R, 1 or 2; packer.py / tasks/tiling.py attn_wide): a pass is R x ATT_KP keys, warp w's
// rows [16 R w, 16 R w + 16 R) as R independent 16-key tiles (their score chains interleave; one softmax update,
// one rescale and one wait per pass). Session 19: the KV piece benchmark showed the pass rate, not HBM's piece
// efficiency, bounds a task; R = 2 halves the per-pass chain per key where the shared memory allows it
// (head_dim <= 64: llama's D = 64).

// The chunk: part / lse of chunk s of group (b, g); with ng > 1 (one split, direct: packer.py), the outputs of
// groups g .. g + ng - 1 of sequence b, their passes one pipeline (a group's first rows fly while the previous
// group's last pass computes; the page table and q are fetched once): per group the same arithmetic as ng = 1.
// Deferred KV append (ir/defer.py: the conventional qkv_rope left the step's rows in kv_new, (M, 2 n_kv D) with row
// stride ld: k heads, then v heads): row m0's k and v of groups g .. g + ng - 1 into the paged caches at position
// pos, in 16-byte pieces. Called by the partial whose chunk holds pos, before its passes (a CTA barrier after it);
// no other task of the step reads that chunk of these groups. A call of its own: it stays out of the pass loop's
// register allocation.
__device__ __noinline__ void attn_append_new_row(const bf16* kv_new, int64_t ld, bf16* kc, bf16* vc, int64_t m0,
                                                  int64_t page, int64_t slot, int g, int ng, int n_kv, int64_t ps,
                                                  int D) {
  const int CPR = D >> 3, per = ng * CPR;
  const bf16* row = kv_new + m0 * ld;
#pragma unroll 1
  for (int i = threadIdx.x; i < 2 * per; i += THREADS) {
    const int isv = i >= per, r = i - isv * per, gv = r / CPR, e = r - gv * CPR;
    const uint4 v = *reinterpret_cast<const uint4*>(row + (int64_t)(isv * n_kv + g + gv) * D + e * 8);
    *reinterpret_cast<uint4*>((isv ? vc : kc) + kv_row(page, slot, g + gv, n_kv, ps, D) + e * 8) = v;
  }
}

// R: 16-key tiles per warp and pass (1 or 2).
template <int R>
__device__ inline void attn_partial_chunk(const Ctx& c) {
  constexpr int KP = R * ATT_KP, KW = 16 * R;   // keys of a pass, keys of a warp's pass
  static_assert(R == 1 || R == 2, "attention: 1 or 2 16-key tiles per warp and pass");
  const int64_t* a = c.rec;
  const bf16* q = ptr<const bf16>(a[A_ATTN_PARTIAL_Q]);
  const bf16* kc = ptr<const bf16>(a[A_ATTN_PARTIAL_K_CACHE]);
  const bf16* vc = ptr<const bf16>(a[A_ATTN_PARTIAL_V_CACHE]);
  float* part = ptr<float>(a[A_ATTN_PARTIAL_PART]);
  float* lse = ptr<float>(a[A_ATTN_PARTIAL_LSE]);
  const int b = (int)a[A_ATTN_PARTIAL_B], g = (int)a[A_ATTN_PARTIAL_G], s = (int)a[A_ATTN_PARTIAL_SPLIT];
  const int S = (int)a[A_ATTN_PARTIAL_SPLITS], gs = (int)a[A_ATTN_PARTIAL_GS], D = (int)a[A_ATTN_PARTIAL_D];
  const int nq = (int)a[A_ATTN_PARTIAL_NQ], n_kv = (int)a[A_ATTN_PARTIAL_N_KV];
  const int ng = (int)a[A_ATTN_PARTIAL_NG];   // KV groups of this task (ng * gs <= ATT_MAX_QH)
  const float scale = f32(a[A_ATTN_PARTIAL_SCALE]);
  if (R == 2 && D > 64) __trap();   // the packer gives wide passes to head dims <= 64 only (tiling.attn_wide)
  // direct: one split, folded: the chunk is the group's output (packer.py attn_direct)
  bf16* out = a[A_ATTN_PARTIAL_DIRECT] ? ptr<bf16>(a[A_ATTN_PARTIAL_OUT]) : nullptr;
  const int64_t max_pages = c.P[P_MAX_PAGES];
  const int64_t* bt = ptr<const int64_t>(c.P[P_BLOCK_TABLES]) + b * max_pages;
  const int64_t ps = c.P[P_PAGE_SIZE];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t m0 = b;  // decode: T == 1
  MPK_STAMP(0);
  char* sm = reinterpret_cast<char*>(dyn_smem());
  bf16* qs = reinterpret_cast<bf16*>(sm);
  int64_t* pages = reinterpret_cast<int64_t*>(sm + ATT_OFF_PAGES);
  const int KST = D + 8, CPR = D >> 3;   // bf16 per K / V row in shared memory (padded: fewer bank conflicts)
  bf16* ks = reinterpret_cast<bf16*>(sm + ATT_OFF_K);
  bf16* vs = ks + ATT_NST * KP * KST;
  // q of the task's groups (contiguous heads), the page table and the position in flight together
  const bf16* qg = q + (m0 * nq + (int64_t)g * gs) * D;
#if MPK_ATT_QKNORM
  // Tiling.attn_qk_norm: q is qk_raw (rows of the rank's q heads, then its k heads); the task's q heads are normed
  // and rotated into qs below (qk_norm.cuh), and the last chunk's k heads into the cache
  const bf16* qnw = ptr<const bf16>(a[A_ATTN_PARTIAL_Q_NORM]);
  const bf16* rawr = q + m0 * (int64_t)(nq + n_kv) * D;
  const float qk_eps = f32(a[A_ATTN_PARTIAL_EPS]);
  const float* inv_freq = ptr<const float>(c.P[P_INV_FREQ]);
  if (qnw == nullptr)
#endif
  for (int i = tid; i < ng * gs * CPR; i += THREADS) cp_async16(qs + i * 8, qg + i * 8, true);
  const bool full = max_pages <= ATT_MAX_PAGES;
  if (full)
    for (int i = tid; i < max_pages; i += THREADS) cp_async8_ca(pages + i, bt + i);
  cp_async_commit();
  const int64_t pos = seq_pos(c, b);
  const int L = (int)(pos + 1);   // positions and key indices fit in 32 bits: no 64-bit divisions below
  const int lo = L * s / S, hi = L * (s + 1) / S;
  if (pos < 0 || hi <= lo) {  // inactive sequence or empty chunk
    cp_async_wait_all();
    if (out != nullptr) {   // the merge of one empty chunk: zeros (the task's groups: contiguous heads)
#pragma unroll 1
      for (int i = tid; i < ng * gs * D; i += THREADS) out[m0 * (int64_t)nq * D + (int64_t)g * gs * D + i] = __float2bfloat16_rn(0.f);
      return;
    }
#pragma unroll 1
    for (int i = tid; i < gs * D; i += THREADS)
      part[((m0 * nq + g * gs + i / D) * S + s) * D + i % D] = 0.f;
    for (int i = tid; i < gs; i += THREADS) lse[(m0 * nq + g * gs + i) * S + s] = -INFINITY;
    return;
  }
#if MPK_ATT_QKNORM
  if (qnw != nullptr) qk_norm_rope_heads(rawr + (int64_t)g * gs * D, qnw, qk_eps, D, pos, inv_freq, ng * gs, qs);
#endif
  cp_async_wait_all();
  __syncthreads();
#if MPK_ATT_QKNORM
  if (qnw != nullptr && s == S - 1) {   // the last chunk holds pos (T == 1): its groups' k rows into the cache
    const int pg = (int)(pos / ps);
    const int64_t page = full ? pages[pg] : ld_const_s64(bt + pg);
    qk_norm_rope_heads(rawr + (int64_t)(nq + g) * D, ptr<const bf16>(a[A_ATTN_PARTIAL_K_NORM]), qk_eps, D, pos,
                       inv_freq, ng, const_cast<bf16*>(kc) + kv_row(page, pos - (int64_t)pg * ps, g, n_kv, ps, D));
    __syncthreads();   // the rows are in the cache before any warp copies them
  }
#endif
  if (a[A_ATTN_PARTIAL_KV_NEW] != 0 && s == S - 1) {   // deferred append: the last chunk holds pos (T == 1)
    const int pg = (int)(pos / ps);
    attn_append_new_row(ptr<const bf16>(a[A_ATTN_PARTIAL_KV_NEW]), a[A_ATTN_PARTIAL_LDKV], const_cast<bf16*>(kc),
                        const_cast<bf16*>(vc), m0, full ? pages[pg] : ld_const_s64(bt + pg), pos - (int64_t)pg * ps,
                        g, ng, n_kv, ps, D);
    __syncthreads();   // the rows are in the cache before any warp copies them
  }
  MPK_STAMP(1);
  // virtual pass vp = pass vp % passes of group g + vp / passes: its K and V rows (keys j0 .. j0 + n - 1) into
  // buffer vp % ATT_NST
  // gwm (above): warp w runs `passes` passes of group gw = w / wpg, its KW-key blocks gsub, gsub + wpg, ...
  const bool gwm = MPK_ATT_WARP_PIPE && ng > 1 && (THREADS / 32) % ng == 0;
  const int wpg = gwm ? (THREADS / 32) / ng : THREADS / 32, gw = gwm ? (tid >> 5) / wpg : 0, gsub = (tid >> 5) % wpg;
  const int passes = gwm ? (hi - lo + KW * wpg - 1) / (KW * wpg) : (hi - lo + KP - 1) / KP;
  const int total = gwm ? passes : ng * passes;
  if (gwm && out == nullptr) __trap();   // ng > 1 is one split, written directly (packer.py attn_direct)
  const int psi = (int)ps;
  const bool cpow = (CPR & (CPR - 1)) == 0, ppow = (psi & (psi - 1)) == 0;   // shifts instead of divisions
  const int cs = __ffs(CPR) - 1, pss = __ffs(psi) - 1;
#if MPK_ATT_WARP_PIPE
  // warp-private pipelines: warp w copies only its own rows [KW w, KW w + KW) of a pass (the only rows it reads),
  // so a pass needs no CTA barrier: the warp waits on its own copies (cp.async groups are per thread) and
  // __syncwarp orders its lanes' copies and reads.
  const int wrow0 = KW * (tid >> 5), wlane = tid & 31;
  // The lean issue loop (session 22; power-of-two head dim and page size): lane l copies the same 16-byte piece
  // e = l % CPR of rows l / CPR, + 32 / CPR, ..., so a row's source is byte page * pstride + slot * rstride + hoff
  // (one 32 x 32 -> 64-bit multiply-add) and its shared-memory targets advance by a constant: ~25 instructions per
  // two 16-byte copies. ncu (session 22, llama B=128 ctx 4096) found the general loop below at ~85 dependent
  // instructions per two copies (64-bit index math, a predicated global page-table path) and 42% of the kernel's
  // samples (stall_wait 41%); the lean loop took that step from 7.59 to 6.35 ms (bench/results/s22/run8_lean).
  const bool lean = cpow && ppow && CPR <= 32;
  const uint32_t rstride = (uint32_t)(n_kv * D) * 2, pstride = (uint32_t)psi * rstride;   // bytes: < 2^32
  const int rs = lean ? 32 >> cs : 0, le = wlane & (CPR - 1), lu = lean ? wlane >> cs : 0, pmask = psi - 1;
  const char* kc8 = reinterpret_cast<const char*>(kc);
  const char* vc8 = reinterpret_cast<const char*>(vc);
  // rows [j, jend) step rs of this lane into kd / vd; page(pg) reads the page table (shared memory or, past
  // ATT_MAX_PAGES entries, global): one loop per table location, so neither path is predicated inside the other
  auto lean_rows = [&](int j, int jend, uint32_t kd, uint32_t vd, uint32_t hoff, uint32_t bstep, auto page) {
#pragma unroll 1
    for (; j < jend; j += rs, kd += bstep, vd += bstep) {
      const uint64_t off = (uint64_t)page(MPK_ATT_DIAG_L2 ? 0 : j >> pss) * pstride +
                           ((uint32_t)(j & pmask) * rstride + hoff);
      cp_async16_s(kd, kc8 + off);
      cp_async16_s(vd, vc8 + off);
    }
  };
  auto issue = [&](int vp, bf16* kb, bf16* vb) {   // (vp >= total: an empty group, so every call commits one)
    // gwm: the warp's block jw .. of its own group (j0 + wrow0 = jw, so the row arithmetic below is shared)
    const int gv = gwm ? gw : vp / passes, jw = gwm ? lo + (vp * wpg + gsub) * KW : 0;
    const int j0 = gwm ? jw - wrow0 : lo + (vp - gv * passes) * KP, gi = g + gv;
    const int n = vp < total ? (gwm ? min(KW, hi - jw) : min(KW, min(KP, hi - j0) - wrow0)) : 0;
    if (lean) {
      const uint32_t hoff = (uint32_t)(gi * D + le * 8) * 2;
      const int r0 = wrow0 + lu, jend = j0 + wrow0 + n;
      const uint32_t boff = (uint32_t)(r0 * KST + le * 8) * 2, bstep = (uint32_t)(rs * KST) * 2;
      const uint32_t kd = static_cast<uint32_t>(__cvta_generic_to_shared(kb)) + boff;
      const uint32_t vd = static_cast<uint32_t>(__cvta_generic_to_shared(vb)) + boff;
      if (full)
        lean_rows(j0 + r0, jend, kd, vd, hoff, bstep, [&](int pg) { return (uint32_t)pages[pg]; });
      else
        lean_rows(j0 + r0, jend, kd, vd, hoff, bstep, [&](int pg) { return (uint32_t)ld_const_s64(bt + pg); });
      cp_async_commit();
      return;
    }
#pragma unroll 1
    for (int i = wlane; i < n * CPR; i += 32) {
      const int u = wrow0 + (cpow ? i >> cs : i / CPR), e = i - (u - wrow0) * CPR;
#else
  auto issue = [&](int vp, bf16* kb, bf16* vb) {   // consecutive threads take consecutive 16-byte pieces of the rows
    const int gv = vp / passes, j0 = lo + (vp - gv * passes) * KP, gi = g + gv;
    const int n = min(KP, hi - j0);
#pragma unroll 1
    for (int i = tid; i < n * CPR; i += THREADS) {
      const int u = cpow ? i >> cs : i / CPR, e = i - u * CPR;
#endif
      const int j = j0 + u, pg = ppow ? j >> pss : j / psi;
#if MPK_ATT_DIAG_L2   // diagnostic (wrong results): every key from the sequence's first page, so the rows hit L2
      const int64_t page = full ? pages[0] : ld_const_s64(bt);
#else
      const int64_t page = full ? pages[pg] : ld_const_s64(bt + pg);
#endif
      const int64_t src = kv_row(page, j - pg * psi, gi, n_kv, ps, D) + e * 8;
      cp_async16(kb + u * KST + e * 8, kc + src, true);
      cp_async16(vb + u * KST + e * 8, vc + src, true);
    }
    cp_async_commit();
  };
#if MPK_ATT_WARP_PIPE
  for (int v = 0; v < ATT_NST - 1; ++v) issue(v, ks + v * KP * KST, vs + v * KP * KST);   // the first N - 1 passes
#else
  issue(0, ks, vs);
  if (total > 1) issue(1, ks + KP * KST, vs + KP * KST);
#endif
  // Tensor Core pass (see the file comment). Thread (g8, t4) = (lane / 4, lane % 4) of warp w.
  const int g8 = lane >> 2, t4 = lane & 3, kw = KW * warp;
  // 32-wide d rounds of scores, 16-wide d tiles of o (wide passes: head dim <= 64, packer.py; fewer live registers)
  constexpr int DM = R == 1 ? MAX_HEAD_DIM : 64, MT = DM / 16;
  constexpr int QR = DM / 32;
  constexpr int NW = THREADS / 32;
  float o[MT][4];   // O^T: d = 16 mt + g8 (+ 8), heads 2 t4, 2 t4 + 1; unnormalised, relative to the head's m_run
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
  float m_run = -INFINITY, l_run = 0.f;   // this warp's running max / sum of head g8 (same in the 4 lanes of g8)
  // this warp's running max, sum and unnormalised outputs into `so` (outputs NW x MAX_GS x D, then maxima and
  // sums), then a CTA barrier: every warp's state is readable
  auto stash = [&](float* so, float* sm_m, float* sm_l) {
    if (t4 == 0 && g8 < gs) { sm_m[warp * MAX_GS + g8] = m_run; sm_l[warp * MAX_GS + g8] = l_run; }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int d = 16 * mt + g8, h0 = 2 * t4;
      float* w0 = so + (warp * MAX_GS + h0) * D;
      if (h0 < gs && d < D) w0[d] = o[mt][0];
      if (h0 < gs && d + 8 < D) w0[d + 8] = o[mt][2];
      if (h0 + 1 < gs && d < D) w0[D + d] = o[mt][1];
      if (h0 + 1 < gs && d + 8 < D) w0[D + d + 8] = o[mt][3];
    }
    __syncthreads();
  };
  // merge the warps of group gv: out = sum_w o_w exp(m_w - M) / sum_w l_w exp(m_w - M) (warps that saw no key:
  // m_w = -inf, weight 0), through `so` (the K buffers after the last pass; a region of its own while another
  // group's rows are in flight)
  auto finish = [&](int gv, float* so) {
    float* sm_m = so + NW * MAX_GS * D;
    float* sm_l = sm_m + NW * MAX_GS;
    stash(so, sm_m, sm_l);
#pragma unroll 1
    for (int i = tid; i < gs * D; i += THREADS) {
      const int h = i / D, d = i - h * D;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w * MAX_GS + h]);
      float l = 0.f, acc = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float wt = expf(sm_m[w * MAX_GS + h] - M);
        l += sm_l[w * MAX_GS + h] * wt;
        acc += so[(w * MAX_GS + h) * D + d] * wt;
      }
      const int64_t hq = m0 * nq + (g + gv) * gs + h;
      const float pv = acc / fmaxf(l, 1e-30f);
      if (out != nullptr) {   // attn_merge_group of this one chunk: weight expf(0) = 1, sum 1, o / 1 = pv
        out[hq * D + d] = __float2bfloat16_rn(pv);
        continue;
      }
      part[(hq * S + s) * D + d] = pv;
      if (d == 0) lse[hq * S + s] = M + logf(l);
    }
  };
  // gwm: every group at once, each over its wpg warps (warp w's heads are group w / wpg's); outputs written directly
  auto finish_gw = [&](float* so) {
    float* sm_m = so + NW * MAX_GS * D;
    float* sm_l = sm_m + NW * MAX_GS;
    stash(so, sm_m, sm_l);
#pragma unroll 1
    for (int i = tid; i < ng * gs * D; i += THREADS) {
      const int gr = i / (gs * D), r = i - gr * gs * D, h = r / D, d = r - h * D, w0 = gr * wpg;
      float M = -INFINITY;
#pragma unroll 1
      for (int w = w0; w < w0 + wpg; ++w) M = fmaxf(M, sm_m[w * MAX_GS + h]);
      float l = 0.f, acc = 0.f;
#pragma unroll 1
      for (int w = w0; w < w0 + wpg; ++w) {
        const float wt = expf(sm_m[w * MAX_GS + h] - M);
        l += sm_l[w * MAX_GS + h] * wt;
        acc += so[(w * MAX_GS + h) * D + d] * wt;
      }
      out[(m0 * nq + (int64_t)(g + gr) * gs + h) * D + d] = __float2bfloat16_rn(acc / fmaxf(l, 1e-30f));
    }
  };
  int p = 0, gv = 0;   // vp's pass and group
#pragma unroll 1
  for (int vp = 0; vp < total; ++vp) {
    // gwm: n counts from the warp's first row kw (its block's key i sits in row kw + i), so the masks below hold
    const int n = gwm ? kw + min(KW, hi - (lo + (vp * wpg + gsub) * KW)) : min(KP, hi - (lo + p * KP));
    const int bi = vp % ATT_NST;   // this pass's buffer
    const bf16* kb = ks + bi * KP * KST;
    const bf16* vb = vs + bi * KP * KST;
    const bf16* qh = qs + (gwm ? gw : gv) * gs * D;   // this group's q heads
#if MPK_ATT_WARP_PIPE
    // pass vp + N - 1 into the buffer pass vp - 1 left (its reads ended at the last __syncwarp); one group per
    // iteration, so N - 1 pending groups at most means pass vp's copies are done
    const int bn = (bi + ATT_NST - 1) % ATT_NST;
    issue(vp + ATT_NST - 1, ks + bn * KP * KST, vs + bn * KP * KST);
    cp_async_wait_group<ATT_NST - 1>();
    __syncwarp();   // the warp's rows of this pass have landed (each lane waited on its own copies)
#else
    if (vp + 1 < total) cp_async_wait_group<1>(); else cp_async_wait_group<0>();
    __syncthreads();
#endif
    if (vp == 0) MPK_STAMP(2);
    if (vp == 1) MPK_STAMP(5);   // (diagnostic stamps 5, 7-9: pass 1, the steady state)
    if (kw < n) {   // warp-uniform: key kw is in the pass, so every head's max below is finite
      // tile u, n-tile nt: sc[u][nt][0 / 1] = S[head g8][key kw + 16 u + 8 nt + 2 t4 + 0 / 1] (sc[u][nt][2, 3]:
      // padding rows); the R tiles' chains are independent (interleaved by the unrolled loops)
      float sc[R][2][4];
#pragma unroll
      for (int u = 0; u < R; ++u)
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) sc[u][nt][0] = sc[u][nt][1] = sc[u][nt][2] = sc[u][nt][3] = 0.f;
      const bf16* kr = kb + (kw + g8) * KST;   // rows past n hold stale data: their scores are masked
#pragma unroll
      for (int u = 0; u < R; ++u)
#pragma unroll
        for (int r = 0; r < QR; ++r) {
          const int d = 32 * r + 8 * t4;
          if (32 * r < D) {   // q head g8, d .. d + 7 (zero past the group's heads and past D), from shared memory
            const bool in = d < D;
            const uint4 qv = in && g8 < gs ? *reinterpret_cast<const uint4*>(qh + g8 * D + d) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              const uint4 kv = in ? *reinterpret_cast<const uint4*>(kr + (16 * u + 8 * nt) * KST + d) : make_uint4(0u, 0u, 0u, 0u);
              mma_bf16_16816(sc[u][nt], qv.x, 0u, qv.y, 0u, kv.x, kv.y);
              mma_bf16_16816(sc[u][nt], qv.z, 0u, qv.w, 0u, kv.z, kv.w);
            }
          }
        }
      float v[R][4], mx = -INFINITY;
#pragma unroll
      for (int u = 0; u < R; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = kw + 16 * u + 8 * (e >> 1) + 2 * t4 + (e & 1);
          v[u][e] = key < n ? sc[u][e >> 1][e & 1] * scale : -INFINITY;
          mx = fmaxf(mx, v[u][e]);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float mn = fmaxf(m_run, mx), corr = expf(m_run - mn);   // corr 0 on the warp's first keys
      float sum = 0.f;
#pragma unroll
      for (int u = 0; u < R; ++u)
#pragma unroll
        for (int e = 0; e < 4; ++e) { v[u][e] = expf(v[u][e] - mn); sum += v[u][e]; }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      l_run = l_run * corr + sum;
      m_run = mn;
      const float ca = __shfl_sync(0xffffffffu, corr, 8 * t4), cb = __shfl_sync(0xffffffffu, corr, 8 * t4 + 4);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) { o[mt][0] *= ca; o[mt][1] *= cb; o[mt][2] *= ca; o[mt][3] *= cb; }
      if (vp == 1) MPK_STAMP(7);   // scores, softmax and rescale
#pragma unroll
      for (int u = 0; u < R; ++u) {   // P.V by m16n8k16 bf16, k = tile u's 16 keys in order, P^T as B (b0b1: keys
          // 2t4, 2t4 + 1 = v[u][0], v[u][1]; b2b3: keys 8 + 2t4, + 1 = v[u][2], v[u][3]), each probability split into
          // bf16 hi + lo (residual ~2^-18); V^T fragments by ldmatrix.x4.trans (lane l addresses key kw + 16 u +
          // 8 (l >> 4) + (l & 7), d + 8 ((l >> 3) & 1)); keys past n zeroed after the load (stale rows: 0 * NaN
          // would poison o)
        const int ku = kw + 16 * u;
        __nv_bfloat162 h01 = __floats2bfloat162_rn(v[u][0], v[u][1]), h23 = __floats2bfloat162_rn(v[u][2], v[u][3]);
        const uint32_t bh0 = *reinterpret_cast<uint32_t*>(&h01), bh1 = *reinterpret_cast<uint32_t*>(&h23);
#if MPK_ATT_PV_SPLIT
        __nv_bfloat162 r01 = __floats2bfloat162_rn(v[u][0] - __low2float(h01), v[u][1] - __high2float(h01));
        __nv_bfloat162 r23 = __floats2bfloat162_rn(v[u][2] - __low2float(h23), v[u][3] - __high2float(h23));
        const uint32_t bl0 = *reinterpret_cast<uint32_t*>(&r01), bl1 = *reinterpret_cast<uint32_t*>(&r23);
#endif
        const uint32_t vrow = smem_addr(vb + (ku + ((lane >> 4) & 1) * 8 + (lane & 7)) * KST + ((lane >> 3) & 1) * 8);
        const int k0 = ku + 2 * t4;
        const uint32_t mA = (k0 < n ? 0xffffu : 0u) | (k0 + 1 < n ? 0xffff0000u : 0u);
        const uint32_t mB = (k0 + 8 < n ? 0xffffu : 0u) | (k0 + 9 < n ? 0xffff0000u : 0u);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          if (16 * mt < D) {
            uint32_t a0, a1, a2, a3;
            ldsm_x4_trans(vrow + 32 * mt, a0, a1, a2, a3);
            a0 &= mA; a1 &= mA; a2 &= mB; a3 &= mB;
#if MPK_ATT_PV_SPLIT
            mma_bf16_16816(o[mt], a0, a1, a2, a3, bl0, bl1);
#endif
            mma_bf16_16816(o[mt], a0, a1, a2, a3, bh0, bh1);
          }
        }
      }
    }
    if (vp == 1) MPK_STAMP(8);   // thread 0's P.V
#if MPK_ATT_WARP_PIPE
    __syncwarp();   // the warp's rows of this buffer are free again (refilled at the next iteration's top)
#else
    __syncthreads();   // buffer vp & 1 is free again
    if (vp + 2 < total) issue(vp + 2, ks + (vp & 1) * KP * KST, vs + (vp & 1) * KP * KST);
#endif
    if (vp == 1) MPK_STAMP(9);
    if (!gwm && ++p == passes) {   // group gv's last pass (gwm: no group switch)
      if (gv + 1 < ng) {   // another group follows (its rows in flight): merge this one in its own region, and
        // a barrier after it (its reads done before the next group's writes, however far a warp runs ahead)
        finish(gv, reinterpret_cast<float*>(vs + ATT_NST * KP * KST));
        __syncthreads();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) o[mt][0] = o[mt][1] = o[mt][2] = o[mt][3] = 0.f;
        m_run = -INFINITY;
        l_run = 0.f;
      }
      p = 0;
      ++gv;
    }
  }
#if MPK_ATT_WARP_PIPE
  __syncthreads();   // every warp is done with the K buffers the merge below reuses
#endif
  MPK_STAMP(3);
  if (gwm) finish_gw(reinterpret_cast<float*>(ks)); else
  finish(ng - 1, reinterpret_cast<float*>(ks));   // through the K buffers, free after the last pass's barrier
  MPK_STAMP(4);
}

// attn_partial: the chunk; folded (ticket != 0), then the group's ticket, and the partial that takes the group's
// last ticket of this step (tickets never reset: step k's chunks take k S .. k S + S - 1) merges the group. The
// acq_rel add releases this CTA's part / lse stores (ordered before thread 0 by the barrier) and acquires the other
// chunks' (their adds released them), as a signal / wait pair would; the merge then reads them through L2.
// Each width a call of its own: both inlined into op_small, the wide one's registers made the kernel spill around
// op_small's call. The CTA-barrier schedule (MPK_ATT_WARP_PIPE=0, an A/B build) has narrow passes only (tiling.py).
__device__ __noinline__ void attn_partial_narrow(const Ctx& c) { attn_partial_chunk<1>(c); }
#if MPK_ATT_WARP_PIPE
__device__ __noinline__ void attn_partial_wide(const Ctx& c) { attn_partial_chunk<2>(c); }
#endif

__device__ inline void op_attn_partial(const Ctx& c) {
  const int64_t* a = c.rec;
  const int64_t wide = a[A_ATTN_PARTIAL_WIDE];   // 1 or 2 (tasks/tiling.py attn_wide: 1 in the CTA-barrier build)
#if MPK_ATT_WARP_PIPE
  if (wide == 2) attn_partial_wide(c);
  else
#endif
  if (wide == 1) attn_partial_narrow(c);
  else __trap();   // a width this build has no passes for
  if (a[A_ATTN_PARTIAL_TICKET] == 0 || a[A_ATTN_PARTIAL_DIRECT]) return;   // not folded, or written directly
  __shared__ int s_last;
  __syncthreads();
  if (threadIdx.x == 0) {
    const int64_t S = a[A_ATTN_PARTIAL_SPLITS];
    uint64_t old;
    asm volatile("atom.acq_rel.gpu.global.add.u64 %0, [%1], 1;"
                 : "=l"(old) : "l"(ptr<uint64_t>(a[A_ATTN_PARTIAL_TICKET])) : "memory");
    s_last = (int64_t)((old + 1) % (uint64_t)S) == 0;
  }
  __syncthreads();
  MPK_STAMP(6);   // (stage-stamp builds) the ticket taken; 3-4: the chunk's own rows written, MPK_STAGE_WORDS - 2: merged
  if (s_last)
    attn_merge_group(ptr<const float>(a[A_ATTN_PARTIAL_PART]), ptr<const float>(a[A_ATTN_PARTIAL_LSE]),
                     ptr<bf16>(a[A_ATTN_PARTIAL_OUT]), (int)a[A_ATTN_PARTIAL_B], (int)a[A_ATTN_PARTIAL_G],
                     (int)a[A_ATTN_PARTIAL_GS], (int)a[A_ATTN_PARTIAL_D], (int)a[A_ATTN_PARTIAL_NQ],
                     (int)a[A_ATTN_PARTIAL_SPLITS]);
}

}  // namespace mpk
