// The persistent decode megakernel: one CTA per SM walks its static task list for steps
// [first_step, first_step + nsteps). Protocol (mpk_runtime/tasks/graph.py): before a task of step s,
// counter[e] >= triggers * (s - lag) for each wait (ld.acquire.gpu, bounded spin on %globaltimer; on timeout
// the first SM records {sm, task, event, counter, needed} in the status block and every SM exits); after it,
// __syncthreads + red.release.gpu.add (.sys for a peer's) on every signalled counter.
// Per task, only the counter polls and the release adds are global round trips: the record (with its first waits
// and signal words inlined, codegen/layout.py) of the SM's next task is copied into the other of two shared
// buffers (cp.async) while the current op runs, and thread 32 issues a finished task's signals while thread 0
// already polls the next task's counters.
#include "common.cuh"
#include "ops/embed.cuh"
#include "ops/linear.cuh"
#include "ops/qkv_rope.cuh"
#include "ops/attention.cuh"
#include "ops/allreduce.cuh"
#include "ops/argmax.cuh"
#include "ops/prefetch.cuh"

namespace mpk {
// The small, once-per-step or per-group ops, and attention (79 registers alone; inlined into the kernel it made the
// kernel spill), behind one call site: each call site of a not-inlined op costs the kernel's switch registers
// around the call (a third call site made it spill).
__device__ __noinline__ void op_small(const Ctx& c) {
  switch ((int)c.rec[T_OPCODE]) {
    case OP_ARGMAX_PARTIAL: op_argmax_partial(c); break;
    case OP_ARGMAX_REDUCE: op_argmax_reduce(c); break;
    case OP_QK_NORM_ROPE: op_qk_norm_rope(c); break;
    case OP_ATTN_PARTIAL: op_attn_partial(c); break;
    case OP_ATTN_MERGE: op_attn_merge(c); break;
    default: break;
  }
}
}  // namespace mpk

using namespace mpk;

// Thread 64, while thread 0 polls the task's waits: TMA bulk copies of the first `rows` weight rows of each of the task's weight
// ranges (stage word: codegen/layout.py pack_stage; the ranges as TaskPacker._weight_ranges) into the dynamic shared
// memory above the op's own layout, completing on the CTA's stage mbarrier. Weights never depend on events, so the
// copy overlaps the wait; the op reads those rows from shared memory (linear.cuh linear_core).
__device__ __noinline__ void stage_task_weights(const int64_t* rec, int64_t sw, uint32_t bar) {
  const uint32_t rows = (uint32_t)stage_rows(sw), off = (uint32_t)stage_off(sw);
  const bf16* w[2];
  int64_t K;
  if ((int)rec[T_OPCODE] == OP_LINEAR) {
    K = rec[A_LINEAR_K];
    w[0] = ptr<const bf16>(rec[A_LINEAR_W0]) + rec[A_LINEAR_N0] * K;
    w[1] = rec[A_LINEAR_W1] != 0 ? ptr<const bf16>(rec[A_LINEAR_W1]) + rec[A_LINEAR_N0] * K : nullptr;
  } else {  // OP_QKV_ROPE: the part's rows r0.. and D/2 + r0.. of the head
    K = rec[A_QKV_ROPE_K];
    const bf16* hw = ptr<const bf16>(rec[A_QKV_ROPE_W]);
    w[0] = hw + rec[A_QKV_ROPE_R0] * K;
    w[1] = hw + (rec[A_QKV_ROPE_D] / 2 + rec[A_QKV_ROPE_R0]) * K;
  }
  const uint32_t per = rows * (uint32_t)K * 2u;
  // the previous tasks' shared-memory accesses (ordered before this thread by the barrier that ended them) come
  // before the async proxy's writes
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  mbar_expect_tx(bar, w[1] != nullptr ? 2u * per : per);
  const uint32_t dst = smem_addr(dyn_smem()) + off;
  for (int r = 0; r < 2; ++r) {
    if (w[r] == nullptr) continue;
    for (uint32_t o = 0; o < per; o += 32768u)
      bulk_g2s(dst + r * per + o, reinterpret_cast<const unsigned char*>(w[r]) + o, min(32768u, per - o), bar);
  }
}

