"""A complete tiny model directory (config, seeded weights, a toy byte-level BPE tokenizer with a chat
template) for demos, docs and tests of the text paths; real models come from Hugging Face directories."""
from __future__ import annotations

import os

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = ["hello world, the quick brown fox jumps over the lazy dog. " * 4,
           "a b c d e f g h i j k l m n o p q r s t u v w x y z 0 1 2 3 4 5 6 7 8 9",
           "The capital of France is Paris. Once upon a time there was a small model."]


def save_demo_model(path: str, preset: str = "tiny-qwen3", seed: int = 0, dtype: str = "float32",
                    chat_template: bool = True) -> str:
    """Write `path` (created) and return it. The tokenizer's vocabulary is smaller than the model's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ..models import ModelConfig, random_weights, save_weights

    cfg = ModelConfig.from_name(preset).replace(dtype=dtype)
    save_weights(path, cfg, random_weights(cfg, seed=seed, dtype=dtype))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(400, cfg.vocab_size), show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    os.makedirs(path, exist_ok=True)
    return path
