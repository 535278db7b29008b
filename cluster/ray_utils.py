"""Ray helpers: the lazy import, cluster start for tests/jobs, device selection, rendezvous.

Nothing here imports ray at module import time (`import cluster` works without Ray installed).
"""
from __future__ import annotations

import os
from typing import Any

# NVLink multicast stays off on these machines (NCCL's NVLS, NVSHMEM's, torch symmetric memory's): every Ray worker
# gets these (worker_runtime_env, RayExecutor's actors, scripts/submit.py, the launch scripts)
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def require_ray():
    """Import ray, or explain how to get it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("the cluster package needs Ray: pip install 'ray>=2.50' (or 'ray[default]' for the job API "
                          "and dashboard); in-process serving works without it: LLM(..., executor='inprocess')") from e
    return ray


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker_runtime_env(extra: dict | None = None) -> dict:
    """A runtime_env that lets workers import this checkout (when it is not pip-installed)."""
    env = {"env_vars": {"PYTHONPATH": repo_root() + os.pathsep + os.environ.get("PYTHONPATH", ""), **NO_MULTICAST}}
    if extra:
        env["env_vars"].update(extra.get("env_vars", {}))
        env.update({k: v for k, v in extra.items() if k != "env_vars"})
    return env


def ensure_ray(address: str | None = None, **init_kwargs: Any):
    """Connect to `address` (or RAY_ADDRESS), or start a small local cluster, unless already connected."""
    ray = require_ray()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") and not init_kwargs.get("runtime_env"):
            # inside `ray job submit`: the job's runtime_env (working_dir, env vars) already reaches every
            # worker, and Ray refuses a driver runtime_env that sets the same keys
            ray.init(address=address or "auto", **init_kwargs)
        elif address:
            check_gcs_reachable(address)
            ray.init(address=address, runtime_env=worker_runtime_env(init_kwargs.pop("runtime_env", None)),
                     **init_kwargs)
        else:
            init_kwargs.setdefault("include_dashboard", False)
            ray.init(runtime_env=worker_runtime_env(init_kwargs.pop("runtime_env", None)), **init_kwargs)
    return ray


def check_gcs_reachable(address: str, timeout: float = 10.0) -> None:
    """ConnectionError, at once, where nothing listens at a "host:port" Ray address: `ray.init` kept retrying such
    an address for minutes ("Failed to connect to GCS ... within 5 seconds", over and over), so a RAY_ADDRESS with a
    typo or a head that is down hung the server, the job and LLM(executor="ray"). Other forms ("auto", "ray://...")
    are Ray's to resolve."""
    import re
    import socket
    m = re.fullmatch(r"\[?([^\s/\[\]]+?)\]?:(\d+)", address.strip())
    if not m:
        return
    host, port = m.group(1), int(m.group(2))
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise ConnectionError(
            f"no Ray cluster answers at {address} (RAY_ADDRESS or --ray-address): {e.strerror or e}. Give the head's "
            "GCS address (HEAD_IP:6379, as scripts/launch_head.sh prints it; not the dashboard's :8265), start the "
            "head (scripts/launch_head.sh), or unset RAY_ADDRESS to start a local Ray") from None
    try:
        http = _answers_http(sock)
    finally:
        sock.close()
    if http:
        # (the dashboard / Job API's port, HEAD:8265, as submit.py's --address takes it without http://: the port is
        # open, so ray.init connected and then retried "Failed to get cluster ID from GCS" for good)
        raise ConnectionError(
            f"{address} (RAY_ADDRESS or --ray-address) is an HTTP server - the Ray dashboard / Job API (:8265) or "
            "another web server - not a Ray cluster's GCS. Give the head's GCS address (HEAD_IP:6379, as "
            "scripts/launch_head.sh prints it); the dashboard's http:// address is for scripts/submit.py --address")


def _answers_http(sock, wait: float = 1.0) -> bool:
    """Whether the server on `sock` speaks HTTP/1 (a web server such as Ray's dashboard) rather than gRPC (the GCS).
    A gRPC server (HTTP/2) sends its SETTINGS frame as soon as it accepts; an HTTP/1 server waits for a request and
    answers "HTTP/1.x ...". Unsure (no answer, an error) counts as not HTTP: Ray's own connection decides then."""
    try:
        sock.settimeout(wait)
        try:
            if sock.recv(1):
                return False   # it spoke first: gRPC
        except TimeoutError:
            pass
        sock.sendall(b"HEAD / HTTP/1.0\r\n\r\n")
        return sock.recv(5).startswith(b"HTTP/")
    except OSError:
        return False


def local_device_index(gpu_ids: list, visible: str | None) -> int:
    """The CUDA ordinal (inside this process) of the first GPU Ray gave us.

    Ray normally narrows CUDA_VISIBLE_DEVICES to the actor's GPUs (then ordinal 0 is ours); with
    RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 all GPUs stay visible and the ordinal is the position of our
    Ray GPU id in the visible list (or the id itself when nothing narrows the list).
    """
    if not gpu_ids:
        raise ValueError("this worker was given no GPU by Ray; request num_gpus=1 per worker")
    gid = str(gpu_ids[0])
    if visible:
        vis = [v.strip() for v in visible.split(",") if v.strip()]
        if gid in vis:
            return vis.index(gid)
        if len(vis) == len(gpu_ids):
            return 0
        raise ValueError(f"Ray GPU id {gid} is not in CUDA_VISIBLE_DEVICES={visible!r}; unset "
                         "CUDA_VISIBLE_DEVICES on the node or let Ray manage it")
    return int(gid)


def nvshmem_uid_rendezvous(actors: list, timeout: float = 60.0) -> list:
    """NVSHMEM bootstrap through Ray: rank 0 makes the 128-byte unique id, every rank gets the bytes and all
    call `nvshmem.core.init` together (GPUs only; see notes/gpu-machines.md "NVSHMEM from Python").

    `actors[r]` must expose `nvshmem_unique_id() -> bytes` and `nvshmem_init(uid: bytes, rank, nranks)`
    (`cluster.ray_executor.RayWorker` does). Returns each rank's init result.
    """
    ray = require_ray()
    uid = ray.get(actors[0].nvshmem_unique_id.remote(), timeout=timeout)
    if not isinstance(uid, (bytes, bytearray)) or not uid:
        raise RuntimeError(f"rank 0 returned an invalid NVSHMEM unique id ({type(uid).__name__})")
    n = len(actors)
    # all ranks must enter init at once: it is collective
    return ray.get([a.nvshmem_init.remote(bytes(uid), r, n) for r, a in enumerate(actors)], timeout=timeout)


def nvshmem_unique_id_bytes() -> bytes:
    import ctypes

    import nvshmem.core as nv
    u = nv.get_unique_id()
    return ctypes.string_at(u.ptr, u._data.itemsize)


def nvshmem_init_from_bytes(uid: bytes, rank: int, nranks: int, device_index: int) -> None:
    import ctypes

    import nvshmem.core as nv
    from cuda.core import Device  # cuda.core >= 1.0 (older: cuda.core.experimental)
    u = nv.get_unique_id(empty=True)
    ctypes.memmove(u.ptr, uid, len(uid))
    dev = Device(device_index)
    dev.set_current()
    nv.init(device=dev, uid=u, rank=rank, nranks=nranks, initializer_method="uid")
