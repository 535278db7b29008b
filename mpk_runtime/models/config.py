"""Model configurations for the Llama-3.x (and Mistral), Qwen2 / Qwen2.5 and Qwen3 dense families.

A `ModelConfig` is a small frozen dataclass: everything later stages need to know about the network's shape.
Presets are registered by name (`ModelConfig.from_name("qwen3-8b")`); any sane config of the two families works,
including ones read from a Hugging Face `config.json` (`ModelConfig.from_hf_config`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

FAMILIES = ("llama", "qwen2", "qwen3")
# the Hugging Face class of each family (config.json "architectures"; model_type is the family's name)
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class ConfigError(ValueError):
    """A model configuration is invalid or unknown; the message says what to change."""


ROPE_TYPES = ("llama3", "yarn", "linear")
# transformers' max_position_embeddings when config.json has none (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)
HF_DEFAULT_MAX_POS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
# transformers' other defaults for entries config.json may leave out: Qwen3Config's head_dim (Qwen3 heads are not
# hidden_size / num_attention_heads wide: qwen3-0.6b has 16 heads of 128 over 1024), and the Qwen configs' sliding
# window and first sliding layer where use_sliding_window is set, and MistralConfig's window (4096, every layer) where
# a Mistral config.json has no sliding_window entry (null: no window).
HF_DEFAULT_HEAD_DIM = {"qwen3": 128}
HF_DEFAULT_WINDOW = 4096
HF_DEFAULT_MAX_WINDOW_LAYERS = 28


def _num(v: Any, key: str, kind: type = float) -> Any:
    """A config.json number as `kind` (int or float), or a ConfigError naming the entry."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (kind is int and v != int(v)):
        raise ConfigError(f"config.json entry {key!r} must be {'an integer' if kind is int else 'a number'}, "
                          f"got {v!r}; fix it in config.json")
    return kind(v)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling: Llama-3's frequency-dependent scaling (rope_type "llama3": factor, low / high_freq_factor,
    original_max_position_embeddings), linear position interpolation ("linear": every frequency divided by factor) or
    YaRN ("yarn", Qwen3's long-context setting: factor, the original context,
    beta_fast / beta_slow bound the ramp between extrapolated and interpolated frequencies, and q / k are scaled by
    attention_factor(), which the attention takes as its softmax scale times attention_factor()^2; models/reference.py
    rope_inv_freq computes the frequencies)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_attention_factor: float | None = None   # None: from factor (and mscale / mscale_all_dim), as transformers
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope type {self.rope_type!r} is not supported ({' or '.join(ROPE_TYPES)})")
        if not self.factor > 0 or self.original_max_position_embeddings <= 0:
            raise ConfigError(f"rope scaling needs factor > 0 and original_max_position_embeddings > 0, got "
                              f"{self.factor} / {self.original_max_position_embeddings}")

    def attention_factor(self) -> float:
        """What q and k are multiplied by after RoPE (YaRN's "attention factor"; 1 for llama3)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.yarn_attention_factor is not None:
            return float(self.yarn_attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def hf_dict(self) -> dict:
        """The config.json entry (transformers' keys for this rope type)."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        if self.rope_type == "llama3":
            return {"rope_type": "llama3", "factor": self.factor, "low_freq_factor": self.low_freq_factor,
                    "high_freq_factor": self.high_freq_factor,
                    "original_max_position_embeddings": self.original_max_position_embeddings}
        d = {"rope_type": "yarn", "factor": self.factor, "beta_fast": self.beta_fast, "beta_slow": self.beta_slow,
             "original_max_position_embeddings": self.original_max_position_embeddings, "truncate": self.truncate}
        for k, v in (("attention_factor", self.yarn_attention_factor), ("mscale", self.mscale),
                     ("mscale_all_dim", self.mscale_all_dim)):
            if v is not None:
                d[k] = v
        return d


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        problems = []
        if self.family not in FAMILIES:
            problems.append(f"family {self.family!r} is not one of {FAMILIES}")
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "max_position_embeddings"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                problems.append(f"{f} must be a positive int, got {v!r}")
        if not problems:
            if self.num_heads % self.num_kv_heads:
                problems.append(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
            if self.head_dim % 2:
                problems.append(f"head_dim ({self.head_dim}) must be even for RoPE")
        # (a base <= 0 makes RoPE's frequencies inf / NaN, and requests fail later as "NaN logits"; 1 makes them all
        # equal and YaRN divide by log(base))
        th, eps = self.rope_theta, self.rms_norm_eps
        if isinstance(th, bool) or not isinstance(th, (int, float)) or not 1 < th < math.inf:
            problems.append(f"rope_theta (the RoPE base) must be a finite number > 1, got {th!r}")
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
            problems.append(f"rms_norm_eps must be a finite number >= 0, got {eps!r}")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            problems.append(f"dtype {self.dtype!r} must be bfloat16, float16 or float32")
        if problems:
            raise ConfigError(f"invalid ModelConfig {self.name!r}: " + "; ".join(problems))

    # --- derived quantities -------------------------------------------------------------------------------
    @property
    def qk_norm(self) -> bool:
        """Qwen3 normalises each q and k head with its own RMSNorm before RoPE."""
        return self.family == "qwen3"

    @property
    def qkv_bias(self) -> bool:
        """Qwen2 / Qwen2.5 add a bias to the q, k and v projections (before RoPE); no other projection has one."""
        return self.family == "qwen2"

    @property
    def attn_scale(self) -> float:
        """The attention's softmax scale: head_dim^-1/2, times YaRN's attention factor squared (the factor that
        transformers multiplies q and k by after RoPE, taken in the scores instead: the cache holds k unscaled)."""
        af = self.rope_scaling.attention_factor() if self.rope_scaling is not None else 1.0
        return self.head_dim ** -0.5 * af * af

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h + 3 * h * i + 2 * h
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.qkv_bias:
            per_layer += self.q_dim + 2 * self.kv_dim
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # --- (de)serialisation --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        rs = d.get("rope_scaling")
        if rs is not None and not isinstance(rs, RopeScaling):
            d["rope_scaling"] = RopeScaling(**rs)
        return cls(**d)

    @classmethod
    def from_name(cls, name: str) -> "ModelConfig":
        key = name.lower()
        if key not in PRESETS:
            import difflib
            near = difflib.get_close_matches(key, PRESETS, n=1, cutoff=0.8)
            raise ConfigError(f"unknown model {name!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
                              + f"; known presets: {', '.join(sorted(PRESETS))}. "
                              "Or pass a local Hugging Face model directory (with config.json).")
        return PRESETS[key]

    @classmethod
    def from_hf_config(cls, hf: dict, name: str | None = None) -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict of a LlamaForCausalLM, MistralForCausalLM (the Llama
        architecture: family "llama"), Qwen2ForCausalLM (Qwen2 / Qwen2.5: q / k / v biases) or Qwen3ForCausalLM."""
        model_type = hf.get("model_type", "")
        if model_type in ("llama", "mistral"):
            family = "llama"
        elif model_type in ("qwen2", "qwen3"):
            family = model_type
        else:
            raise ConfigError(f"model_type {model_type!r} is not supported; supported: 'llama' (Llama-3.x), "
                              "'mistral' (Mistral dense, the Llama architecture), 'qwen2' (Qwen2 / Qwen2.5 dense), "
                              "'qwen3' (Qwen3 dense)")
        q = hf.get("quantization_config")
        if q:
            method = q.get("quant_method", "?") if isinstance(q, dict) else q
            raise ConfigError(f"quantized checkpoints (quantization_config, quant_method {method!r}) are not "
                              "supported: use the model's bf16 / fp16 release")
        if hf.get("mlp_bias") or (family != "qwen2" and hf.get("attention_bias")):
            # (a Llama attention_bias also biases o_proj; Qwen2's q / k / v biases are its architecture, no flag)
            raise ConfigError(f"{'mlp_bias' if hf.get('mlp_bias') else 'attention_bias'} is set in this {model_type} "
                              "config: biases in the o_proj / MLP projections are not supported (only Qwen2's q / k / "
                              "v biases, model_type 'qwen2')")
        n_layers = hf["num_hidden_layers"]
        n_layers = n_layers if isinstance(n_layers, int) else 0   # (not an int: __post_init__ names num_layers)
        qwen_sliding = family in ("qwen2", "qwen3") and bool(hf.get("use_sliding_window"))
        window = hf["sliding_window"] if "sliding_window" in hf else \
            HF_DEFAULT_WINDOW if qwen_sliding or model_type == "mistral" else None   # (MistralConfig's default)
        other = []
        layer_types = hf.get("layer_types")
        if layer_types is not None and not isinstance(layer_types, list):
            raise ConfigError(f"config.json entry 'layer_types' must be a list of per-layer kinds "
                              f"(\"full_attention\", ...), got {layer_types!r}; fix it in config.json")
        if layer_types:       # transformers >= 4.53 writes the per-layer kinds
            sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
            other = sorted({str(t) for t in layer_types if t not in ("full_attention", "sliding_attention")})
        elif qwen_sliding and window:   # Qwen: layers >= max_window_layers slide
            first = _num(hf.get("max_window_layers", HF_DEFAULT_MAX_WINDOW_LAYERS), "max_window_layers", int)
            sliding = list(range(first, n_layers))
        elif model_type == "mistral" and window:      # Mistral (v0.1): every layer slides
            sliding = list(range(n_layers))
        else:
            sliding = []
        if other:
            raise ConfigError(f"layer kinds {other} are not supported: this runtime runs full attention in every layer")
        max_pos = _num(hf.get("max_position_embeddings", HF_DEFAULT_MAX_POS[model_type]), "max_position_embeddings",
                       int)
        if window is not None:
            window = _num(window, "sliding_window", int)
        if sliding and not window:
            raise ConfigError(f"layers {sliding[:4]}{'...' if len(sliding) > 4 else ''} use sliding-window attention "
                              "but the config has no sliding_window size; add it or fix layer_types")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):   # (transformers' ACT2FN: "swish" is SiLU too)
            raise ConfigError(f"hidden_act {act!r} is not supported (only silu / SwiGLU)")
        num_heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
        head_dim = hf.get("head_dim") or HF_DEFAULT_HEAD_DIM.get(model_type) or (
            hidden // num_heads if isinstance(hidden, int) and isinstance(num_heads, int) and num_heads > 0
            else 0)   # (0: __post_init__ names num_heads / hidden_size)
        rope_scaling = None
        rs = hf.get("rope_scaling") or hf.get("rope_parameters")
        rope_theta = hf.get("rope_theta")
        if rs is not None and not isinstance(rs, dict):
            raise ConfigError(f"rope_scaling must be an object ({{\"rope_type\": ..., \"factor\": ...}}) or null, got "
                              f"{rs!r}; fix it in config.json")
        if isinstance(rs, dict):
            rope_theta = rs.get("rope_theta", rope_theta)
            rtype = rs.get("rope_type", rs.get("type", "default"))

            def rnum(k: str, kind: type = float) -> Any:
                """rope_scaling[k], a number; absent, a ConfigError naming it there (a KeyError of k read as a
                top-level entry before)."""
                if k not in rs:
                    raise ConfigError(f"rope_scaling of rope_type {rtype!r} has no {k!r} entry, which that type needs; "
                                      "add it to rope_scaling in config.json (see the model's published config.json)")
                return _num(rs[k], f"rope_scaling.{k}", kind)
            if rtype == "llama3":
                rope_scaling = RopeScaling(
                    factor=rnum("factor"), low_freq_factor=rnum("low_freq_factor"),
                    high_freq_factor=rnum("high_freq_factor"),
                    original_max_position_embeddings=rnum("original_max_position_embeddings", int))
            elif rtype == "yarn":   # transformers' defaults: the original context = max_position_embeddings,
                orig = _num(rs.get("original_max_position_embeddings") or max_pos,       # factor = their ratio
                            "rope_scaling.original_max_position_embeddings", int)
                opt = lambda k: None if rs.get(k) is None else rnum(k)  # noqa: E731
                rope_scaling = RopeScaling(
                    factor=opt("factor") or max_pos / orig, original_max_position_embeddings=orig,
                    rope_type="yarn", beta_fast=opt("beta_fast") or 32.0, beta_slow=opt("beta_slow") or 1.0,
                    yarn_attention_factor=opt("attention_factor"), mscale=opt("mscale"),
                    mscale_all_dim=opt("mscale_all_dim"), truncate=bool(rs.get("truncate", True)))
                # Qwen3's YaRN setting keeps max_position_embeddings at the original 32768 and extends the context
                # to factor x that (the model card's 131072): served up to there
                ext = int(rope_scaling.factor * orig)
                if ext > max_pos:
                    log.info("%s: YaRN x%g over %d positions: context up to %d (max_position_embeddings %d)",
                             model_type, rope_scaling.factor, orig, ext, max_pos)
                    max_pos = ext
            elif rtype == "linear":
                rope_scaling = RopeScaling(factor=rnum("factor"), rope_type="linear")
            elif rtype not in ("default", None):
                raise ConfigError(f"rope type {rtype!r} is not supported (default, llama3, yarn or linear)")
        if sliding and int(window) < max_pos:   # (after the rope scaling, which may extend max_pos)
            # A sliding layer attends to the `window` keys up to each position, which is every key while the context
            # stays within the window: served with a context of at most the window, full attention is exact there.
            log.warning("%s: sliding-window attention (%d tokens) in %d of %d layers; served with a context of at most "
                        "%d tokens (max_position_embeddings %d -> %d), where full attention is exact", model_type,
                        int(window), len(sliding), n_layers, int(window), max_pos, int(window))
            max_pos = int(window)
        dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16").replace("torch.", "")
        if dtype == "float64":   # (its F64 tensors are cast as they load)
            dtype = "float32"
        tie = hf.get("tie_word_embeddings")
        if tie is not None and not isinstance(tie, bool):
            raise ConfigError(f"config.json entry 'tie_word_embeddings' must be true or false, got {tie!r}")
        num_kv_heads = hf.get("num_key_value_heads")
        return cls(
            name=name or hf.get("_name_or_path") or model_type,
            family=family,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_num(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            rope_theta=_num(rope_theta if rope_theta is not None else 10000.0, "rope_theta"),
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(tie),
            dtype=dtype,
        )

    def to_hf_config(self) -> dict:
        """The equivalent Hugging Face config.json (used to save seeded models and to build HF references)."""
        d = {
            "architectures": [HF_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": self.dtype,
        }
        if self.family == "qwen2":   # (its q / k / v biases are the architecture; no sliding window)
            del d["attention_bias"]
            d["use_sliding_window"] = False
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.hf_dict()
        return d


def load_config(name_or_path: str) -> ModelConfig:
    """A preset name or a local Hugging Face model directory."""
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"{name_or_path} is a directory but has no config.json; point at a Hugging Face "
                              "format model directory or use a preset name")
        try:
            with open(path) as f:
                hf = json.load(f)
        except ValueError as e:
            raise ConfigError(f"{path} is not valid JSON ({e}); re-download it or fix it by hand") from e
        if not isinstance(hf, dict):
            raise ConfigError(f"{path} must hold a JSON object (a Hugging Face config), got {type(hf).__name__}")
        try:
            return ModelConfig.from_hf_config(hf, name=os.path.basename(os.path.normpath(name_or_path)))
        except KeyError as e:
            raise ConfigError(f"{path} has no {e.args[0]!r} entry, which a Llama / Qwen3 config needs; "
                              "re-download config.json or add it") from e
    if os.path.isfile(name_or_path):
        raise ConfigError(f"{name_or_path} is a file; pass the model directory that holds it (config.json and the "
                          "*.safetensors)")
    if name_or_path.lower() not in PRESETS and ("/" in name_or_path or os.sep in name_or_path):
        raise ConfigError(f"no such directory {name_or_path!r} (and no preset of that name). Hugging Face Hub ids are "
                          "not downloaded: fetch one first (huggingface-cli download <repo> --local-dir DIR) and pass "
                          f"DIR, or use a preset: {', '.join(sorted(PRESETS))}")
    return ModelConfig.from_name(name_or_path)


_L3 = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
_L32 = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _llama(name, h, i, L, nh, nkv, hd, tie, rs, vocab=128256, maxpos=131072) -> ModelConfig:
    return ModelConfig(name=name, family="llama", vocab_size=vocab, hidden_size=h, intermediate_size=i,
                       num_layers=L, num_heads=nh, num_kv_heads=nkv, head_dim=hd, rms_norm_eps=1e-5,
                       rope_theta=500000.0, rope_scaling=rs, max_position_embeddings=maxpos, tie_word_embeddings=tie)


def _qwen3(name, h, i, L, nh, nkv, tie, vocab=151936, maxpos=40960) -> ModelConfig:
    return ModelConfig(name=name, family="qwen3", vocab_size=vocab, hidden_size=h, intermediate_size=i,
                       num_layers=L, num_heads=nh, num_kv_heads=nkv, head_dim=128, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=maxpos,
                       tie_word_embeddings=tie)


def _qwen2(name, h, i, L, nh, nkv, tie, vocab=151936, maxpos=32768) -> ModelConfig:
    return ModelConfig(name=name, family="qwen2", vocab_size=vocab, hidden_size=h, intermediate_size=i,
                       num_layers=L, num_heads=nh, num_kv_heads=nkv, head_dim=h // nh, rms_norm_eps=1e-6,
                       rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=maxpos,
                       tie_word_embeddings=tie)


PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _llama("llama-3.2-1b", 2048, 8192, 16, 32, 8, 64, True, _L32),
    _llama("llama-3.2-3b", 3072, 8192, 28, 24, 8, 128, True, _L32),
    _llama("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128, False, _L3),
    _llama("llama-3.1-70b", 8192, 28672, 80, 64, 8, 128, False, _L3),
    _qwen3("qwen3-0.6b", 1024, 3072, 28, 16, 8, True),
    _qwen3("qwen3-1.7b", 2048, 6144, 28, 16, 8, True),
    _qwen3("qwen3-4b", 2560, 9728, 36, 32, 8, True),
    _qwen3("qwen3-8b", 4096, 12288, 36, 32, 8, False),
    _qwen3("qwen3-14b", 5120, 17408, 40, 40, 8, False),
    _qwen3("qwen3-32b", 5120, 25600, 64, 64, 8, False),
    # Qwen2.5 (Qwen2's architecture): GQA groups of 7 (0.5b / 7b) and 6 (1.5b)
    _qwen2("qwen2.5-0.5b", 896, 4864, 24, 14, 2, True),
    _qwen2("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, True),
    _qwen2("qwen2.5-7b", 3584, 18944, 28, 28, 4, False, vocab=152064),
    # Tiny configs for tests and the demo: same code paths, seconds on a CPU.
    ModelConfig(name="tiny-llama", family="llama", vocab_size=512, hidden_size=128, intermediate_size=352,
                num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=64),
                max_position_embeddings=1024, tie_word_embeddings=True),
    ModelConfig(name="tiny-qwen3", family="qwen3", vocab_size=640, hidden_size=96, intermediate_size=256,
                num_layers=3, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
                max_position_embeddings=1024, tie_word_embeddings=False),
    # llama-3.2-1b's attention shape (32 q heads over 8 KV heads of 64) at test size, with room for long contexts:
    # attention tasks of up to 8 KV groups (tasks/tiling.py attn_g) and page tables past ATT_MAX_PAGES entries
    ModelConfig(name="tiny-llama-g8", family="llama", vocab_size=512, hidden_size=256, intermediate_size=512,
                num_layers=2, num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
                rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=True),
    # Qwen2's q / k / v biases, with a GQA group of 3 (not a power of two, as Qwen2.5's 7 and 6)
    ModelConfig(name="tiny-qwen2", family="qwen2", vocab_size=576, hidden_size=192, intermediate_size=320,
                num_layers=2, num_heads=6, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
                max_position_embeddings=1024, tie_word_embeddings=True),
    # an MLP reduction as long as llama-3.1-8b's (K = 16384 > 14336): from batch 3 its down projection's input rows
    # fit a CTA's shared memory only in chunks (codegen/layout.py linear_tile), the path those models take
    ModelConfig(name="tiny-llama-k16k", family="llama", vocab_size=512, hidden_size=128, intermediate_size=16384,
                num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=500000.0,
                max_position_embeddings=1024, tie_word_embeddings=True),
    # qwen3-8b's head dim (128) and GQA group (4) at test size: the code paths of 128-wide heads (the megakernel's
    # narrow attention passes for them, tasks/tiling.py attn_wide)
    ModelConfig(name="tiny-qwen3-d128", family="qwen3", vocab_size=640, hidden_size=256, intermediate_size=512,
                num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                max_position_embeddings=1024, tie_word_embeddings=False),
]}
