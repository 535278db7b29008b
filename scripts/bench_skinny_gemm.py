"""Skinny GEMMs of a decode step (y = x @ W.T, M = batch rows, bf16 in, fp32 accumulate, bf16 out): cuBLAS (what
the conventional segments call through torch) against a weight-streaming Triton kernel, at the real models' shapes.

    PYTHONPATH=. python3 scripts/bench_skinny_gemm.py --out $OUT [--models llama-3.2-1b,qwen3-8b] [--batches 8,32,128]

The question (docs/perf-notes.md session 26): at B = 32 the conventional segments' matmuls stream llama's weights at
~3 TB/s (67% of 4.55; gpt-fast calls the same cuBLAS kernels). Does a kernel that only streams W once, each program
owning BN output columns over the whole K, get nearer the read-only streaming rate? Each timed call reads a
different copy of the weights (copies cycled past the L2 size), inside a CUDA graph; the result is checked against
the fp32 product. Writes skinny_gemm.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_common import graph_us  # noqa: E402
from mpk_runtime.models import load_config  # noqa: E402
from mpk_runtime.runtime.skinny_gemm import CONFIGS, skinny_mm  # noqa: E402

STREAM_TBS = 4.55   # measured read-only streaming rate on the H200 here (docs/benchmarks.md)


def shapes(model: str) -> list[tuple[str, int, int]]:
    """(name, N, K) of the step's matmuls (fused q/k/v and gate/up as the conventional path stores them)."""
    c = load_config(model)
    d, hd = c.hidden_size, c.head_dim
    qkv = (c.num_heads + 2 * c.num_kv_heads) * hd
    return [("qkv", qkv, d), ("o_proj", d, c.num_heads * hd), ("gate_up", 2 * c.intermediate_size, d),
            ("down", d, c.intermediate_size), ("lm_head", c.vocab_size, d)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--l2-mb", type=float, default=256.0, help="weight bytes cycled per shape (past the L2)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_skinny_gemm.py needs a CUDA GPU (the kernels' logic is tested on CPU by "
                         "tests/runtime/test_skinny_gemm.py under the Triton interpreter)")
    rows = []
    torch.manual_seed(0)
    for model in a.models.split(","):
        for name, N, K in shapes(model):
            wbytes = N * K * 2
            copies = max(1, int(a.l2_mb * 1e6 // wbytes) + 1) if wbytes < a.l2_mb * 1e6 else 2
            ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for M in map(int, a.batches.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                ref = (x.float() @ ws[0].float().T)
                reps = max(4, min(64, int(2e9 // wbytes)))
                r = dict(model=model, op=name, M=M, N=N, K=K, mb=wbytes / 1e6)
                r["cublas_us"] = graph_us(lambda i: torch.mm(x, ws[i % copies].T, out=y), reps, 5)
                best = None
                for cfg in CONFIGS:
                    try:
                        skinny_mm(x, ws[0], y, cfg)
                        torch.cuda.synchronize()
                        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
                        us = graph_us(lambda i: skinny_mm(x, ws[i % copies], y, cfg), reps, 5)
                    except Exception as e:   # a config the compiler refuses (shared memory): recorded, skipped
                        r.setdefault("failed", []).append(f"{cfg}: {type(e).__name__}: {str(e)[:120]}")
                        continue
                    r.setdefault("triton", []).append(dict(cfg=list(cfg), us=us, rel_err=err))
                    if best is None or us < best[1]:
                        best = (cfg, us, err)
                if best:
                    r["triton_best"] = dict(cfg=list(best[0]), us=best[1], rel_err=best[2])
                for k in ("cublas_us",):
                    r[k.replace("_us", "_tbs")] = wbytes / (r[k] * 1e-6) / 1e12
                line = (f"{model:13s} {name:8s} M={M:4d} N={N:6d} K={K:6d} {wbytes / 1e6:7.1f} MB  cuBLAS {r['cublas_us']:8.1f} us "
                        f"({r['cublas_tbs'] / STREAM_TBS:4.0%})")
                if best:
                    tbs = wbytes / (best[1] * 1e-6) / 1e12
                    line += (f"  triton {best[1]:8.1f} us ({tbs / STREAM_TBS:4.0%}) {best[0]} err {best[2]:.1e}"
                             f"  cuBLAS/triton {r['cublas_us'] / best[1]:.2f}")
                print(line, flush=True)
                rows.append(r)
            del ws
            torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M"),
                commit=os.environ.get("GIT_COMMIT", "?"), torch=torch.__version__, stream_tbs=STREAM_TBS)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "skinny_gemm.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    # the step's matmuls together, per model and batch: what the conventional linears would gain
    for model in a.models.split(","):
        for M in map(int, a.batches.split(",")):
            sel = [r for r in rows if r["model"] == model and r["M"] == M]
            cb = sum(r["cublas_us"] for r in sel if r["op"] != "lm_head")
            tr = sum(min(r["cublas_us"], r.get("triton_best", {}).get("us", 1e18)) for r in sel if r["op"] != "lm_head")
            print(f"{model:13s} M={M:4d} one layer's matmuls: cuBLAS {cb:7.1f} us, best of both {tr:7.1f} us "
                  f"({cb / tr:.2f}x)")


if __name__ == "__main__":
    main()
