"""`RayExecutor`: one Ray actor per rank, packed into one placement group per model replica.

Each actor is a `RayWorker` (an `mpk_runtime` `Worker` plus rendezvous and device helpers). The controller
(this object) plans once, picks the rendezvous address from rank 0, and ships the same backend, runner kwargs
and plan to every rank; workers load their weights themselves from the model path (never through the object
store). Calls are `ray.get` with timeouts, so a dead rank errors at once (naming the rank and its node) and a hung
rank within the timeout; `recover()` kills the actors, starts new ones in the same placement group and repeats the
rendezvous. A TP group that no node of the cluster could ever hold is refused at once, not after the placement
timeout; after `shutdown()` calls fail saying so and nothing is rebuilt.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
import weakref
from typing import Any

from mpk_runtime.runtime.executor import Executor, Worker, WorkerError, WorkerTimeout, call_timing
from mpk_runtime.runtime.worker import free_port

from .plan import make_plan
from .ray_utils import (NO_MULTICAST, local_device_index, nvshmem_init_from_bytes, nvshmem_unique_id_bytes, repo_root,
                        require_ray)

log = logging.getLogger(__name__)


class PlacementError(RuntimeError):
    """The replica's TP group cannot be placed: no node has (or, within the timeout, frees) tp bundles."""


