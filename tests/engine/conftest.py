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


@pytest.fixture(scope="session")
def wordlevel():
    """make(vocab_extra=...): a Metaspace WordLevel tokenizer (not BPE: transformers applies its space cleanup, " ." ->
    ".", " 's" -> "'s", when asked, as non-BPE tokenizers with clean_up_tokenization_spaces do)."""
    pytest.importorskip("tokenizers")

    def make(vocab_extra=(".", ",", "!", "?", "'", "n't", "'m", "'s", "'ve", "'re")):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        words = ["<unk>", "</s>", "\u2581"] + ["\u2581" + w for w in "abcdefghijk"] + list(vocab_extra) + \
            ["\u2581" + w for w in vocab_extra]
        t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        t.pre_tokenizer = pre_tokenizers.Metaspace()
        t.decoder = decoders.Metaspace()
        tok = PreTrainedTokenizerFast(tokenizer_object=t, eos_token="</s>", unk_token="<unk>")
        tok.clean_up_tokenization_spaces = True
        return tok
    return make
