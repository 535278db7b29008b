"""The pure-torch reference forward: the independent oracle every other path is tested against.

Written plainly, op by op, in the style of the Hugging Face implementations (norms in fp32, RoPE with
rotate_half), with a contiguous per-sequence KV cache. It shares no code with the task kernels on purpose.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .weights import lm_head_name


def _yarn_inv_freq(inv: torch.Tensor, d: int, base: float, rs) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are interpolated (divided by
    the factor), those that turn more than beta_fast times are kept, a linear ramp over the dimensions between."""
    def dim_of(rotations: float) -> float:   # the dimension whose frequency turns `rotations` times in that context
        return d * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
    if rs.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, d - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp   # 1: extrapolate (the frequency as is), 0: interpolate
    return inv / rs.factor * (1 - keep) + inv * keep


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """(head_dim/2,) fp32 inverse frequencies, with Llama-3, linear or YaRN scaling when configured (YaRN's attention
    factor is in cfg.attn_scale, not here)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "yarn":
        inv = _yarn_inv_freq(inv, d, cfg.rope_theta, rs)
    elif rs is not None and rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs is not None:
        low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / rs.factor, inv)
        smooth = (rs.original_max_position_embeddings / wl - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    return inv.to(torch.float32)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@dataclass
class KVCache:
    """Contiguous cache: k[l], v[l] are (B, n_kv_heads, max_len, head_dim)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device="cpu") -> "KVCache":
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)])


class ReferenceModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights
        any_w = weights["model.embed_tokens.weight"]
        self.dtype, self.device = any_w.dtype, any_w.device
        self.inv_freq = rope_inv_freq(cfg).to(self.device)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.empty(self.cfg, batch, max_len, self.dtype, self.device)

    def _proj(self, h: torch.Tensor, name: str) -> torch.Tensor:
        """h @ W.T, plus the bias where the model has one (Qwen2's q / k / v), added to the rounded product."""
        y = h @ self.w[name + ".weight"].T
        b = self.w.get(name + ".bias")
        return y if b is None else y + b

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """tokens (B, T) int64 at positions start_pos[b] + t; returns logits (B, T, V) fp32.

        Appends the new keys/values to `cache`. Sequences may have different start positions.
        """
        cfg, w = self.cfg, self.w
        B, T = tokens.shape
        start_pos = start_pos.to(self.device).long()
        pos = start_pos[:, None] + torch.arange(T, device=self.device)[None, :]  # (B, T)
        ang = pos.float()[..., None] * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((ang, ang), dim=-1)
        cos, sin = emb.cos().to(self.dtype)[:, None], emb.sin().to(self.dtype)[:, None]  # (B, 1, T, D)
        max_len = int(pos.max()) + 1
        kpos = torch.arange(max_len, device=self.device)
        mask = kpos[None, None, :] <= pos[:, :, None]  # (B, T, S): causal, per sequence
        x = w["model.embed_tokens.weight"][tokens]  # (B, T, H)
        H, D, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        bidx = torch.arange(B, device=self.device)[:, None]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q, k, v = (self._proj(h, p + f"self_attn.{n}_proj") for n in "qkv")
            q = q.view(B, T, nh, D).transpose(1, 2)  # (B, nh, T, D)
            k = k.view(B, T, nkv, D).transpose(1, 2)
            v = v.view(B, T, nkv, D).transpose(1, 2)
            if cfg.qk_norm:
                q = rms_norm(q, w[p + "self_attn.q_norm.weight"], cfg.rms_norm_eps)
                k = rms_norm(k, w[p + "self_attn.k_norm.weight"], cfg.rms_norm_eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            # append to the cache: cache[b, :, pos[b, t]] = k[b, :, t]
            cache.k[i][bidx, :, pos] = k.transpose(1, 2)
            cache.v[i][bidx, :, pos] = v.transpose(1, 2)
            ks = cache.k[i][:, :, :max_len].repeat_interleave(cfg.group_size, dim=1)  # (B, nh, S, D)
            vs = cache.v[i][:, :, :max_len].repeat_interleave(cfg.group_size, dim=1)
            scores = (q.float() @ ks.float().transpose(-1, -2)) * cfg.attn_scale  # (B, nh, T, S)
            scores = scores.masked_fill(~mask[:, None], float("-inf"))
            attn = (F.softmax(scores, dim=-1) @ vs.float()).to(self.dtype)  # (B, nh, T, D)
            attn = attn.transpose(1, 2).reshape(B, T, nh * D)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            g = h @ w[p + "mlp.gate_proj.weight"].T
            u = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (F.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
        x = rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
        return (x @ w[lm_head_name(cfg)].T).float()

    def generate_greedy(self, prompt: torch.Tensor, steps: int) -> torch.Tensor:
        """prompt (B, T) -> (B, steps) greedy continuation (all prompts the same length)."""
        B, T = prompt.shape
        cache = self.new_cache(B, T + steps)
        logits = self.forward(prompt, torch.zeros(B, dtype=torch.long), cache)
        out = []
        tok = logits[:, -1].argmax(-1)
        for s in range(steps):
            out.append(tok)
            if s == steps - 1:
                break
            logits = self.forward(tok[:, None], torch.full((B,), T + s, dtype=torch.long), cache)
            tok = logits[:, -1].argmax(-1)
        return torch.stack(out, 1)
