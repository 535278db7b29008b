"""Tensor-parallel sharding: which heads, rows and columns rank r of a TP group owns.

A pass over a finished config (gpt-fast `apply_tp` style): the model knows nothing about ranks.
q heads, the MLP's intermediate dimension and the vocabulary split evenly (the vocabulary may be uneven);
KV heads split when there are at least as many as ranks, and are replicated otherwise (GQA with fewer KV
heads than ranks: rank r keeps KV head r // (tp / n_kv), which serves exactly its q heads).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..models.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class Shard:
    tp: int
    rank: int
    q_heads: tuple[int, int]      # [lo, hi) global q head range
    kv_heads: tuple[int, int]     # [lo, hi) global kv head range
    inter: tuple[int, int]        # [lo, hi) of the MLP intermediate dimension
    vocab: tuple[int, int]        # [lo, hi) of the vocabulary (LM head rows)

    @property
    def n_q(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def n_inter(self) -> int:
        return self.inter[1] - self.inter[0]

    @property
    def n_vocab(self) -> int:
        return self.vocab[1] - self.vocab[0]


def _tp_problems(cfg: ModelConfig, tp: int) -> list[str]:
    probs = []
    if cfg.num_heads % tp:
        probs.append(f"num_heads={cfg.num_heads} is not divisible by tp={tp}")
    if cfg.num_kv_heads >= tp and cfg.num_kv_heads % tp:
        probs.append(f"num_kv_heads={cfg.num_kv_heads} is not divisible by tp={tp}")
    if cfg.num_kv_heads < tp and tp % cfg.num_kv_heads:
        probs.append(f"tp={tp} is not a multiple of num_kv_heads={cfg.num_kv_heads} (needed to replicate KV heads)")
    if cfg.intermediate_size % tp:
        probs.append(f"intermediate_size={cfg.intermediate_size} is not divisible by tp={tp}")
    vper = -(-cfg.vocab_size // tp)   # shard_for's split: ceil(V / tp) rows a rank, the last ranks get the rest
    if vper * (tp - 1) >= cfg.vocab_size:
        probs.append(f"vocab_size={cfg.vocab_size} split in blocks of {vper} leaves rank {tp - 1} no LM head rows")
    return probs


def valid_tps(cfg: ModelConfig) -> list[int]:
    """Every TP degree check_tp accepts for `cfg` (divisors of num_heads: each rank needs whole q heads)."""
    return [t for t in range(1, cfg.num_heads + 1) if cfg.num_heads % t == 0 and not _tp_problems(cfg, t)]


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """Refuse a TP degree that cannot split `cfg` evenly, naming each dimension that does not divide and the degrees
    that would (a user asking for tp=3 learns what to ask for instead)."""
    if isinstance(tp, bool) or not isinstance(tp, numbers.Integral) or tp < 1:
        # (a float 2.0 passed the divisibility checks and made the shards' ranges floats: build_graph's range() and
        # weight slicing then failed far from the cause)
        raise ConfigError(f"tp must be an integer >= 1, got {tp!r}")
    probs = _tp_problems(cfg, tp)
    if probs:
        raise ConfigError(f"model {cfg.name!r} cannot be split {tp} ways: " + "; ".join(probs) +
                          ". Choose a tp that divides the head counts and the MLP width (and leaves every rank "
                          f"vocabulary rows): valid tp for this model: {', '.join(map(str, valid_tps(cfg)))}.")


def shard_for(cfg: ModelConfig, tp: int, rank: int) -> Shard:
    check_tp(cfg, tp)
    if not 0 <= rank < tp:
        raise ConfigError(f"rank {rank} out of range for tp={tp}")
    nq = cfg.num_heads // tp
    if cfg.num_kv_heads >= tp:
        nkv = cfg.num_kv_heads // tp
        kv = (rank * nkv, (rank + 1) * nkv)
    else:
        g = rank // (tp // cfg.num_kv_heads)
        kv = (g, g + 1)
    ni = cfg.intermediate_size // tp
    vper = -(-cfg.vocab_size // tp)
    vocab = (min(rank * vper, cfg.vocab_size), min((rank + 1) * vper, cfg.vocab_size))
    return Shard(tp, rank, (rank * nq, (rank + 1) * nq), kv, (rank * ni, (rank + 1) * ni), vocab)


def weight_slice(cfg: ModelConfig, shard: Shard, name: str, shape: tuple[int, ...]):
    """The slice of HF tensor `name` that `shard` holds, or None for a replicated tensor (a weights.Slicer)."""
    if shard.tp == 1:
        return None
    D = cfg.head_dim
    rest = (slice(None),) * (len(shape) - 1)   # (Qwen2's q / k / v biases: the heads' rows of a vector)
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return (slice(shard.q_heads[0] * D, shard.q_heads[1] * D),) + rest
    if name.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
        return (slice(shard.kv_heads[0] * D, shard.kv_heads[1] * D),) + rest
    if name.endswith("o_proj.weight"):
        return (slice(None), slice(shard.q_heads[0] * D, shard.q_heads[1] * D))
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return (slice(*shard.inter), slice(None))
    if name.endswith("down_proj.weight"):
        return (slice(None), slice(*shard.inter))
    if name == "lm_head.weight":
        return (slice(*shard.vocab), slice(None))
    return None  # embeddings (gathered, replicated), norms