// Thread 0: spin until *ctr >= need (acquire; system scope for a counter a peer rank signals). On timeout the first
// SM to notice records the wait in the status block; returns 1 when this SM must exit (timeout here or elsewhere).
__device__ __forceinline__ int wait_counter(const uint64_t* ctr, int64_t need, bool sys, int64_t* status,
                                            uint64_t timeout_ns, int sm, int tid, int64_t event, int64_t step) {
  uint64_t v = ld_acquire_scoped_u64(ctr, sys);
  if ((int64_t)v >= need) return 0;
  const uint64_t t0 = globaltimer();
  for (uint32_t it = 1;; ++it) {
    v = ld_acquire_scoped_u64(ctr, sys);
    if ((int64_t)v >= need) return 0;
    if ((it & 255) == 0) {
      if (ld_volatile_s64(status + S_FLAG) != STATUS_OK) return 1;
      const uint64_t el = globaltimer() - t0;
      if (el > timeout_ns) {
        if (atomicCAS(reinterpret_cast<unsigned long long*>(status + S_FLAG), 0ull,
                      (unsigned long long)STATUS_TIMEOUT) == 0ull) {
          status[S_SM] = sm; status[S_TASK] = tid; status[S_EVENT] = event;
          status[S_COUNTER] = (int64_t)v; status[S_NEEDED] = need; status[S_STEP] = step;
          status[S_ELAPSED_NS] = (int64_t)el;
          __threadfence();
        }
        return 1;
      }
    }
  }
}

#ifndef MPK_PDL
#define MPK_PDL 0
#endif

