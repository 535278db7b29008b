"""Model weights: Hugging Face tensor names, loaded from a local directory or made from a seed.

Weights are a flat `dict[str, Tensor]` keyed by the Hugging Face names (`model.layers.0.self_attn.q_proj.weight`,
...), so a checkpoint on disk and a seeded model look the same to every later stage. `load_weights` can read
only a slice of each tensor (tensor-parallel shards read their own rows/columns straight from safetensors).
"""
from __future__ import annotations

import json
import math
import os
from typing import Callable, Iterable

import torch

from .config import ModelConfig, ConfigError

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class WeightError(ValueError):
    """Weights are missing or do not match the config; the message names the tensor and what to do."""


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(DTYPES)}")
    return DTYPES[name]


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, with its (out, in) shape as stored by Hugging Face."""
    h, hd = cfg.hidden_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.q_dim, h)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_dim, h)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_dim, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_dim)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (cfg.q_dim,)
            shapes[p + "self_attn.k_proj.bias"] = (cfg.kv_dim,)
            shapes[p + "self_attn.v_proj.bias"] = (cfg.kv_dim,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes


def _shape_keys(name: str) -> str:
    """The config.json entries that give tensor `name`'s shape (what a shape mismatch points at)."""
    for part, keys in (("embed_tokens", "vocab_size, hidden_size"), ("lm_head", "vocab_size, hidden_size"),
                       ("q_norm", "head_dim"), ("k_norm", "head_dim"),
                       ("q_proj", "num_attention_heads, head_dim, hidden_size"),
                       ("o_proj", "num_attention_heads, head_dim, hidden_size"),
                       ("k_proj", "num_key_value_heads, head_dim, hidden_size"),
                       ("v_proj", "num_key_value_heads, head_dim, hidden_size"),
                       ("mlp.", "intermediate_size, hidden_size")):
        if part in name:
            return keys
    return "hidden_size"


def lm_head_name(cfg: ModelConfig) -> str:
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


def _generator_seed(v: int) -> int:
    """v where torch's manual_seed takes it ([-2**63, 2**64)), else its low 64 bits: any int seed works (SamplingParams
    and the engine take any int), and the seeds that fitted keep their weights."""
    return v if -(1 << 63) <= v < 1 << 64 else v & ((1 << 64) - 1)


def random_weights(cfg: ModelConfig, seed: int = 0, dtype: str | torch.dtype | None = None,
                   device: str | torch.device = "cpu", std: float = 0.02) -> dict[str, torch.Tensor]:
    """Seeded random weights. The same seed gives the same weights on every device and dtype.

    Values are drawn in fp32 per tensor by a generator on `device` (fast for 8B-class models on a GPU; the
    values then depend on the device type, but never on anything else) and cast.
    Norm weights are 1 + small noise so that tests exercise them. Linear weights use std/sqrt-ish scaling so
    activations stay O(1) through many layers and logits are not degenerate.
    """
    dt = torch_dtype(dtype or cfg.dtype)
    out: dict[str, torch.Tensor] = {}
    for k, (name, shape) in enumerate(sorted(weight_shapes(cfg).items())):
        g = torch.Generator(device=device).manual_seed(_generator_seed(seed * 1_000_003 + k))
        t = torch.randn(shape, generator=g, device=device)
        if name.endswith(".bias"):
            t = t.mul_(0.5)   # (Qwen2's q / k / v biases: O(1) against projections of O(1) rows)
        elif len(shape) == 1:
            t = t.mul_(0.1).add_(1.0)
        elif name.endswith("embed_tokens.weight"):
            t = t.mul_(std)  # small, as HF initialises it: the first RMSNorm rescales, and a tied LM head
            # then does not simply echo the input token back
        else:
            t = t.mul_(1.0 / shape[1] ** 0.5)
        out[name] = t.to(dtype=dt)
    return out


# --- local Hugging Face directories --------------------------------------------------------------------------

def _open(fn: str):
    """safe_open, with an unreadable file a WeightError that names it."""
    from safetensors import safe_open
    try:
        return safe_open(fn, framework="pt")
    except Exception as e:   # (SafetensorError: truncated / not safetensors; OSError)
        raise WeightError(f"cannot read {fn} ({e}): the file is damaged or incomplete; download it again") from e


