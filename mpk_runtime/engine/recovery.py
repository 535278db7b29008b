"""What the engine does when workers must forget sequences or fail: freeing a finished or preempted sequence's
state on the workers, and a failed step's recovery (its requests failed with a message, the workers rebuilt or
checked, the queue kept). LLMEngine's (engine.py holds the rest; this class only uses its state)."""
from __future__ import annotations

import logging

from .request import Request, RequestOutput

log = logging.getLogger(__name__)


class RecoveryMixin:
    def _on_preempted(self) -> None:
        """Requests the scheduler preempted: their workers' per-sequence state goes (a runner that keeps K/V per
        sequence recomputes it from the start on readmission)."""
        pre, self.scheduler.preempted = self.scheduler.preempted, []
        self.stats["preemptions"] += len(pre)
        log.info("preempted %d request(s) for KV pages (%d free of %d): %s", len(pre), self.allocator.num_free,
                 self.allocator.num_pages, [r.request_id for r in pre][:8])
        try:
            self.executor.collective_rpc("free", ([r.seq_id for r in pre],), timeout=self.step_timeout)
        except Exception as e:  # the next execute call will surface a dead worker
            log.warning("free after preemption failed: %s", e)

    def _forget(self, req: Request, free_on_workers: bool) -> None:
        self._requests.pop(req.request_id, None)
        if free_on_workers:
            try:
                self.executor.collective_rpc("free", ([req.seq_id],), timeout=self.step_timeout)
            except Exception as e:  # the next execute call will surface a dead worker
                log.warning("free(%s) failed: %s", req.seq_id, e)

    def _forget_many(self, reqs: list[Request]) -> None:
        for r in reqs:
            self._requests.pop(r.request_id, None)
        self.stats["free_calls"] += 1
        try:
            self.executor.collective_rpc("free", ([r.seq_id for r in reqs],), timeout=self.step_timeout)
        except Exception as e:
            log.warning("free failed: %s", e)

    def check_health(self, timeout: float = 10.0) -> list[RequestOutput]:
        """Ask every worker for `health`; on failure run the same path as a failed step (rebuild if possible)."""
        if self.dead:
            return []
        try:
            self.executor.collective_rpc("health", timeout=timeout)
            return []
        except Exception as e:
            return self._on_failure(e)

    def _on_failure(self, exc: Exception) -> list[RequestOutput]:
        if self._inflight is not None:   # the burst queued after the failed one: its finished rows' pages go back
            b, self._inflight = self._inflight, None
            for r in b.deferred:
                self.scheduler.release(r)
        if self.async_bursts:   # bursts still queued on a rank (its peer failed): waited for and dropped
            try:
                self.executor.collective_rpc("discard_bursts", timeout=10)
            except Exception:   # noqa: BLE001 - the failure below is the one reported; recovery follows
                pass
        msg = f"{type(exc).__name__}: {exc}"
        log.error("step failed: %s", msg)
        outputs, failed_ids = [], []
        for r in list(self.scheduler.running):
            failed_ids.append(r.seq_id)
            self.scheduler.release(r)
            r.finish("error", error=f"the model workers failed while running this request ({msg}); "
                                    "it was not completed - retry it")
            self._requests.pop(r.request_id, None)
            self.stats["requests_failed"] += 1
            outputs.append(r.snapshot())
        self.allocator.reset()
        if self.on_failed_outputs is not None and outputs:
            self.on_failed_outputs(outputs)
            outputs = []
        recovered = False
        try:
            recovered = self.executor.recover()
        except Exception as e:  # recovery itself failed
            msg += f"; recovery failed: {type(e).__name__}: {e}"
        if recovered:
            self.stats["recoveries"] += 1
            try:   # workers kept, not rebuilt (InProcessExecutor), still hold the failed sequences' state
                self.executor.collective_rpc("free", (failed_ids,), timeout=10)
            except Exception as e:  # the next execute call will surface a dead worker
                log.warning("free after recovery failed: %s", e)
        else:
            try:  # workers may be fine (a Python exception in one step): keep serving if they answer
                self.executor.collective_rpc("health", timeout=10)
                self.executor.collective_rpc("free", (failed_ids,), timeout=10)
                recovered = True
            except Exception as e:
                msg += f"; health check failed: {e}"
        if not recovered:
            self.dead = msg
            for r in list(self.scheduler.waiting):
                self.scheduler.release(r)
                r.finish("error", error=f"the model workers are down ({msg})")
                self._requests.pop(r.request_id, None)
                self.stats["requests_failed"] += 1
                outputs.append(r.snapshot())
        return outputs
