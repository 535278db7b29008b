import os

import pytest
import torch

from mpk_runtime.models import ReferenceModel, get_weights, load_config

RAY_INIT = dict(num_cpus=2, num_gpus=2, include_dashboard=False, object_store_memory=200 * 1024 ** 2)


@pytest.fixture(scope="session")
def ref_greedy():
    cache = {}

    def run(model: str, prompt: list[int], steps: int, seed: int = 0) -> list[int]:
        if (model, seed) not in cache:
            cfg = load_config(model)
            cache[model, seed] = ReferenceModel(cfg, get_weights(model, cfg, seed=seed, dtype="float32"))
        return cache[model, seed].generate_greedy(torch.tensor([prompt]), steps)[0].tolist()
    return run


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    from mpk_runtime.engine.demo_model import save_demo_model
    return save_demo_model(str(tmp_path_factory.mktemp("demo") / "tiny-qwen3-demo"))


@pytest.fixture(scope="module")
def server(demo_dir):
    """An HTTP server (ServerThread) over one in-process replica of the demo model, and its router; one a module."""
    from cluster.router import build_router
    from cluster.server import ServerThread, create_app
    router = build_router(demo_dir, executor="inprocess", dtype="float32", max_seq_len=64, max_batch=8,
                          health_interval=None)
    srv = ServerThread(create_app(router))
    yield srv, router
    srv.stop()
    router.shutdown()


@pytest.fixture(scope="module")
def ray_local():
    """A small local Ray cluster with two logical GPUs (no CUDA needed)."""
    ray = pytest.importorskip("ray")
    from cluster.ray_utils import ensure_ray
    if ray.is_initialized():
        ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
    ensure_ray(**RAY_INIT)
    yield ray
    ray.shutdown()
