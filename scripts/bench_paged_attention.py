"""The paged decode attention kernel (runtime/paged_attention.py) over its launch shapes, at the real models'
attention shapes, with the KV read from HBM (layer copies cycled past the L2), against what the bytes allow.

    PYTHONPATH=. python3 scripts/bench_paged_attention.py --out $OUT [--models llama-3.2-1b,qwen3-8b]
        [--batches 8,32,128] [--keys 512,4096] [--budget-s 200] [--cap serving|tight] [--table-dtype int64|int32]

Since session 42 a point is launched as the decode step launches it (rows of keys + 1 under the engine's key cap,
int64 page tables); the sweeps before it ran rows of `keys` keys under a cap of `keys` with int32 tables (--cap tight
--table-dtype int32), another build of the kernel (128 against 160 registers at llama B=8, 4096 keys), which is one
reason their ranking and the step's disagreed at 2 of 6 points in session 41.

Why (docs/perf-notes.md session 27): the first compiled run measured llama-3.2-1b B=32 at 4096 keys in 81 us a layer,
134 MB of K and V at 1.66 TB/s, a third of the stream rate; at 512 keys profile_conv_attn.py's number (13 us) had
the layer's 17 MB in the L2. A decode attention is a stream of K / V rows; how many bytes a launch keeps in flight
(programs an SM x cp.async stages x keys a step) sets its rate. Every config is checked against the default's
output; each point prints the best config and its rate. Writes paged_attention.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import graph_us, stream_bandwidth  # noqa: E402
from mpk_runtime.envflags import resolved_switches  # noqa: E402
from mpk_runtime.models import load_config  # noqa: E402
from mpk_runtime.runtime import paged_attention as pa  # noqa: E402

PAGE = 16


def configs(D: int) -> list[pa.PagedAttnConfig]:
    out = []
    # stages 1 too: offline sm_90 builds (session 27) give stages 3 / 4 the shared memory of 2 (the pipeliner keeps
    # two buffers of this loop), and one buffer halves it, which lets more programs share an SM
    for bn, tgt, st in itertools.product((32, 64, 128), (264, 528, 1056, 2112), (1, 2, 3, 4)):
        if bn == 128 and D == 128 and st == 4:
            continue   # shared memory: 128 keys x 128 dims x 2 (K, V) x 2 B x 4 stages = 256 KB
        out.append(pa.PagedAttnConfig(bn, tgt, 4, st))
    out += [pa.PagedAttnConfig(128, t, 8, 3) for t in (264, 528, 1056)]
    # 8 warps with one or two buffers (session 40: a CTA's rate at head dim 64 looks latency-bound, ~13 cycles an
    # instruction a warp; 8 warps split the same tile's rows, so each warp's chain is shorter; none swept before)
    out += [pa.PagedAttnConfig(bn, t, 8, st) for bn in (64, 128) for t in (528, 1056) for st in (1, 2)]
    # the page indices a block ahead: num_stages then buys K / V buffers (offline build, session 27)
    out += [pa.PagedAttnConfig(bn, t, 4, st, idx_ahead=True) for bn in (32, 64) for t in (264, 1056) for st in (3, 4)]
    return out


def launch_point(L: int, cap: str) -> tuple[int, int]:
    """(keys a row holds, the key cap the launch gets) for a point of L keys: "serving" (the default since session 42)
    = as a decode step at context L runs it, a row of L + 1 keys under the engine's power-of-two cap
    (megakernel_plans.kv_cap); "tight" = a row of L keys under a cap of L (the sweeps of sessions 27-41)."""
    if cap == "tight":
        return L, L
    from mpk_runtime.runtime.megakernel_plans import kv_cap
    return L + 1, kv_cap(L + 1, 1 << 30)


def point(cfg, B: int, L: int, l2_mb: float, cap: str = "serving", table_dtype: str = "int64"):
    """Caches (copies cycled past the L2), shuffled page tables (`table_dtype`: int64 as a decode step passes them,
    or int32 as the sweeps of sessions 27-41 did: the kernel builds differently for each, session 42), every row at
    its last position (launch_point's keys), the step's new rows; also (keys a row, the launch's key cap)."""
    nkv, D, nq = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    keys, L_cap = launch_point(L, cap)
    pps, width = -(-keys // PAGE), -(-L_cap // PAGE)
    kv_bytes = 2 * B * keys * nkv * D * 2
    copies = max(2, math.ceil(l2_mb * 1e6 / kv_bytes))
    g = torch.Generator(device="cuda").manual_seed(0)
    caches = []
    for _ in range(copies):
        kc = torch.randn(B * pps + 1, PAGE, nkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn_like(kc)
        caches.append((kc, vc))
    bt = torch.zeros(B, width, dtype=getattr(torch, table_dtype), device="cuda")   # past a row's pages: page 0
    bt[:, :pps] = (torch.randperm(B * pps, device="cuda", generator=g) + 1).view(B, pps)
    pos = torch.full((B,), keys - 1, dtype=torch.int64, device="cuda")
    q = torch.randn(B, nq * D, device="cuda", dtype=torch.bfloat16, generator=g)
    new = torch.randn(B, 2 * nkv * D, device="cuda", dtype=torch.bfloat16, generator=g)
    return caches, bt, pos, q, new, kv_bytes, (keys, L_cap)


def summary(rows: list[dict], best: list[dict], heads: dict) -> list[str]:
    """The best shape a point as paged_shapes.TUNED's entries (key: head dim, B x KV heads, keys; heads: model ->
    (head dim, KV heads)), then the shapes best (or within 3%) at the most points: the candidates for a default."""
    out = ["TUNED entries (paged_attention.py):"]
    for b in best:
        D, nkv = heads[b["model"]]
        extra = ", idx_ahead=True" if b["idx_ahead"] else ""
        out.append(f"    ({D}, {b['B'] * nkv}, {b['keys']}): PagedAttnConfig({b['block_n']}, {b['target']}, "
                   f"{b['warps']}, {b['stages']}{extra}),   # {b['model']} B={b['B']}: {b['us']} us")
    by_point = {(x["model"], x["B"], x["keys"]): x for x in best}
    score, seen = {}, {}
    for r in rows:
        b = by_point.get((r["model"], r["B"], r["keys"]))
        if b is None:
            continue
        k = (r["block_n"], r["target"], r["warps"], r["stages"], r["idx_ahead"])
        s = score.setdefault(k, [0, 0.0])
        s[0] += r["us"] <= 1.03 * b["us"]
        s[1] += r["us"] / b["us"]
        seen[k] = seen.get(k, 0) + 1
    for k, (n, tot) in sorted(score.items(), key=lambda kv: (-kv[1][0], kv[1][1]))[:8]:
        out.append(f"config block {k[0]} target {k[1]} warps {k[2]} stages {k[3]} idx_ahead {k[4]}: within 3% of "
                   f"best at {n} of {seen[k]} points, mean ratio to best {tot / seen[k]:.3f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--keys", default="512,4096")
    ap.add_argument("--l2-mb", type=float, default=200.0)
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cap", choices=("serving", "tight"), default="serving",
                    help="serving: a point of L keys as a decode step at context L launches it (rows of L + 1 keys "
                         "under the engine's power-of-two cap); tight: rows of L keys under a cap of L (the sweeps "
                         "before session 42)")
    ap.add_argument("--table-dtype", choices=("int64", "int32"), default="int64",
                    help="the page tables' dtype: int64 as the engine passes them; int32 as the sweeps before "
                         "session 42 did (another build of the kernel)")
    a = ap.parse_args()
    if not torch.cuda.is_available() or pa.triton is None:
        raise SystemExit("bench_paged_attention.py needs a CUDA GPU and Triton (the kernel's logic is tested on CPU "
                         "by tests/runtime/test_paged_attention.py under the Triton interpreter)")
    bw, bw_source = stream_bandwidth(torch.cuda.get_device_name())   # the card's own rate (the H200's 4.55 TB/s)
    stream_tbs = bw / 1e12
    print(f"stream rate {bw_source}", flush=True)
    t0 = time.time()
    rows, best = [], []
    for model in a.models.split(","):
        cfg = load_config(model)
        D = cfg.head_dim
        for B, P in itertools.product(map(int, a.batches.split(",")), map(int, a.keys.split(","))):
            if time.time() - t0 > a.budget_s:
                print(f"budget spent: {model} B={B} keys={P} not run", flush=True)
                continue
            caches, bt, pos, q, new, kv_bytes, (keys, L) = point(cfg, B, P, a.l2_mb, a.cap, a.table_dtype)
            scale = 1 / math.sqrt(D)
            ref = torch.empty_like(q)
            pa.paged_decode_attention(q, *caches[0], bt, pos, scale, L, ref, kv_new=new, config=pa.DEFAULT_CONFIG)
            pts = []
            for c in configs(D):
                out = torch.empty_like(q)
                try:
                    pa.paged_decode_attention(q, *caches[0], bt, pos, scale, L, out, kv_new=new, config=c)
                    err = float((out.float() - ref.float()).abs().max())
                    us = graph_us(lambda i: pa.paged_decode_attention(q, *caches[i % len(caches)], bt, pos, scale,
                                                                      L, out, kv_new=new, config=c), len(caches))
                except Exception as e:   # a config this GPU cannot launch (shared memory): recorded, not fatal
                    print(f"{model} B={B} keys={P} {c}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    continue
                S = pa.launch_shape(B, cfg.num_heads, cfg.num_kv_heads, L, c)[3]
                r = dict(model=model, B=B, keys=P, row_keys=keys, cap=L, block_n=c.block_n, target=c.target_programs, warps=c.num_warps,
                         stages=c.num_stages, idx_ahead=c.idx_ahead, splits=S, us=round(us, 2), tbs=round(kv_bytes / us / 1e6, 3),
                         max_err_vs_default=err, default=c == pa.DEFAULT_CONFIG)
                r["tuned"] = c == pa.config_for(D, B, cfg.num_kv_heads, L)
                rows.append(r)
                pts.append(r)
            if not pts:
                continue
            bad = [r for r in pts if r["max_err_vs_default"] > 3e-2]
            good = [r for r in pts if r["max_err_vs_default"] <= 3e-2]
            if not good:
                print(f"{model} B={B} keys={P}: every shape is off the default's output", flush=True)
                continue
            b = min(good, key=lambda r: r["us"])
            d = next(r for r in pts if r["default"])
            tu = next((r for r in pts if r["tuned"]), None)
            best.append(b)
            print(f"{model:13s} B={B:4d} keys={P:5d} (rows {keys}, cap {L}) {kv_bytes / 1e6:7.1f} MB: default {d['us']:7.1f} us "
                  f"({d['tbs']:.2f} TB/s)  best {b['us']:7.1f} us ({b['tbs']:.2f} TB/s, "
                  f"{b['tbs'] / stream_tbs:.0%} of {stream_tbs:.2f}) block {b['block_n']} target {b['target']} "
                  f"warps {b['warps']} stages {b['stages']} idx_ahead {b['idx_ahead']} splits {b['splits']}"
                  + (f"  config_for's {tu['us']:.1f} us" if tu else "")
                  + (f"  [{len(bad)} configs off the default's output]" if bad else ""), flush=True)
            del caches
            torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"),
                commit=os.environ.get("GIT_COMMIT", "unknown"), l2_mb=a.l2_mb, triton=pa.triton.__version__,
                stream_tbs=round(stream_tbs, 3), stream_source=bw_source,
                cap=a.cap, table_dtype=a.table_dtype,
                switches=resolved_switches())
    with open(os.path.join(a.out, "paged_attention.json"), "w") as f:
        json.dump(dict(meta=meta, best=best, rows=rows), f, indent=1)
    heads = {m: (load_config(m).head_dim, load_config(m).num_kv_heads) for m in a.models.split(",")}
    print("\n".join(summary(rows, best, heads)))

if __name__ == "__main__":
    main()
