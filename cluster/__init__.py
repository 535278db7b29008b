"""Ray placement, executor, replicas/router, HTTP server, client and jobs for mpk_runtime.

Importing this package does not import ray (that happens when a Ray object is first made); it registers the
"ray" executor name so that `LLM(..., executor="ray")` works after `import cluster`.
"""
from __future__ import annotations

from mpk_runtime.runtime.executor import register_executor

__all__ = ["RayExecutor", "Client", "Router", "Replica", "build_router", "ensure_ray", "nvshmem_uid_rendezvous",
           "create_app"]


@register_executor("ray")
def _make_ray_executor(world_size: int, **kwargs):
    from .ray_executor import RayExecutor
    from .ray_utils import ensure_ray
    ensure_ray()
    return RayExecutor(world_size, **kwargs)


def __getattr__(name: str):  # lazy: keep `import cluster` free of ray / fastapi imports
    if name == "RayExecutor":
        from .ray_executor import RayExecutor
        return RayExecutor
    if name in ("ensure_ray", "nvshmem_uid_rendezvous"):
        from . import ray_utils
        return getattr(ray_utils, name)
    if name == "Client":
        from .client import Client
        return Client
    if name in ("Router", "Replica", "build_router"):
        from . import router
        return getattr(router, name)
    if name == "create_app":
        from .server import create_app
        return create_app
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
