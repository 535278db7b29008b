"""The conventional path's pieces that run through torch.compile on a GPU, and their switches.

Each is a function of the same ops and rounding points as the eager code in conventional_ops.py (CPU tests: bit for
bit in bf16), compiled with only the row count dynamic (`compile_rows_dynamic`): the RMSNorm (MPK_CONV_FUSE_NORM),
the q/k tail of qkv_rope (MPK_CONV_FUSE_ROPE), SiLU-and-mul
(MPK_CONV_FUSE_SILU); and the weight layout the conventional path prefers (MPK_CONV_FUSE_PROJ: q/k/v and gate/up
stored back to back). Measured switches are on by default (docs/perf-notes.md sessions 15-16).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..envflags import env_flag
from ..models.weights import pack_adjacent
from ..tasks.ops.common import rms_norm as _rms_norm_eager


# --- RMSNorm: on a GPU one generated kernel (MPK_CONV_FUSE_NORM, default on), else eager (6-7 small kernels) ------
def _rms_norm_fn(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """tasks/ops/common.rms_norm written functionally for torch.compile: the same ops and rounding points (fp32
    statistics, x * r rounded to x's dtype, then the weight product rounded once); only the order of the mean's
    fp32 sum is the generated kernel's."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xn = (xf * r).to(x.dtype)
    if w is None:
        return xn
    if w.dtype == xn.dtype and torch.broadcast_shapes(w.shape, xn.shape) == xn.shape:
        return xn * w
    return w * xn


def fuse_norm() -> bool:
    """The conventional path's RMSNorms on a GPU run as one torch.compile'd kernel each (dynamic row count: one
    compile per hidden size and weight layout, a few seconds the first time) instead of pow / mean / add / rsqrt /
    mul / mul: measured session 15, attn-mk B=32 -17% (llama-3.2-1b 2.85 -> 2.36 ms, qwen3-8b 10.8 -> 8.87),
    B=128 -13%. MPK_CONV_FUSE_NORM=0 turns it off (eager norms, no compile)."""
    return env_flag("MPK_CONV_FUSE_NORM", default=True)


def recompiles_allowed():
    """A context in which the conventional path's compiled functions may compile as many graphs as they need:
    one per width (compile_rows_dynamic) or per segment and StepCtx variant (torch_exec, MPK_CONV_COMPILE: 17
    segments of one code object in a 16-layer attn-mk plan). Dynamo's default, 8 per code object, would be a hard
    error under fullgraph, or a silent eager fallback without it. Scoped to these calls: the process's own dynamo
    settings stay as they are."""
    return torch._dynamo.config.patch(recompile_limit=512, accumulated_recompile_limit=4096)


def fixed_configs() -> bool:
    """MPK_CONV_FIXED_CONFIGS=1 (opt-in, session 37; not yet GPU-measured): the conventional path's generated kernels
    compile in inductor's deterministic mode, which picks each reduction's launch config by a fixed rule instead of
    timing the candidates on the first call. Session 37 (bench/results/s37/run6_varq_clear) profiled the conventional
    plan at qwen3-8b B=8 in three fresh processes, each with an empty inductor cache: the q / k norm kernel
    (`triton_per_fused__to_copy_cat_mean_pow_0`, a persistent reduction over 128 with candidate XBLOCKs 1 / 8 / 32)
    took 59.6 / 122.3 / 58.4 us a step, a first-call pick that flips between processes (and, cached on disk, between
    machine starts: session 36's 2.4x). A config that differs also changes the reduction's order, so the last bit of
    a norm could differ between two processes on the same inputs. Session 44 (llama-3.2-1b ctx 512, the bench's planned
    cells alone in a fresh process): B=8 1.257 ms against 1.259-1.268 by default, B=32 1.494 against 1.460-1.477 (+2%),
    so it stays off (bench/results/s44/bfix0)."""
    return env_flag("MPK_CONV_FIXED_CONFIGS", default=False)


def inductor_options() -> dict:
    """torch.compile options of the conventional path's generated code (compile_rows_dynamic, torch_exec): the
    eager code's rounding points (emulate_precision_casts), and with fixed_configs() inductor's deterministic mode."""
    return {"emulate_precision_casts": True, **({"deterministic": True} if fixed_configs() else {})}


def compile_rows_dynamic(fn, rows_args: tuple[int, ...], backend="inductor"):
    """fn through torch.compile with only the row count (dim 0 of the arguments at rows_args) dynamic: one compile per
    hidden size / head layout (plus one for a single row: dynamo specialises size 1), each reduction over a
    static width. Sessions 15-16 compiled with every dim dynamic, and llama-3.2-1b's 33 norms of a B=32 step took
    338 us in one profile (bench/results/s16 run 1, after the tiny GPU-test configs had compiled first) and 82 us in
    another (s15 run 7): the suspected cause is a generated kernel whose reduction block was sized for the first
    (tiny) width it saw; with a static width each model's norm gets its own kernel (session 17, the same order
    of compiles: 60 us)."""
    options = inductor_options() if backend == "inductor" else None
    compiled = torch.compile(fn, dynamic=False, fullgraph=True, backend=backend, options=options)

    def call(*args):
        for i in rows_args:
            torch._dynamo.maybe_mark_dynamic(args[i], 0)
        with recompiles_allowed():   # a graph per width: several models / TP degrees in a process need > 8
            return compiled(*args)
    return call


@functools.cache
def fused_norm():
    return compile_rows_dynamic(_rms_norm_fn, (0,))   # x (M, ..., K); w (K,) static


def rms_norm(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    if not (x.is_cuda and fuse_norm()):
        return _rms_norm_eager(x, w, eps)
    return fused_norm()(x, w, eps)


def fuse_proj() -> bool:
    """MPK_CONV_FUSE_PROJ (default on since session 16; =0 for separate matmuls): the runner stores each layer's q/k/v and
    gate/up weights back to back (prepare_weights), and the conventional path computes each group with one matmul
    (llama-3.2-1b B=32: the k and v projections take 5.4 us each for 2 MB of weights, the fused q/k/v ~7 us for
    12.6 MB is the prediction) and without the q/k stacking copy. Measured with the fused q/k tail (1x H200,
    48105cf, ctx 512, attn-mk plan; bench/results/s16/run1_one_fuse_48105cf): llama-3.2-1b B=32 2.595 -> 2.290 ms
    with both (2.396 proj alone), B=128 4.212 -> 3.948; qwen3-8b B=32 9.992 -> 8.885, B=128 14.599 -> 13.804."""
    return env_flag("MPK_CONV_FUSE_PROJ", default=True)


def prepare_weights(weights: dict, cfg) -> dict:
    """What the conventional path wants of a GPU runner's weights: with MPK_CONV_FUSE_PROJ=1, the projections that
    share an input stored back to back (the megakernel reads the same values through views)."""
    if fuse_proj() and any(t.is_cuda for t in weights.values()):
        pack_adjacent(weights, cfg)
    return weights


def _silu_mul_fn(g: torch.Tensor, u: torch.Tensor, out: torch.Tensor) -> None:
    """linear's silu_mul epilogue written functionally for torch.compile: silu(g) rounded to g's dtype, times u
    rounded again (F.silu in place, then mul: the eager path's two roundings), cast into out. The generated fp32
    silu may differ from ATen's in the last ulp (hidden by the bf16 rounding but for rare ties)."""
    out.copy_(F.silu(g) * u)


def fuse_silu() -> bool:
    """MPK_CONV_FUSE_SILU (default on since session 17; =0 for eager): gate/up's SiLU-and-mul as one compiled kernel
    (one launch fewer per layer; predicted ~3 us per layer, llama-3.2-1b B=32 ~-2%). Measured (1x H200, cf19493,
    attn-mk ctx 512): llama-3.2-1b B=32 1.954 -> 1.884 ms (-3.6%), B=128 -2.3%; qwen3-8b B=32 / 128 -2.1% / -2.0%.
    (Session 16's MPK_CONV_FUSE_KV, the cache appends inside the q/k tail kernel, measured +28..90%: inductor's
    scatter into the cache was not re-inplaced on the GPU build, so every step copied the layer's caches; removed.)"""
    return env_flag("MPK_CONV_FUSE_SILU", default=True)


@functools.cache
def fused_silu():
    return compile_rows_dynamic(_silu_mul_fn, (0, 1, 2))


def _qk_epilogue_fn(q_raw, k_raw, qn, kn, cos, sin_s, eps, q_out):
    """_qk_epilogue written functionally for torch.compile (MPK_CONV_FUSE_ROPE=1): the same ops and rounding points
    on the q and k projections; writes q into q_out (M, n_q, D), returns k."""
    nq = q_raw.shape[1]
    qk = torch.cat((q_raw, k_raw), 1)
    if qn is not None:
        qk = _rms_norm_fn(qk, None, eps)
        qk = torch.cat((qk[:, :nq] * qn, qk[:, nq:] * kn), 1)
    y1, y2 = qk.chunk(2, -1)
    out = qk * cos + torch.cat((y2, y1), -1) * sin_s
    q_out.copy_(out[:, :nq])
    return out[:, nq:]


def fuse_rope() -> bool:
    """MPK_CONV_FUSE_ROPE (default on since session 16; =0 for eager): the q/k tail of the conventional qkv_rope
    (the q/k stack, Qwen3's per-head norms and weights, RoPE, the q write) as one torch.compile'd kernel on a GPU,
    instead of ~6-10 small kernels per layer. Measured alone (48105cf): llama-3.2-1b attn-mk B=32 2.595 -> 2.481 ms,
    qwen3-8b 9.992 -> 9.616."""
    return env_flag("MPK_CONV_FUSE_ROPE", default=True)


@functools.cache
def fused_qk():
    # q_raw, k_raw, cos, sin_s, q_out carry the rows; the per-head norm weights do not
    return compile_rows_dynamic(_qk_epilogue_fn, (0, 1, 4, 5, 7))


def _qk_epilogue_kv_fn(q_raw, k_raw, qn, kn, cos, sin_s, eps, q_out, v_raw, kv_out):
    """The q/k tail of a qkv_rope whose KV append is deferred (ir/defer.py): q into q_out, and the roped k and the
    v rows into kv_out (M, 2, n_kv, D), where the attention megakernel picks them up - one kernel for what the
    appending tail does in one kernel and two indexed puts."""
    kv_out[:, 0].copy_(_qk_epilogue_fn(q_raw, k_raw, qn, kn, cos, sin_s, eps, q_out))
    kv_out[:, 1].copy_(v_raw)


@functools.cache
def fused_qk_kv():
    return compile_rows_dynamic(_qk_epilogue_kv_fn, (0, 1, 4, 5, 7, 8, 9))
