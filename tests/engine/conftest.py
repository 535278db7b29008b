import pytest
import torch

from mpk_runtime.models import ReferenceModel, get_weights, load_config


@pytest.fixture(scope="session")
def ref_models():
    cache = {}

    def get(model: str, seed: int = 0) -> ReferenceModel:
        if (model, seed) not in cache:
            cfg = load_config(model)
            cache[model, seed] = ReferenceModel(cfg, get_weights(model, cfg, seed=seed, dtype="float32"))
        return cache[model, seed]
    return get


@pytest.fixture(scope="session")
def ref_greedy(ref_models):
    """Independent oracle: ReferenceModel.generate_greedy on one prompt alone."""
    def run(model: str, prompt: list[int], steps: int, seed: int = 0) -> list[int]:
        return ref_models(model, seed).generate_greedy(torch.tensor([prompt]), steps)[0].tolist()
    return run


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    from mpk_runtime.engine.demo_model import save_demo_model
    return save_demo_model(str(tmp_path_factory.mktemp("demo") / "tiny-qwen3-demo"))
