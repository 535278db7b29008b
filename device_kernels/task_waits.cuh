// A task's waits on its events (megakernel.cu's protocol; mpk_runtime/tasks/graph.py): thread 0 polls the task's
// counters before the task runs, in the persistent loop or, for the batch-1 tasks that overlap their first weight
// round with the waits (MPK_B1_PREWAIT, linear.cuh), inside the op.
#pragma once
#include "common.cuh"

namespace mpk {

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

// Thread 0, before a task of step `step` (the launch's ls-th step) on SM `sm` runs: every wait of its record (the
// inlined wait words, then the rest from the wait table), then the trace's start word (and the stamp row of
// stage-stamp builds). *abort_out (shared memory) = 1 when this SM must exit (a wait timed out here or elsewhere),
// else 0.
// (The parameter words are read when the TaskWaits is made: the persistent loop makes it before its prefetches.)
struct TaskWaits {
  const uint64_t* counters;
  int64_t* status;
  uint64_t* trace;
  uint64_t timeout_ns;
  __device__ __forceinline__ explicit TaskWaits(const int64_t* s_par)
      : counters(ptr<const uint64_t>(param(s_par, P_COUNTERS))), status(ptr<int64_t>(param(s_par, P_STATUS))),
        trace(ptr<uint64_t>(param(s_par, P_TRACE))), timeout_ns((uint64_t)param(s_par, P_TIMEOUT_NS)) {}
  __device__ __forceinline__ void poll(const int64_t* rec, const int64_t* s_par, int64_t step, int ls, int sm,
                                       int* abort_out) const;
};

__device__ __forceinline__ void TaskWaits::poll(const int64_t* rec, const int64_t* s_par, int64_t step, int ls,
                                                int sm, int* abort_out) const {
  const int tid = (int)rec[T_TASK_ID];
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
  *abort_out = abort;   // (shared memory: the CTA reads it after its barrier)
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

}  // namespace mpk