// A task with staged weight rows (stage_task_weights)
#define MPK_STAGED(sw) ((sw) != 0)

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    MPK_KERNEL_NAME(const int64_t* __restrict__ P, int64_t first_step, int nsteps) {
  __shared__ int s_abort;
  // The parameter block and the records live in shared memory: every wait's ld.acquire compiles to a load +
  // CCTL.IVALL (all of L1 invalidated), so global copies of them would be an L2 round trip again in every task.
  // Ops see them through Ctx.P / Ctx.rec (generic pointers into shared memory). s_rec[b]: the running task's record
  // and the next one's (double-buffered; the next is copied in while the op runs).
  __shared__ int64_t s_par[NUM_PARAMS];
  __shared__ __align__(16) int64_t s_rec[2][TASK_WORDS];
  __shared__ __align__(8) uint64_t s_stage_bar;   // weight staging (stage_task_weights): one phase per staged task
  const uint32_t stage_bar = smem_addr(&s_stage_bar);
  uint32_t stage_par = 0;
  if (threadIdx.x == 0) mbar_init(stage_bar);
  static_assert(TASK_WORDS % 2 == 0 && TASK_WORDS / 2 <= 32, "warp 0 copies a record, 16 bytes per lane");
  if (threadIdx.x < NUM_PARAMS) s_par[threadIdx.x] = P[threadIdx.x];
  const int sm = blockIdx.x;
  const int32_t* offs = ptr<const int32_t>(P[P_SM_OFFSETS]);
  const int beg = offs[sm], end = offs[sm + 1];
  if (beg == end) return;
  const int64_t* tasks = ptr<const int64_t>(P[P_TASKS]);
  if (threadIdx.x < TASK_WORDS)   // the first task's record
    s_rec[0][threadIdx.x] = tasks[(int64_t)ptr<const int32_t>(P[P_SM_TASKS])[beg] * TASK_WORDS + threadIdx.x];
  __syncthreads();
#if MPK_PDL
  // Programmatic Dependent Launch (MPK_MK_PDL=1: launched with programmatic stream serialization, so this grid may
  // start while the previous kernel drains): everything above read only this launch's own static data (parameters,
  // task lists, the first record); wait here for the previous kernel's writes before any task reads activations.
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
  int buf = 0;
  int64_t la_done = 0;  // thread 0: bytes per weight range of this task already prefetched as the lookahead
  for (int ls = 0; ls < nsteps; ++ls) {
    const int64_t step = first_step + ls;
    for (int i = beg; i < end; ++i, buf ^= 1) {
      const int64_t* rec = s_rec[buf];
      // the SM's next task (the list wraps to the next step's first): its record into the other buffer, which
      // nobody reads any more (thread 32 took the previous task's signal words before the barrier that ended it)
      if (threadIdx.x < TASK_WORDS / 2)
        cp_async16(&s_rec[buf ^ 1][threadIdx.x * 2], tasks + rec[T_NEXT_TASK] * TASK_WORDS + threadIdx.x * 2, true);
      // thread 64 (not the poller: issuing the bulk copies can stall the issuing thread) stages the weights
      // (issuing them after the waits instead measured 5-8% slower at batch 1: docs/perf-notes.md, session 12)
      if (threadIdx.x == 64 && MPK_STAGED(rec[T_STAGE]))
        stage_task_weights(rec, rec[T_STAGE], stage_bar);
      if (threadIdx.x == 0) {
        cp_async_commit();
        const int tid = (int)rec[T_TASK_ID];
        const uint64_t* counters = ptr<const uint64_t>(param(s_par, P_COUNTERS));
        int64_t* status = ptr<int64_t>(param(s_par, P_STATUS));
        uint64_t* trace = ptr<uint64_t>(param(s_par, P_TRACE));
        const uint64_t timeout_ns = (uint64_t)param(s_par, P_TIMEOUT_NS);
        const int64_t* pft = ptr<const int64_t>(param(s_par, P_PREFETCH));
        if (PF_CUR > 0 && pft != nullptr) {  // weights never wait on events: start streaming them now
          const int64_t* pf = pft + (int64_t)tid * PF_WORDS;
          const int nr = (pf[0] != 0) + (pf[2] != 0);
          if (nr > 0) prefetch_task_weights(pf, la_done, PF_CUR / nr);
          la_done = 0;
          if (PF_NEXT > 0 && (i + 1 < end || ls + 1 < nsteps)) {
            const int64_t* pn = pft + rec[T_NEXT_TASK] * PF_WORDS;
            const int nrn = (pn[0] != 0) + (pn[2] != 0);
            if (nrn > 0) {
              la_done = PF_NEXT / nrn;
              prefetch_task_weights(pn, 0, la_done);
            }
          }
        }
        int abort = 0, ninl = 0;
#pragma unroll
        for (int j = 0; j < INLINE_WAITS; ++j) {
          const int64_t pw = rec[T_INLINE_WAIT + j];
          if (pw == 0 || abort) break;
          ++ninl;
          const int64_t ev = pw & 0xffffffffLL;
          const int64_t need = ((pw >> PW_TRIGGERS_SHIFT) & 0xffffff) * (step - ((pw >> PW_LAG_SHIFT) & 63));
          abort = wait_counter(counters + ev, need, ((pw >> PW_SCOPE_SHIFT) & 1) != 0, status, timeout_ns, sm, tid,
                               ev, step);
        }
        if (!abort && rec[T_WAIT_BEGIN] + ninl < rec[T_WAIT_END]) {
          const int64_t* waits = ptr<const int64_t>(param(s_par, P_WAITS));
          for (int64_t w = rec[T_WAIT_BEGIN] + ninl; w < rec[T_WAIT_END] && !abort; ++w) {
            const int64_t* wr = waits + w * WAIT_WORDS;
            abort = wait_counter(counters + wr[W_EVENT], wr[W_TRIGGERS] * (step - wr[W_LAG]), wr[W_SCOPE] != 0,
                                 status, timeout_ns, sm, tid, wr[W_EVENT], step);
          }
        }
        s_abort = abort;
        if (trace != nullptr && ls < param(s_par, P_TRACE_STEPS))
          trace[((int64_t)ls * param(s_par, P_NUM_TASKS) + tid) * 2] = globaltimer();
#if MPK_STAGE_WORDS > 0
        // stamp rows follow the start/end words of all traced steps
        mpk_stage_row = (trace != nullptr && ls < param(s_par, P_TRACE_STEPS))
                            ? trace + param(s_par, P_TRACE_STEPS) * param(s_par, P_NUM_TASKS) * 2 +
                                  ((int64_t)ls * param(s_par, P_NUM_TASKS) + tid) * MPK_STAGE_WORDS
                            : nullptr;
#endif
      } else if (threadIdx.x < TASK_WORDS / 2) {
        cp_async_commit();
      }
      __syncthreads();
      if (s_abort) {
        if (threadIdx.x < TASK_WORDS / 2) cp_async_wait_all();
        if (threadIdx.x == 64 && MPK_STAGED(rec[T_STAGE]))
          mbar_wait(stage_bar, stage_par);   // no copy into an exited CTA
        return;
      }
      const Ctx c{s_par, rec, step, ls, (int)(step & 1), stage_bar, stage_par};
      switch ((int)c.rec[T_OPCODE]) {
        case OP_EMBED: op_embed(c); break;
        case OP_QKV_ROPE: op_qkv_rope(c); break;
        case OP_LINEAR:
          if (c.rec[A_LINEAR_TC_ROWS] > 0) op_linear_tc(c); else op_linear(c);
          break;
        case OP_ALLREDUCE: op_allreduce(c); break;
        case OP_WEIGHT_PREFETCH: op_weight_prefetch(c); break;
        case OP_ATTN_PARTIAL:
        case OP_ATTN_MERGE:
        case OP_ARGMAX_PARTIAL:
        case OP_ARGMAX_REDUCE:
        case OP_QK_NORM_ROPE: op_small(c); break;
        default: break;
      }
      if (threadIdx.x < TASK_WORDS / 2) cp_async_wait_all();   // the next record has landed
      // the staged copy is complete before the barrier that frees the shared memory (the op's warps wait on it only
      // where they read staged rows), and the next staged task is the next phase
      if (MPK_STAGED(rec[T_STAGE])) {   // (re-read from the record: no register held across the op)
        if (threadIdx.x == 0) mbar_wait(stage_bar, stage_par);
        stage_par ^= 1u;
      }
      // Thread 32 signals this task's counters after the barrier, while thread 0 goes on to the next task's waits:
      // it takes the signal words (and the trace coordinates) now, before the barrier frees this buffer.
      int64_t sg[INLINE_SIGNALS], sb = 0, se = 0;
      int tid = 0;
#if MPK_STAGE_WORDS > 0
      uint64_t* stage_row = nullptr;
#endif
      if (threadIdx.x == 32) {
        sb = rec[T_SIG_BEGIN];
#pragma unroll
        for (int j = 0; j < INLINE_SIGNALS; ++j) {
          sg[j] = rec[T_INLINE_SIG + j];
          sb += sg[j] != 0;
        }
        se = rec[T_SIG_END];
        tid = (int)rec[T_TASK_ID];
#if MPK_STAGE_WORDS > 0
        stage_row = mpk_stage_row;
#endif
      }
      __syncthreads();
      MPK_STAMP(MPK_STAGE_WORDS - 2);   // every thread's op work done (the signals follow)
      if (threadIdx.x == 32) {
        // No __threadfence() first (MEMBAR.SC.GPU + CCTL.IVALL): after the barrier, the release add orders every
        // write of the CTA before it (release is cumulative over what the barrier made visible to this thread; the
        // fence.acq_rel + relaxed-add form CUTLASS's barrier uses).
#pragma unroll
        for (int j = 0; j < INLINE_SIGNALS; ++j)
          if (sg[j] != 0) signal_counter(sg[j]);  // local: red.release.gpu; a peer's (tagged): red.release.sys
        if (sb < se) {
          const int64_t* signals = ptr<const int64_t>(param(s_par, P_SIGNALS));
          for (int64_t s = sb; s < se; ++s) signal_counter(signals[s]);
        }
        uint64_t* trace = ptr<uint64_t>(param(s_par, P_TRACE));
        if (trace != nullptr && ls < param(s_par, P_TRACE_STEPS))
          trace[((int64_t)ls * param(s_par, P_NUM_TASKS) + tid) * 2 + 1] = globaltimer();
#if MPK_STAGE_WORDS > 0
        if (stage_row != nullptr) stage_row[MPK_STAGE_WORDS - 1] = globaltimer();   // signals issued
#endif
      }
    }
  }
}
