"""Model replicas (an `LLM` engine driven by an `EngineLoop`, in this process or in a child process of its own:
`EngineProcess`) behind a least-loaded router.

`build_router(model, tp=2, num_replicas=2)` makes one Ray placement group per replica (STRICT_PACK: a TP group
shares a node) and spreads replicas over the nodes that can hold them. With executor="inprocess" it builds
replicas in this process instead (no Ray) - the HTTP server works the same way on top of either. With
engine_process=True each replica's engine and loop run in a process of their own (with executor "ray" that process
drives the replica's actors), so the HTTP handlers no longer share a GIL with them (engine/engine_process.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from mpk_runtime.engine import LLM, InvalidRequestError, RequestFailedError, SamplingParams
from mpk_runtime.engine.async_engine import EngineLoop, OutputCallback
from mpk_runtime.engine.sampling import request_seed
from mpk_runtime.engine.engine_process import EngineProcess

log = logging.getLogger(__name__)


@dataclass
class Replica:
    name: str
    llm: LLM | None      # None where the engine runs in a process of its own (loop is then an EngineProcess)
    loop: EngineLoop | EngineProcess
    # why it takes no more requests once shutdown() began: a stopped EngineLoop reports dead=None (it was stopped,
    # not lost) and an EngineProcess "exited" as after a crash, so /health said ok or the wrong thing
    shut_down: str | None = field(default=None, init=False)

    @property
    def engine(self):
        """The LLMEngine, or the EngineView of one in another process: validation, kv_spec, prefix cache."""
        return self.loop.engine

    def stats(self) -> dict:
        """loop.stats(), with `dead` saying it was shut down once it was."""
        if self.shut_down is None:
            return self.loop.stats()
        if self.loop.alive:   # (still stopping: an engine process would be asked over its pipe, and may not answer)
            return {"dead": f"{self.shut_down} (still stopping)", "outstanding": self.loop.load}
        try:
            s = self.loop.stats()
        except Exception:  # noqa: BLE001 - a stopped engine need not answer: it is down either way
            s = {}
        return {**s, "dead": self.shut_down}

    def shutdown(self) -> None:
        if self.shut_down is None:
            self.shut_down = "shut down"   # (first: no more picks, and /health says so while it stops)
        try:
            try:
                self.loop.shutdown()
            finally:
                if self.llm is not None:
                    self.llm.shutdown()
        except Exception as e:
            self.shut_down = f"shut down; its shutdown failed: {type(e).__name__}: {e}"
            raise


def _shutdown_all(replicas: list[Replica], timeout: float) -> list[tuple[str, BaseException]]:
    """Shut every replica down at once (each may wait seconds for its engine process or its workers to exit),
    every one past any that fails, within `timeout` s in all. The failures in replica order, a replica still
    stopping at the deadline as a TimeoutError (its thread is a daemon: it cannot hold up the process's exit)."""
    errors: dict[str, BaseException] = {}

    def stop(r: Replica) -> None:
        try:
            r.shutdown()
        except Exception as e:  # noqa: BLE001 - the others must still stop
            log.exception("shutdown of %s failed", r.name)
            errors[r.name] = e
    threads = [threading.Thread(target=stop, args=(r,), name=f"mpk-stop-{r.name}", daemon=True) for r in replicas]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    fails = []
    for r, t in zip(replicas, threads):
        if t.is_alive():
            log.error("%s did not stop within %g s", r.name, timeout)
            fails.append((r.name, TimeoutError(f"{r.name} did not stop within {timeout:g} s")))
        elif r.name in errors:
            fails.append((r.name, errors[r.name]))
    return fails


class Router:
    def __init__(self, replicas: list[Replica], model_name: str, stall_after: float = 10.0, seed: int = 0):
        """stall_after: a replica whose engine loop has not gone round for this many seconds (stalled_s: wedged,
        or inside one very long step) is picked only where every live replica is. Keep it well above 2 s: an idle
        engine process's loop goes round every 0.5 s and tells the parent each second. seed: the replicas' engine
        seed (LLM's seed), from which submit seeds the unseeded requests where there are several replicas."""
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.replicas = replicas
        self.model_name = model_name
        self.stall_after = stall_after
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self.seed = seed
        self._seq = itertools.count()   # (unseeded requests, numbered across the replicas)

    @property
    def engine(self):
        """Any replica's engine: they share config, kv spec and tokenizer (used for validation/tokenizing)."""
        return self.replicas[0].engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer.get()

    def pick(self, prompt_token_ids: list[int] | None = None) -> Replica:
        """The least loaded live replica; with prefix caching, the one holding the longest cached prefix of the
        prompt instead, unless it has more than a quarter of a batch more requests outstanding. Stalled replicas
        (stall_after) only where no other is live."""
        live = [r for r in self.replicas if not r.shut_down and not r.engine.dead and r.loop.alive]
        if not live:
            raise RequestFailedError("every replica is down: " + "; ".join(
                f"{r.name}: {r.shut_down or r.engine.dead or 'engine loop exited'}" for r in self.replicas))
        live = [r for r in live if r.loop.stalled_s <= self.stall_after] or live
        with self._lock:
            start = next(self._rr)  # rotate among equally loaded replicas
            order = live[start % len(live):] + live[:start % len(live)]
            least = min(order, key=lambda r: r.loop.load)
            if prompt_token_ids is None or len(order) == 1:
                return least
            slack = max(1, least.engine.kv_spec.max_batch // 4)
            near = [r for r in order if r.loop.load <= least.loop.load + slack and r.engine.prefix_caching]
            if not near:
                return least
            hits = [len(r.engine.allocator.match(prompt_token_ids)[0]) for r in near]   # (read-only lookups)
            best = max(range(len(near)), key=lambda i: (hits[i], -near[i].loop.load))
            return near[best] if hits[best] else least

    def submit(self, prompt_token_ids: list[int], params: SamplingParams, on_output: OutputCallback,
               prompt: str | None = None, stream: bool = True) -> tuple[Replica, str]:
        """stream=False: on_output gets the finished output only (AsyncEngine.submit). With several replicas an
        unseeded request is seeded here, from the router's count of them: each replica numbers its own requests
        from 0 and the replicas share the engine seed, so the i-th request of two replicas drew alike (the n
        completions of one prompt, spread over them, came back as copies). One replica: its own numbering, as an
        LLM's."""
        if params.n != 1:   # (the engine would refuse it in its loop, as an error output: refused here, at once)
            raise InvalidRequestError(f"a router request is one completion, and these params ask for n={params.n}: "
                                      "submit one for each of mpk_runtime.engine.sampling.completions(params)")
        if params.seed is None and len(self.replicas) > 1:
            params = dataclasses.replace(params, seed=request_seed(params, self.seed, next(self._seq)))
        rep = self.pick(prompt_token_ids)
        return rep, rep.loop.submit(prompt_token_ids, params, on_output, prompt=prompt, stream=stream)

    def stats(self) -> dict[str, dict]:
        return {r.name: r.stats() for r in self.replicas}

    def shutdown(self, timeout: float = 60.0) -> None:
        """Shut every replica down at once, within `timeout` s in all (an engine process may take 25 s: its exit,
        then a kill), each past any that fails. Then raises the first failure in replica order (a TimeoutError
        for a replica not stopped in time), every failure named in its notes where there are several."""
        fails = _shutdown_all(self.replicas, timeout)
        if fails:
            err = fails[0][1]
            if len(fails) > 1:
                note = "replica shutdowns that failed: " + "; ".join(f"{n}: {type(e).__name__}: {e}" for n, e in fails)
                log.error("%s", note)
                if hasattr(err, "add_note"):   # (Python 3.11+; 3.10 has the log line only)
                    err.add_note(note)
            raise err


def _spread_nodes(ray, tp: int, gpus: bool, n: int) -> list[str | None]:
    """A target node per replica, round-robin over alive nodes big enough for a TP group."""
    res = "GPU" if gpus else "CPU"
    nodes = [nd["NodeID"] for nd in ray.nodes() if nd.get("Alive") and nd["Resources"].get(res, 0) >= tp]
    if not nodes:
        return [None] * n
    return [nodes[i % len(nodes)] for i in range(n)]


def _check_replicas_fit(ray, tp: int, num_replicas: int, rk: dict) -> None:
    """Every replica's TP group must be placed at once: where the live nodes' totals cannot hold num_replicas of them
    (3 replicas on 2 GPUs; tp=2 x 2 replicas on a 2-CPU machine), the first ones started and the last waited
    placement_timeout (60 s) for its PlacementError, which blamed the cluster's free resources (held by this very
    router). Refused before any replica starts now. (None fitting at all is RayExecutor's own, more detailed error.)"""
    from .ray_executor import PlacementError, groups_that_fit, worker_bundle, worker_resources
    bundle = worker_bundle(*worker_resources(ray, rk.get("num_gpus_per_worker"), rk.get("num_cpus_per_worker")))
    fit = groups_that_fit(ray, tp, bundle)
    if 0 < fit < num_replicas:
        need = {k: v * tp for k, v in bundle.items()}
        have = "; ".join(f"{n.get('NodeManagerAddress')}: " + ", ".join(
            f"{k} {n.get('Resources', {}).get(k, 0):g}" for k in need) for n in ray.nodes() if n.get("Alive"))
        raise PlacementError(
            f"{num_replicas} replicas of tp={tp} need {num_replicas} x {need} (each replica's group on one node), and "
            f"this Ray cluster's nodes hold at most {fit} such group{'s' if fit > 1 else ''} ({have}): run "
            f"--replicas {fit} or fewer, lower tp, or add nodes (pass ray_executor_kwargs wait_for_nodes=True on an "
            "autoscaling cluster)")


def build_router(model: str, backend: str = "reference", tp: int = 1, num_replicas: int = 1,
                 executor: str = "ray", step_timeout: float | None = 30.0, health_interval: float | None = 5.0,
                 ray_executor_kwargs: dict | None = None, engine_process: bool = False, stall_after: float = 10.0,
                 wedge_timeout: float | None = 300.0, **llm_kwargs: Any) -> Router:
    """Build `num_replicas` replicas of `model` (executor "ray" or "inprocess") and a router over them.
    engine_process: each replica's engine (scheduler, sampling, its loop) in a child process of its own; with
    executor "ray" the child joins this process's Ray cluster as a driver and its workers are actors there, as
    they would be of this process (placed the same way). stall_after: Router's;
    wedge_timeout: EngineProcess's (a child whose loop stops going round that long is killed and restarted; an
    engine in this process cannot be, and stays out of the router's picks while stalled)."""
    if engine_process and executor not in ("inprocess", "ray"):
        raise InvalidRequestError(f"engine_process works with executor 'inprocess' or 'ray', not {executor!r}")
    replicas = []
    try:
        if executor == "ray":
            from .ray_utils import ensure_ray   # (executor="ray" is registered: cluster/__init__ ran before this module)
            ray = ensure_ray()
            rk = dict(ray_executor_kwargs or {})
            if not rk.get("wait_for_nodes"):
                _check_replicas_fit(ray, tp, num_replicas, rk)
            gpus = rk.get("num_gpus_per_worker")
            gpus = ray.cluster_resources().get("GPU", 0) >= 1 if gpus is None else bool(gpus)
            targets = _spread_nodes(ray, tp, gpus, num_replicas)
            rk.setdefault("rpc_timeout", step_timeout or 60.0)
            # a child engine process connects to this cluster (not a new one) and registers the "ray" executor
            child = dict(child_env={"RAY_ADDRESS": ray.get_runtime_context().gcs_address},
                         child_imports=("cluster",))
        for i in range(num_replicas):
            name = f"replica-{i}"
            if engine_process:
                kw = dict(llm_kwargs)
                if executor == "ray":
                    kw.update(child, executor_kwargs=dict(rk, target_node_id=targets[i], name=name))
                replicas.append(Replica(name, None, EngineProcess(
                    model, name=name, health_interval=health_interval, wedge_timeout=wedge_timeout, backend=backend,
                    tp=tp, executor=executor, step_timeout=step_timeout, **kw)))
                continue
            kw = dict(llm_kwargs)
            if executor == "ray":   # (made by LLM once it has checked the model and its arguments, and shut down by
                # it when its start fails: a RayExecutor made here first held its GPUs and actors after a bad --model)
                kw["executor_kwargs"] = dict(rk, target_node_id=targets[i], name=name)
            llm = LLM(model, backend=backend, tp=tp, executor=executor, step_timeout=step_timeout, **kw)
            replicas.append(Replica(name, llm, EngineLoop(llm.engine, name=name, health_interval=health_interval)))
    except BaseException:
        _shutdown_all(replicas, 60.0)   # (logs its failures: the build's own error is the one to raise)
        raise
    return Router(replicas, model_name=model, stall_after=stall_after, seed=llm_kwargs.get("seed") or 0)
