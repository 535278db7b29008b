"""A model's own sampling defaults: the generation_config.json of a Hugging Face model directory.

Model makers ship their recommended sampling there (Qwen3: temperature 0.6, top_p 0.95, top_k 20; Llama-3.x
Instruct: temperature 0.6, top_p 0.9). vLLM (`generation_config="auto"`, its default) takes them as the defaults of
a request that leaves those fields out: `LLM.generate(prompts)` with no SamplingParams, and an OpenAI request body
without temperature / top_p / .... So does this runtime (LLM, the HTTP server, batch jobs), so that a ported
application gets the answers it got there. Only the fields below are read, and a value equal to Hugging Face's own
default is not one the model set (as transformers' GenerationConfig.to_diff_dict, which vLLM reads, drops it: a
file's "top_k": 50 is HF's default, not a recommendation). `do_sample` is not read (vLLM does not either).

generation_config: "auto" (the model directory's file, when there is one), "vllm" (none: SamplingParams' own
defaults, vLLM's name for that), or the path of a directory holding a generation_config.json.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

from .errors import InvalidRequestError

log = logging.getLogger(__name__)

FILE = "generation_config.json"
# (HF name, its default in transformers.GenerationConfig, our SamplingParams field)
_KEYS = (("temperature", 1.0, "temperature"), ("top_k", 50, "top_k"), ("top_p", 1.0, "top_p"),
         ("min_p", None, "min_p"), ("repetition_penalty", 1.0, "repetition_penalty"),
         ("max_new_tokens", None, "max_tokens"))
SAMPLING_DEFAULT_FIELDS = tuple(ours for _, _, ours in _KEYS)
MODES = ("auto", "vllm")


def sampling_defaults(model: Any, generation_config: str | os.PathLike | None = "auto") -> dict[str, Any]:
    """{SamplingParams field: value} that a request leaving the field out takes (empty where the model sets none:
    a preset, a directory without the file, generation_config="vllm"). InvalidRequestError for an unknown mode, a
    path that holds no generation_config.json, or a file that is not JSON or sets a value SamplingParams refuses
    (naming the file, and generation_config="vllm" as the way round)."""
    if generation_config is None or generation_config == "vllm":
        return {}
    if isinstance(generation_config, os.PathLike):
        generation_config = os.fspath(generation_config)
    if not isinstance(generation_config, str):
        raise InvalidRequestError(f"generation_config must be 'auto', 'vllm' or a directory holding {FILE}, got "
                                  f"{generation_config!r}")
    if generation_config == "auto":
        if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
            return {}   # (a preset: random weights, no maker's recommendation)
        path = os.path.join(os.fspath(model), FILE)
        if not os.path.exists(path):
            return {}
    else:
        path = os.path.join(generation_config, FILE)
        if not os.path.isfile(path):
            raise InvalidRequestError(f"generation_config={generation_config!r}: no {FILE} there; give 'auto' (the "
                                      f"model directory's), 'vllm' (none) or a directory that holds one")
    way_round = "fix it, or pass generation_config='vllm' (--generation-config vllm) to use none"
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidRequestError(f"{path}: cannot read it as JSON ({e}); {way_round}") from None
    if not isinstance(cfg, dict):
        raise InvalidRequestError(f"{path}: not a JSON object; {way_round}")
    out = {}
    for hf, hf_default, ours in _KEYS:
        v = cfg.get(hf)
        if v is None or (v == hf_default and not isinstance(v, bool)):
            continue
        out[ours] = v
    if out:
        from .sampling import SamplingParams
        try:
            SamplingParams(**out)
        except InvalidRequestError as e:
            raise InvalidRequestError(f"{path}: {e}; {way_round}") from None
    return out


def log_defaults(defaults: dict[str, Any], where: str) -> None:
    if defaults:
        log.info("%s: requests that leave them out take the model's generation_config.json sampling defaults %s "
                 "(as vLLM does; generation_config='vllm' / --generation-config vllm for none)", where, defaults)
