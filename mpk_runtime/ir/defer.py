"""Deferred KV appends: where a layer's qkv_rope runs conventionally and its attention in a megakernel, the
conventional op leaves the step's k and v rows in `kv_new` and the attention megakernel appends them.

A conventional qkv_rope appends with two indexed-put kernels per layer (k and v), ~110 us of a llama-3.2-1b B=32
attn-mk step on an H200 (session 19's profile, docs/perf-notes.md). Deferred, its q/k tail writes k (and v) into
the (M, 2 n_kv D) `kv_new` rows instead, and the attention partial whose chunk holds a sequence's new position
writes that row into the paged cache before its first pass: the same CTA reads it after a barrier, and no other
task of the step reads that chunk of that KV group (chunks of one group are disjoint; later layers read other
caches). Decode steps only (one new row per sequence). On by default since session 21 (1x H200, llama-3.2-1b
attn-mk: -4.4% / -3.3% at B=32 ctx 512 / 4096, -1.9% / -0.6% at B=128; bench/results/s21/run2_defer);
MPK_KV_DEFER=0 turns it off.

With MPK_CONV_TRITON_ATTN=1 a conventional attention takes the rows too (runtime/paged_attention.py appends them
inside its kernel), so wholly conventional layers defer as well.

`kv_defer_layers(segments)` says which layers a plan defers; `defer_kv_appends(graph, layers)` returns the graph
whose ops of those layers carry `kv_defer` (copies: the graph given is not changed, so plans sharing it are not
affected). The executor (runtime/plan_exec.py) and the planner's price (planner/search.py) use the same two.
"""
from __future__ import annotations

import functools

from dataclasses import replace

from ..envflags import env_flag
from .graph import Graph


def kv_defer() -> bool:
    """Attention megakernels append the k / v rows a conventional qkv_rope computed (default; MPK_KV_DEFER=0 off)."""
    return env_flag("MPK_KV_DEFER", default=True)


@functools.cache
def _triton_installed() -> bool:
    """Triton importable: a CUDA build of torch. Not "a GPU visible here": the controller that plans (a Ray driver,
    say) may have no GPU while its workers do, and it must price what they run."""
    from ..runtime.triton_support import triton   # (imported here: Triton takes ~1 s, and only this switch needs it)
    return triton is not None


def paged_head_dim(D: int) -> bool:
    """Head dims runtime/paged_attention.py takes (tl.arange needs a power of two; tl.dot at least 16); others (80,
    96, ...) take the gather + SDPA path, and the planner prices them by its curve."""
    return D >= 16 and D & (D - 1) == 0


def conv_attn_appends() -> bool:
    """A conventional decode attention reads the KV pages in place and appends the deferred rows too
    (runtime/paged_attention.py writes them in its kernel; where it cannot run, the conventional op appends them
    before its gather). MPK_CONV_TRITON_ATTN: 1 on, 0 off (the gather + SDPA path); unset: on where Triton is
    installed (the default since session 27: bench/results/s27)."""
    return env_flag("MPK_CONV_TRITON_ATTN", default=_triton_installed())


def kv_defer_layers(graph: Graph, segments) -> set[int]:
    """Layers whose qkv_rope is in a conventional segment and whose attention is in a megakernel segment, or in a
    conventional one when conv_attn_appends() (`segments`: (kind, op names) pairs, or objects with .kind / .ops);
    empty unless kv_defer() and decode."""
    if not kv_defer() or graph.mode != "decode":
        return set()
    kind_of = {}
    for seg in segments:
        kind, ops = (seg.kind, seg.ops) if hasattr(seg, "ops") else seg
        for n in ops:
            kind_of[n] = kind
    layers = set()
    attn_kinds = ("megakernel", "conventional") if conv_attn_appends() else ("megakernel",)
    for o in graph.ops:
        if o.kind == "attention" and o.attrs.get("kv_new") and kind_of.get(o.name) in attn_kinds:
            qkv = f"L{o.attrs['layer']}.qkv_rope"
            if kind_of.get(qkv) == "conventional":
                layers.add(o.attrs["layer"])
    return layers


def defer_kv_appends(graph: Graph, layers: set[int]) -> Graph:
    """The graph with the KV appends of `layers` moved from qkv_rope to attention (module doc); `graph` itself
    when `layers` is empty."""
    if not layers:
        return graph
    ops = []
    for o in graph.ops:
        layer = o.attrs.get("layer")
        if o.kind in ("qkv_rope", "attention") and layer in layers:
            kvn = o.attrs.get("kv_new")
            if kvn is None:
                raise ValueError(f"{o.name}: no kv_new rows in this graph (decode graphs only)")
            a = {**o.attrs, "kv_defer": True}
            if o.kind == "qkv_rope":   # writes q and the new rows, not the cache
                outs = [t for t in o.outputs if t not in (a["k_cache"], a["v_cache"])] + [kvn]
                o = replace(o, attrs=a, outputs=outs)
            else:                      # reads the new rows too (and writes them into the cache it reads)
                o = replace(o, attrs=a, inputs=o.inputs + [kvn])
        ops.append(o)
    return replace(graph, ops=ops)
