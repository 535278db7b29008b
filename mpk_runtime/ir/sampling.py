"""On-device sampling: the contract shared by the megakernel (device_kernels/ops/argmax.cuh), the CPU task
semantics (tasks/ops/argmax.py, used by pyvm and the conventional executor) and the engine.

The `argmax` op of every graph is a sampler. Per sequence row b the runner fills four io tensors each step:

    sample.temperature (B,) fp32   0 = greedy: exactly the argmax of the logits (ties -> lowest index)
    sample.top_k       (B,) int64  0 (or anything outside [1, C]) = C
    sample.top_p       (B,) fp32   nucleus mass; 1 = off
    sample.seed        (B,) int64  the sequence's seed (two's complement of a 64-bit value)

Zeros everywhere (the initial contents) mean greedy, so a runner that never writes them behaves as before.

Algorithm, for a row with temperature T > 0 (every float op below is one IEEE fp32 op, round to nearest, no
fused multiply-add; this is what makes the CPU and the GPU draw the same token for the same seed):
  1. key(x) = order-preserving uint32 of the fp32 bits (x >= 0: bits | 2^31, else ~bits).
     Each rank keeps its top-C logits by (key desc, global index asc): candidates (value, index), padded with
     (-inf, PAD_INDEX) when a rank holds fewer than C vocab entries. C = SAMPLE_CANDIDATES.
  2. The reduce merges the candidates of all ranks (every rank computes the same merge) into the global top-C
     by the same order: v_0 >= v_1 >= ... with indices i_j.
  3. k = top_k if 1 <= top_k <= C else C.  d_j = (v_j - v_0) / T;  t_j = d_j * LOG2E;
     e_0 = 1; for 1 <= j < k: e_j = exp2(t_j) by `exp2_poly` (0 when !(t_j >= -126)); e_j = 0 for j >= k.
  4. c_0 = 0, c_{j+1} = c_j + e_j (serial). S = c_k. Keep j < k while j == 0 or c_j < top_p * S -> m kept.
  5. u = uniform(seed, pos) (24 bits of a 32-bit integer hash of the seed and the position of the row's last
     token; see `uniform_bits`), r = u * c_m. The token is i_j for the smallest j < m with r < c_{j+1}
     (if rounding leaves none: the last j < m with e_j > 0).
  6. A row whose v_0 is not finite (NaN, or +-inf: no distribution) draws PAD_INDEX, which is no token: the engine
     fails the request naming NaN / inf, as for a greedy row whose logits hold NaN.

Approximation (documented in SamplingParams): the candidate set is capped at C. With 1 <= top_k <= C the result
follows exactly the top-k (then top-p) renormalised softmax. With top_k disabled (0) the device samples from
the top-C tokens only (and top_p's mass is measured over those C): tokens outside the top C are never drawn.
Runners that can (runtime/full_sampling.py: world size 1, or logits gathered on every rank) draw such rows from the
whole vocabulary instead, exactly, after the graph ran (DeviceSampling.full): torch ops on the step's fp32 logits,
the uniform from `uniform53(seed, pos)`. Otherwise the engine sends them to the host sampler unless told otherwise
(LLM(..., device_sampling=...)).
"""
from __future__ import annotations

from ..envflags import env_flag

SAMPLE_CANDIDATES = 64          # C: candidates per rank and after the merge; the largest device top_k
PAD_INDEX = (1 << 24) - 1       # index of padding candidates (value -inf); > every real vocab index
MAX_VOCAB = 1 << 24             # indices travel as fp32: exact below 2^24

TENSORS = ("sample.temperature", "sample.top_k", "sample.top_p", "sample.seed")

LOG2E_HEX = "0x1.715476p+0"     # log2(e) rounded to fp32
# 2^f on [0, 1): degree-6 polynomial (Horner, fp32, relative error < 1e-7), coefficients c0..c6 as fp32
EXP2_POLY_HEX = ("0x1.000000p+0", "0x1.62e428p-1", "0x1.ebfdf8p-3", "0x1.c67ee4p-5", "0x1.3d5826p-7",
                 "0x1.44bd44p-10", "0x1.cacdf6p-13")
LOG2E = float.fromhex(LOG2E_HEX)
EXP2_POLY = tuple(float.fromhex(h) for h in EXP2_POLY_HEX)

# 32-bit integer hash (Chris Wellons' lowbias32) and the mixing of (seed, position): see `uniform_bits`
HASH_M1, HASH_M2 = 0x7FEB352D, 0x846CA68B
POS_SALT = 0x9E3779B9


def hash32(x: int) -> int:
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * HASH_M1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * HASH_M2) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def uniform_bits(seed: int, pos: int) -> int:
    """24 random bits for (seed, position): u = bits * 2^-24 in [0, 1). Python reference of the device RNG."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    h = hash32((pos + POS_SALT) & 0xFFFFFFFF)
    h = hash32(h ^ (s >> 32))
    h = hash32(h ^ (s & 0xFFFFFFFF))
    return h >> 8


FULL_SALT = 0x85EBCA6B          # mixes the second 32-bit word of `uniform53`
ROUND_SALT = 0xC2B2AE35         # mixes a later round's first word (`uniform53`'s `round`)


def uniform53(seed: int, pos: int, round: int = 0) -> float:
    """A uniform number in [0, 1) with 53 random bits for (seed, position, round): the full-vocabulary sampler's
    draws (runtime/full_sampling.py; round r > 0: the r-th redraw of a nucleus row). a_0 = the 32-bit hash whose top 24
    bits `uniform_bits` takes, a_r = hash32(a_(r-1) ^ ROUND_SALT), b_r = hash32(a_r ^ FULL_SALT);
    u = ((a_r >> 5) * 2^26 + (b_r >> 6)) * 2^-53. Python reference of the torch and Triton versions."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    a = hash32((pos + POS_SALT) & 0xFFFFFFFF)
    a = hash32(a ^ (s >> 32))
    a = hash32(a ^ (s & 0xFFFFFFFF))
    for _ in range(round):
        a = hash32(a ^ ROUND_SALT)
    b = hash32(a ^ FULL_SALT)
    return ((a >> 5) * (1 << 26) + (b >> 6)) * 2.0 ** -53


def seed_to_int64(seed: int) -> int:
    """A Python int seed as the int64 the device tensor holds (its low 64 bits, two's complement)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= 1 << 63 else s


def conv_bf16_argmax() -> bool:
    """MPK_CONV_BF16_ARGMAX (on by default since session 43; 0 turns it off): in a greedy step whose fp32 logits
    nobody reads afterwards (StepCtx.greedy and StepCtx.logits_unread, the caller's promises), a conventional LM head
    whose argmax runs in the same segment keeps its bf16 product for the argmax and skips the fp32 logits copy
    (runtime/torch_exec.py). The argmax's max over bf16 values picks the same value and index as over their exact
    fp32 copies, so the tokens are the same bits. Defined here, beside the sampler's contract, because the planner
    prices it too (planner/cost.py). Measured (session 43, 1x H200, llama-3.2-1b ctx 512, bench/results/s43/bfam):
    the conventional step at B=128 2036 -> 1982 us, B=32 1490 -> 1476 (predicted -45..-75 and -12..-18 us)."""
    return env_flag("MPK_CONV_BF16_ARGMAX", default=True)

