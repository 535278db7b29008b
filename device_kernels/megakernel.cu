// The persistent decode megakernel: one CTA per SM walks its static task list for steps
// [first_step, first_step + nsteps). Protocol (mpk_runtime/tasks/graph.py): before a task of step s,
// counter[e] >= triggers * (s - lag) for each wait (ld.acquire.gpu, bounded spin on %globaltimer; on timeout
// the first SM records {sm, task, event, counter, needed} in the status block and every SM exits); after it,
// __syncthreads + red.release.gpu.add (.sys for a peer's) on every signalled counter.
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

extern "C" __global__ void __launch_bounds__(THREADS, 1)
    MPK_KERNEL_NAME(const int64_t* __restrict__ P, int64_t first_step, int nsteps) {
  __shared__ int s_abort;
  // The parameter block and the current task's record live in shared memory: every wait's ld.acquire compiles to
  // a load + CCTL.IVALL (all of L1 invalidated), so global copies of them would be an L2 round trip again in every
  // task. Ops see them through Ctx.P / Ctx.rec (generic pointers into shared memory).
  __shared__ int64_t s_par[NUM_PARAMS];
  __shared__ int64_t s_rec[TASK_WORDS];
  static_assert(TASK_WORDS <= 32, "warp 1 copies a task record, one word per lane");
  if (threadIdx.x < NUM_PARAMS) s_par[threadIdx.x] = P[threadIdx.x];
  __syncthreads();
  const int sm = blockIdx.x;
  // Only the task list stays in registers across the task loop; the tables thread 0 alone uses are re-read from
  // the shared-memory parameter block when needed, so that every op keeps the registers (held across the loop,
  // they made the kernel spill).
  const int32_t* offs = ptr<const int32_t>(P[P_SM_OFFSETS]);
  const int32_t* list = ptr<const int32_t>(P[P_SM_TASKS]);
  const int64_t* tasks = ptr<const int64_t>(P[P_TASKS]);
  const int beg = offs[sm], end = offs[sm + 1];
  int64_t la_done = 0;  // thread 0: bytes per weight range of this task already prefetched as the lookahead
  for (int ls = 0; ls < nsteps; ++ls) {
    const int64_t step = first_step + ls;
    for (int i = beg; i < end; ++i) {
      const int tid = list[i];
      const int64_t* rec = tasks + (int64_t)tid * TASK_WORDS;
      // warp 1 copies the record while thread 0 waits (the previous task's readers passed the barrier that ended it)
      if (threadIdx.x >= 32 && threadIdx.x < 32 + TASK_WORDS) s_rec[threadIdx.x - 32] = rec[threadIdx.x - 32];
      if (threadIdx.x == 0) {
        const int64_t* waits = ptr<const int64_t>(param(s_par, P_WAITS));
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
          const int nx = (i + 1 < end) ? i + 1 : ((ls + 1 < nsteps) ? beg : -1);
          if (PF_NEXT > 0 && nx >= 0) {
            const int64_t* pn = pft + (int64_t)list[nx] * PF_WORDS;
            const int nrn = (pn[0] != 0) + (pn[2] != 0);
            if (nrn > 0) {
              la_done = PF_NEXT / nrn;
              prefetch_task_weights(pn, 0, la_done);
            }
          }
        }
        int abort = 0;
        for (int64_t w = rec[T_WAIT_BEGIN]; w < rec[T_WAIT_END] && !abort; ++w) {
          const int64_t* wr = waits + w * WAIT_WORDS;
          const uint64_t* ctr = counters + wr[W_EVENT];
          const int64_t need = wr[W_TRIGGERS] * (step - wr[W_LAG]);
          const bool sys = wr[W_SCOPE] != 0;  // signalled by another rank: acquire at system scope
          uint64_t v = ld_acquire_scoped_u64(ctr, sys);
          if ((int64_t)v >= need) continue;
          const uint64_t t0 = globaltimer();
          for (uint32_t it = 1;; ++it) {
            v = ld_acquire_scoped_u64(ctr, sys);
            if ((int64_t)v >= need) break;
            if ((it & 255) == 0) {
              if (ld_volatile_s64(status + S_FLAG) != STATUS_OK) { abort = 1; break; }
              const uint64_t el = globaltimer() - t0;
              if (el > timeout_ns) {
                if (atomicCAS(reinterpret_cast<unsigned long long*>(status + S_FLAG), 0ull,
                              (unsigned long long)STATUS_TIMEOUT) == 0ull) {
                  status[S_SM] = sm; status[S_TASK] = tid; status[S_EVENT] = wr[W_EVENT];
                  status[S_COUNTER] = (int64_t)v; status[S_NEEDED] = need; status[S_STEP] = step;
                  status[S_ELAPSED_NS] = (int64_t)el;
                  __threadfence();
                }
                abort = 1;
                break;
              }
            }
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
      }
      __syncthreads();
      if (s_abort) return;
      const Ctx c{s_par, s_rec, step, ls, (int)(step & 1)};
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
      __syncthreads();
      MPK_STAMP(MPK_STAGE_WORDS - 2);   // every thread's op work done (the signals follow)
      if (threadIdx.x == 0) {
        const int64_t* signals = ptr<const int64_t>(param(s_par, P_SIGNALS));
        uint64_t* trace = ptr<uint64_t>(param(s_par, P_TRACE));
        // No __threadfence() first (MEMBAR.SC.GPU + CCTL.IVALL): after the barrier, the release add orders every
        // write of the CTA before it (release is cumulative over what the barrier made visible to thread 0; the
        // fence.acq_rel + relaxed-add form CUTLASS's barrier uses). rec: the global record (warp 1 may already be
        // copying the next task's into s_rec).
        for (int64_t s = rec[T_SIG_BEGIN]; s < rec[T_SIG_END]; ++s)
          signal_counter(signals[s]);  // local: red.release.gpu; a peer's (tagged): red.release.sys
        if (trace != nullptr && ls < param(s_par, P_TRACE_STEPS))
          trace[((int64_t)ls * param(s_par, P_NUM_TASKS) + tid) * 2 + 1] = globaltimer();
        MPK_STAMP(MPK_STAGE_WORDS - 1);   // signals issued
      }
    }
  }
}