def _weight_files(path: str) -> dict[str, str]:
    """Map tensor name -> safetensors file: model.safetensors if there is one, else model.safetensors.index.json,
    else every *.safetensors file (transformers' order for the first two)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(os.path.join(path, "model.safetensors")) and os.path.exists(index):
        try:
            with open(index) as f:
                wm = json.load(f)["weight_map"]
            if not isinstance(wm, dict):
                raise TypeError(f"weight_map is a {type(wm).__name__}")
            bad = next((k for k, v in wm.items() if not isinstance(v, str) or not v), None)
            if bad is not None:   # (a null file name was a TypeError from os.path.join)
                raise TypeError(f"weight_map gives tensor {bad} the file {wm[bad]!r}, not a file name")
        except (ValueError, KeyError, TypeError) as e:
            raise WeightError(f"{index} is not a safetensors index (a JSON object with a weight_map of tensor name -> "
                              f"file; {type(e).__name__}: {e}); download it again") from e
        out = {k: os.path.join(path, v) for k, v in wm.items()}
        absent = sorted({v for v in out.values() if not os.path.exists(v)})
        if absent:
            raise WeightError(f"{index} lists {len(absent)} shard file(s) that are not in {path}, e.g. "
                              f"{[os.path.basename(a) for a in absent[:3]]}: the download is incomplete; "
                              "download the missing shards again")
        return out
    files = ["model.safetensors"] if os.path.exists(os.path.join(path, "model.safetensors")) else \
        sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors files in {path}; download the model in safetensors format "
                          "(or use --model <preset> for seeded random weights)")
    mapping: dict[str, str] = {}
    for fn in files:
        with _open(os.path.join(path, fn)) as f:
            for k in f.keys():
                if k in mapping:
                    raise WeightError(f"tensor {k} is in both {os.path.basename(mapping[k])} and {fn} in {path}; "
                                      "remove the file that is not part of the model (or add its "
                                      "model.safetensors.index.json)")
                mapping[k] = os.path.join(path, fn)
    return mapping


def _same_tensor(files: dict[str, str], a: str, b: str) -> bool:
    """Whether tensors a and b hold the same values (read in row blocks, not whole)."""
    with _open(files[a]) as fa, _open(files[b]) as fb:
        sa, sb = fa.get_slice(a), fb.get_slice(b)
        shape = tuple(sa.get_shape())
        if shape != tuple(sb.get_shape()) or not shape:
            return False
        step = max(1, (1 << 24) // max(1, math.prod(shape[1:])))
        return all(torch.equal(sa[r:r + step].float(), sb[r:r + step].float()) for r in range(0, shape[0], step))


Slicer = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None"]


def load_weights(path: str, cfg: ModelConfig, dtype: str | torch.dtype | None = None,
                 device: str | torch.device = "cpu", slicer: Slicer | None = None,
                 names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Load the model's tensors from a local HF directory.

    `slicer(name, full_shape)` may return a tuple of slices: only that part is read from disk (safetensors
    `get_slice`), which is how tensor-parallel ranks load their shard without a full copy.
    """
    dt = torch_dtype(dtype or cfg.dtype)
    files = _weight_files(path)
    shapes = weight_shapes(cfg)
    wanted = list(names) if names is not None else list(shapes)
    if names is None:   # tensors the config does not account for: the checkpoint is not the model the config describes
        # (any layer tensor: a Qwen3 checkpoint whose config.json says llama loaded without its q / k norms and ran as
        # another function; older exports' rotary_emb.inv_freq buffers are recomputed, not weights)
        stray = sorted(n for n in files if n not in shapes and not n.endswith("rotary_emb.inv_freq") and (
            n.endswith(".bias") or n.startswith("model.layers.")))
        if stray:
            norms = "q / k norms" if cfg.qk_norm else "no q / k norms"
            raise WeightError(f"{len(stray)} tensors in {path} are not part of config {cfg.name!r}, e.g. {stray[:3]}; "
                              f"config.json says model_type {cfg.family} ({norms}), {cfg.num_layers} layers and "
                              f"{'biases in q / k / v only' if cfg.qkv_bias else 'no biases'}: fix config.json to match "
                              "the checkpoint (or the model is an architecture this runtime does not run)")
    if not cfg.tie_word_embeddings and "lm_head.weight" in wanted and "lm_head.weight" not in files and \
            "model.embed_tokens.weight" in files:
        raise WeightError(f"{path} has no lm_head.weight but config.json says tie_word_embeddings false: if the model "
                          "ties its LM head to the embedding (Llama-3.2 1B / 3B, small Qwen models), set "
                          "tie_word_embeddings to true in config.json; otherwise the checkpoint is incomplete, "
                          "download it again")
    missing = [n for n in wanted if n not in files]
    if missing:
        raise WeightError(f"{len(missing)} tensors missing from {path}, e.g. {missing[:3]}; the checkpoint does not "
                          f"match config {cfg.name!r} (is it a {cfg.family} model with {cfg.num_layers} layers?)")
    emb = "model.embed_tokens.weight"
    if cfg.tie_word_embeddings and "lm_head.weight" in files and emb in wanted and not _same_tensor(files, emb,
                                                                                                "lm_head.weight"):
        # (transformers 5 then keeps the checkpoint's lm_head; older versions tied it to the embedding)
        raise WeightError(f"config.json says tie_word_embeddings true but {path} holds an lm_head.weight that differs "
                          "from model.embed_tokens.weight: set tie_word_embeddings to false in config.json if the "
                          "model has its own LM head, or delete lm_head.weight from the checkpoint")
    by_file: dict[str, list[str]] = {}
    for n in wanted:
        by_file.setdefault(files[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for fn, ns in by_file.items():
        with _open(fn) as f:
            held = set(f.keys())
            for n in ns:
                if n not in held:
                    raise WeightError(f"the index of {path} puts tensor {n} in {os.path.basename(fn)}, which does not "
                                      "hold it: the index does not match its shards; download both again")
                sl = f.get_slice(n)
                if sl.get_dtype() not in ("F32", "F16", "BF16", "F64"):
                    raise WeightError(f"tensor {n} in {fn} has dtype {sl.get_dtype()}; expected a float tensor "
                                      "(F32 / F16 / BF16): quantized or integer checkpoints are not supported")
                shape = tuple(sl.get_shape())
                if shape != shapes[n]:
                    raise WeightError(f"tensor {n} in {fn} has shape {shape}, config {cfg.name!r} expects {shapes[n]} "
                                      f"(from config.json's {_shape_keys(n)}): config.json does not describe this "
                                      "checkpoint; use the config.json published with it")
                idx = slicer(n, shape) if slicer else None
                t = sl[idx] if idx is not None else sl[:]
                out[n] = t.to(dtype=dt, device=device).contiguous()
    return out


def save_weights(path: str, cfg: ModelConfig, weights: dict[str, torch.Tensor], shard_bytes: int | None = None) -> None:
    """Write a Hugging Face format directory (config.json + safetensors, sharded with an index if asked)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_config(), f, indent=2)
    tensors = {k: v.contiguous().cpu() for k, v in weights.items()}
    if shard_bytes is None:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k in sorted(tensors):
        nb = tensors[k].numel() * tensors[k].element_size()
        if size and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += nb
    weight_map = {}
    for i, sh in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, os.path.join(path, fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in sh})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def get_weights(model: str, cfg: ModelConfig, seed: int = 0, dtype=None, device="cpu", slicer: Slicer | None = None):
    """Weights for `model`: a directory is loaded; a preset name gets seeded random weights."""
    if os.path.isdir(model):
        return load_weights(model, cfg, dtype=dtype, device=device, slicer=slicer)
    w = random_weights(cfg, seed=seed, dtype=dtype, device=device)
    if slicer is not None:
        for n, t in list(w.items()):
            idx = slicer(n, tuple(t.shape))
            if idx is not None:
                w[n] = t[idx].contiguous()
    return w


# projections that read the same input: stored back to back, one matmul can compute them all (conventional path)
ADJACENT_GROUPS = (("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
                   ("mlp.gate_proj.weight", "mlp.up_proj.weight"))


def pack_adjacent(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Make each layer's q/k/v and gate/up weights (out x in, row-major) consecutive row blocks of one buffer, in
    place in `weights` (the names become views: same shapes and values, a contiguous block each, so the
    megakernel reads them as before). One layer's group is copied at a time (peak memory: + one group)."""
    for layer in range(cfg.num_layers):
        for group in ADJACENT_GROUPS:
            names = [f"model.layers.{layer}.{g}" for g in group]
            if not all(n in weights for n in names):
                continue
            ts = [weights[n] for n in names]
            K = ts[0].shape[1]
            if any(t.dim() != 2 or t.shape[1] != K or t.dtype != ts[0].dtype or t.device != ts[0].device for t in ts):
                continue
            if adjacent_rows(ts) is not None:
                continue
            buf = torch.empty(sum(t.shape[0] for t in ts), K, dtype=ts[0].dtype, device=ts[0].device)
            r = 0
            for n, t in zip(names, ts):
                buf[r:r + t.shape[0]].copy_(t)
                weights[n] = buf[r:r + t.shape[0]]
                r += t.shape[0]
            del ts
    return weights


def adjacent_rows(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """The (sum of rows, K) view covering `ts` when they are contiguous row blocks laid back to back in one
    storage (what pack_adjacent makes), else None."""
    t0 = ts[0]
    if not all(t.dim() == 2 and t.is_contiguous() and t.shape[1] == t0.shape[1] and t.dtype == t0.dtype for t in ts):
        return None
    if any(t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() for t in ts):
        return None
    off = t0.storage_offset()
    for t in ts:
        if t.storage_offset() != off:
            return None
        off += t.numel()
    return t0.as_strided((sum(t.shape[0] for t in ts), t0.shape[1]), (t0.shape[1], 1), t0.storage_offset())