class RayWorker(Worker):
    """Runs inside a Ray actor process."""

    def node_info(self) -> dict:
        ray = require_ray()
        ctx = ray.get_runtime_context()
        return {"rank": self.rank, "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def device(self) -> str:
        """"cuda:<i>" for the GPU Ray assigned (whether or not Ray narrowed CUDA_VISIBLE_DEVICES), else "cpu"."""
        ray = require_ray()
        import torch
        gpu_ids = ray.get_gpu_ids()
        if not gpu_ids or not torch.cuda.is_available():
            return "cpu"  # logical GPUs on a CPU machine (tests), or a CPU-only worker
        return f"cuda:{local_device_index(gpu_ids, os.environ.get('CUDA_VISIBLE_DEVICES'))}"

    def rendezvous_address(self) -> str:
        ray = require_ray()
        ip = ray.util.get_node_ip_address()
        return f"tcp://{ip}:{free_port('0.0.0.0')}"

    def init_model(self, backend: str, comm_spec: Any = None, **runner_kwargs: Any) -> dict:
        if runner_kwargs.get("device") in (None, "auto"):
            runner_kwargs["device"] = self.device()
        if isinstance(comm_spec, dict) and comm_spec.get("backend") == "auto":
            comm_spec = dict(comm_spec, backend="nccl" if runner_kwargs["device"].startswith("cuda") else "gloo")
        if runner_kwargs["device"].startswith("cuda"):
            import torch
            torch.cuda.set_device(runner_kwargs["device"])
        return super().init_model(backend, comm_spec, **runner_kwargs)

    def init_comm_only(self, comm_spec: Any) -> None:
        if isinstance(comm_spec, dict) and comm_spec.get("backend") == "auto":
            comm_spec = dict(comm_spec, backend="nccl" if self.device().startswith("cuda") else "gloo")
        super().init_comm_only(comm_spec)

    def nvshmem_unique_id(self) -> bytes:
        return nvshmem_unique_id_bytes()

    def nvshmem_init(self, uid: bytes, rank: int, nranks: int) -> bool:
        dev = self.device()
        if not dev.startswith("cuda"):
            raise RuntimeError("NVSHMEM needs a CUDA GPU; this worker has none")
        nvshmem_init_from_bytes(uid, rank, nranks, int(dev.split(":")[1]))
        return True


class RayExecutor(Executor):
    def __init__(self, world_size: int = 1, num_gpus_per_worker: float | None = None,
                 num_cpus_per_worker: float | None = None, target_node_id: str | None = None,
                 rpc_timeout: float = 60.0, init_timeout: float = 300.0, placement_timeout: float = 60.0,
                 name: str | None = None, runtime_env: dict | None = None, wait_for_nodes: bool = False):
        """num_gpus_per_worker: None = 1 when the cluster has GPU resources (logical ones count), else 0.
        target_node_id: prefer this node for the placement group (the router spreads replicas this way).
        rpc_timeout: default seconds for a call without its own timeout (hangs are errors, not waits).
        wait_for_nodes: an autoscaling cluster that adds nodes on demand: wait placement_timeout for one that holds
        the group, where by default a group no current node could hold is refused at once (PlacementError).
        runtime_env: the actors' (merged over `_actor_runtime_env`'s: NVLink multicast off, this checkout importable
        where the job does not ship it)."""
        ray = require_ray()
        if not ray.is_initialized():
            raise RuntimeError("Ray is not initialised: call cluster.ensure_ray() (or ray.init(...)) first")
        self.ray = ray
        self.world_size = world_size
        self.num_gpus, self.num_cpus = worker_resources(ray, num_gpus_per_worker, num_cpus_per_worker)
        self.rpc_timeout, self.init_timeout = rpc_timeout, init_timeout
        self.name = name or f"replica-{id(self):x}"
        self.runtime_env = _actor_runtime_env(ray, runtime_env)
        self.actors: list = []
        self._closed = False
        self._init_args: tuple[str, dict] | None = None
        self._pg = None
        self._pg_release = None
        try:   # (a failed start - actors that cannot be made, Ctrl+C while waiting for the group - gives the group back)
            self._pg = self._make_placement_group(target_node_id, placement_timeout, wait_for_nodes)
            # an executor dropped without shutdown() (an LLM rebound in a notebook, a Router never shut down): Ray
            # kills its actors with their last handle, but the placement group held its GPUs for the driver's life,
            # and the next LLM waited placement_timeout for a PlacementError blaming "other replicas or jobs"
            self._pg_release = weakref.finalize(self, _remove_placement_group, self._pg)
            self._pg_release.atexit = False   # (at exit the job ends, and Ray removes its groups itself)
            self._start_actors()
        except BaseException:
            self.shutdown()
            raise

    # --- placement ----------------------------------------------------------------------------------------
    def _make_placement_group(self, target_node_id, timeout, wait_for_nodes=False):
        from ray.util.placement_group import placement_group
        bundle = worker_bundle(self.num_gpus, self.num_cpus)
        if not wait_for_nodes:
            self._check_fits(bundle)
        # (a unique name: Ray refuses a second group of the same name in a namespace, and every router names its
        # replicas replica-0, replica-1, ...: a second router in one driver died in a RaySystemError "name
        # 'mpk-replica-0' already exists")
        pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="STRICT_PACK",
                             name=f"mpk-{self.name}-{uuid.uuid4().hex[:8]}", _soft_target_node_id=target_node_id)
        try:
            self.ray.get(pg.ready(), timeout=timeout)
        except BaseException as e:
            # (BaseException: a Ctrl+C during the wait left the group pending, and it took the GPUs once they freed)
            _remove_placement_group(pg)
            if not isinstance(e, Exception):
                raise
            raise PlacementError(
                f"placement group for {self.name} ({self.world_size} x {bundle}, STRICT_PACK on one node) was not "
                f"ready within {timeout} s. Cluster resources: {_plain(self.ray.cluster_resources())}, available: "
                f"{_plain(self.ray.available_resources())} (held by other replicas or jobs). A TP group must fit on "
                f"one node: add a node with {self.world_size} GPUs, lower tp, or run fewer replicas") from e
        return pg

    def _check_fits(self, bundle: dict) -> None:
        """STRICT_PACK puts the whole group on one node: when no live node has that much in total (busy or not),
        the placement group would never be ready and the caller waited placement_timeout (60 s) for an error; say so
        now, with each node's totals. (Resources held by other replicas still wait: they may be given back.)"""
        need = {k: v * self.world_size for k, v in bundle.items()}
        nodes = [n for n in self.ray.nodes() if n.get("Alive")]
        if any(all(n.get("Resources", {}).get(k, 0) >= v for k, v in need.items()) for n in nodes):
            return
        have = "; ".join(f"{n.get('NodeManagerAddress')}: " + ", ".join(
            f"{k} {n.get('Resources', {}).get(k, 0):g}" for k in need) for n in nodes) or "no live nodes"
        raise PlacementError(
            f"{self.name}: a TP group of {self.world_size} ranks x {bundle} needs {need} on one node (STRICT_PACK), "
            f"and no node of this Ray cluster has that many ({have}). Lower tp, start Ray with more GPUs / CPUs "
            "on a node (ray start --num-gpus N), or pass wait_for_nodes=True on an autoscaling cluster")

    def _where(self, rank: int) -> str:
        """"node <ip> (<node id>)" of `rank`'s bundle, for error messages (a dead rank's node may be the cause);
        "" when the placement group table cannot say."""
        try:
            from ray.util.placement_group import placement_group_table
            node_id = placement_group_table(self._pg)["bundles_to_node_id"][rank]
            ip = next((n.get("NodeManagerAddress") for n in self.ray.nodes() if n.get("NodeID") == node_id), "?")
            return f" on node {ip} ({node_id[:12]})"
        except Exception:  # noqa: BLE001 - the message is still the rank's
            return ""

    def _start_actors(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        cls = self.ray.remote(RayWorker)
        opts: dict = {"num_gpus": self.num_gpus, "num_cpus": self.num_cpus, "max_restarts": 0,
                      "max_concurrency": 2,  # 2: health() still answers while execute() runs
                      "runtime_env": self.runtime_env}
        self.actors = [cls.options(**opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._pg, placement_group_bundle_index=r)).remote(r, self.world_size)
            for r in range(self.world_size)]

    # --- calls --------------------------------------------------------------------------------------------
    def _gather(self, refs: list, method: str, timeout: float | None) -> list:
        """Results in rank order; the first failing rank raises at once (a dead peer is not waited for)."""
        from ray.exceptions import GetTimeoutError, RayActorError
        timeout = self.rpc_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        rank_of = {r.hex() if hasattr(r, "hex") else id(r): i for i, r in enumerate(refs)}
        results: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            ready, pending = self.ray.wait(pending, num_returns=1, timeout=max(0.0, left))
            if not ready:
                slow = [rank_of[p.hex()] for p in pending]
                raise WorkerTimeout(f"{self.name}: ranks {slow} (rank {slow[0]}{self._where(slow[0])}) did not finish "
                                    f"{method!r} within {timeout} s "
                                    "(hung or far too slow); the replica will be rebuilt", slow[0], method)
            ref = ready[0]
            rank = rank_of[ref.hex()]
            try:
                results[rank] = self.ray.get(ref, timeout=max(0.0, deadline - time.monotonic()) + 1)
            except RayActorError as e:
                raise WorkerError(f"{self.name}: rank {rank}{self._where(rank)} died during {method!r} "
                                  f"({type(e).__name__}{_death_cause(e)})", rank, method) from e
            except GetTimeoutError:
                raise WorkerTimeout(f"{self.name}: rank {rank}{self._where(rank)} timed out in {method!r}", rank,
                                    method) from None
            except Exception as e:
                dead = self._dead_peer(pending, rank_of)
                if dead is not None:   # the root cause: a peer that died (this rank's collective failed after it)
                    r, de = dead
                    raise WorkerError(f"{self.name}: rank {r}{self._where(r)} died during {method!r} "
                                      f"({type(de).__name__}{_death_cause(de)}); rank {rank} failed after it",
                                      r, method) from de
                raise WorkerError(f"{self.name}: rank {rank}{self._where(rank)} failed in {method!r}: "
                                  f"{_task_error(e)}", rank, method) from e
        return results

    def _dead_peer(self, pending: list, rank_of: dict, grace_s: float = 2.0):
        """(rank, RayActorError) of a rank among `pending` whose actor died, waiting up to grace_s for them to end;
        None when none did. A rank whose collective fails because a peer's process exited raises first as often as
        not (gloo notices the closed socket before Ray reports the death), and its error named the survivor."""
        from ray.exceptions import RayActorError
        if not pending:
            return None
        ready, _ = self.ray.wait(pending, num_returns=len(pending), timeout=grace_s)
        for ref in ready:
            try:
                self.ray.get(ref, timeout=0)
            except RayActorError as e:
                return rank_of[ref.hex()], e
            except Exception:  # noqa: BLE001 - another survivor's failure
                continue
        return None

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        if self._closed or not self.actors:
            raise WorkerError(f"{self.name} is shut down; create a new LLM / executor")
        kwargs = kwargs or {}
        if method not in ("execute", "collect") or kwargs.get("defer"):
            return self._gather([getattr(a, method).remote(*args, **kwargs) for a in self.actors], method, timeout)
        return self._timed(method, args, kwargs, timeout)

    def _timed(self, method: str, args: tuple, kwargs: dict, timeout: float | None) -> list:
        """A step (or a deferred burst's collection) on every rank, each also returning its own timing
        (Worker.execute_timed / collect_timed), so the engine can tell the model's time from the call's (submit,
        object store, result transfer)."""
        submit_wall, t_submit = time.time(), time.perf_counter()
        refs = [getattr(a, method + "_timed").remote(*args, **kwargs) for a in self.actors]
        t_submitted = time.perf_counter()
        pairs = self._gather(refs, method, timeout)
        self.last_timing = call_timing(submit_wall, t_submit, t_submitted, time.perf_counter(), time.time(),
                                       [p[1] for p in pairs])
        return [p[0] for p in pairs]

    def comm_spec(self) -> dict | None:
        """torch.distributed rendezvous: rank 0 picks a free port on its node; the address travels by actor call. It is
        the first call rank 0's actor answers, so it waits out the actor's start (process, imports) too: init_timeout,
        not a short RPC limit (a 30 s limit failed two CI tests on a loaded 2-core machine, session 62)."""
        if self.world_size == 1:
            return None
        addr = self._gather([self.actors[0].rendezvous_address.remote()], "rendezvous_address", self.init_timeout)[0]
        return {"kind": "torch.distributed", "init_method": addr, "backend": "auto", "timeout_s": self.init_timeout}

    def init_workers(self, backend: str, **runner_kwargs: Any) -> list[dict]:
        self._init_args = (backend, dict(runner_kwargs))
        kw = dict(runner_kwargs)
        plan = make_plan(None, self.world_size, backend, kw)  # planned once here, shipped to every rank
        if plan is not None:
            kw["plan"] = plan
        return self.collective_rpc("init_model", (backend, self.comm_spec()), kw, timeout=self.init_timeout)

    def recover(self) -> bool:
        """Kill every actor of the replica, start fresh ones in the same placement group, rendezvous again."""
        if self._init_args is None or self._closed:   # (after shutdown: its placement group is gone)
            return False
        log.warning("%s: rebuilding %d workers", self.name, self.world_size)
        self._kill_actors()
        self.ray.get(self._pg.ready(), timeout=self.init_timeout)  # a lost node's bundles are rescheduled
        self._start_actors()
        backend, kw = self._init_args
        self.init_workers(backend, **kw)
        return True

    def node_ids(self) -> list[str]:
        return [i["node_id"] for i in self.collective_rpc("node_info", timeout=30)]

    def _kill_actors(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = []

    def shutdown(self) -> None:
        self._closed = True
        self._kill_actors()
        if self._pg_release is not None:
            self._pg_release()   # (removes the group, once)
        elif self._pg is not None:
            _remove_placement_group(self._pg)
        self._pg = None


def _remove_placement_group(pg) -> None:
    """Give a placement group back; nothing where Ray is down already (its groups went with it)."""
    try:
        import ray
        if ray.is_initialized():
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - removed already, or the cluster is gone
        pass


def worker_resources(ray, num_gpus: float | None, num_cpus: float | None) -> tuple[float, float]:
    """(GPUs, CPUs) per rank: GPUs None = 1 where the cluster has GPU resources (logical ones count), else 0; CPUs
    None = 0 with a GPU, else 1."""
    if num_gpus is None:
        num_gpus = 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0
    return num_gpus, (num_cpus if num_cpus is not None else (0 if num_gpus else 1))


def worker_bundle(num_gpus: float, num_cpus: float) -> dict:
    """One rank's placement group bundle."""
    bundle = {}
    if num_gpus:
        bundle["GPU"] = num_gpus
    if num_cpus:
        bundle["CPU"] = num_cpus
    return bundle or {"CPU": 0.01}


def groups_that_fit(ray, world_size: int, bundle: dict) -> int:
    """How many STRICT_PACK groups of world_size x bundle the live nodes could hold at once (each on one node), by
    the nodes' totals, busy or not."""
    need = {k: v * world_size for k, v in bundle.items()}
    return sum(int(min(n.get("Resources", {}).get(k, 0) // v for k, v in need.items()))
               for n in ray.nodes() if n.get("Alive"))


def _plain(resources: dict) -> dict:
    """A resources dict without Ray's per-placement-group entries ("GPU_group_0_<id>", "bundle_group_<id>") and
    node markers, which buried CPU / GPU among dozens of ids in the placement timeout's message."""
    return {k: v for k, v in resources.items() if "_group_" not in k and not k.startswith("node:")}


def _task_error(e: Exception) -> str:
    """"Type: message" of the exception a rank's call raised, as the in-process executor says it. A RayTaskError's
    str is the whole remote traceback, in terminal colours, with the actor's pid, id and repr: that went into the
    error of every request failed by it (an HTTP client's JSON) and into LLM's init error. (It stays chained.)"""
    cause = getattr(e, "cause", None)
    if not isinstance(cause, BaseException):
        cause = e
    return f"{type(cause).__name__}: {cause}"


def _death_cause(e: Exception) -> str:
    """The line of a RayActorError that says why: the exception its __init__ raised (an actor that cannot import
    this package: "ModuleNotFoundError: No module named 'cluster'"), else Ray's exit reason; "" when none."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if getattr(e, "actor_init_failed", False):
        errs = [ln for ln in lines if "Error:" in ln and not ln.startswith("ray.exceptions")]
        return f": its start failed: {errs[-1]}" if errs else ""
    why = [ln.split(" Some common causes")[0] for ln in lines
           if "exit type" in ln.lower() or "dead because" in ln.lower()]
    return f": {why[0][:300]}" if why else ""


def _actor_runtime_env(ray, given: dict | None) -> dict:
    """Every actor gets NVLink multicast off (NO_MULTICAST) whoever started Ray: a driver's own `ray.init()` or a
    cluster joined by address set none of it (only `ensure_ray`'s local start and submit.py's jobs did). And where the
    job ships no code (no working_dir / py_modules) and its PYTHONPATH lacks this checkout, the checkout goes on the
    actors' PYTHONPATH: their processes must import `cluster.ray_executor` (after a plain `ray.init()` each actor died
    at start with "No module named 'cluster'", reported as a bare ActorDiedError). `given` is merged over this."""
    env_vars = dict(NO_MULTICAST)
    try:
        job = dict(ray.get_runtime_context().runtime_env or {})
    except Exception:  # noqa: BLE001 - an old or odd Ray: no PYTHONPATH help then
        job = {"working_dir": "(unknown)"}
    if not (job.get("working_dir") or job.get("py_modules")):
        job_path = (job.get("env_vars") or {}).get("PYTHONPATH")
        if repo_root() not in (job_path or "").split(os.pathsep):
            # (the actor's PYTHONPATH replaces the job's: keep the job's, else the node's own through Ray's ${VAR})
            env_vars["PYTHONPATH"] = repo_root() + os.pathsep + (job_path if job_path is not None else "${PYTHONPATH}")
    env: dict = dict(given or {})
    env["env_vars"] = {**env_vars, **(env.get("env_vars") or {})}
    return env
