#!/usr/bin/env python3
"""A batch-1 MLP block at real shapes, today's two phases against the down projection fused into the gate_up tile
(device_kernels/bench_mlp.cu; docs/perf-notes.md sessions 36-37), timed on the device from the first CTA's start to
the block's last output (%globaltimer stamps; L2 flushed before each launch by a 256 MiB read).

    PYTHONPATH=. python3 scripts/bench_mlp.py [--models llama-3.2-1b,qwen3-8b] [--reps 30]   -> $OUT/bench_mlp.json

Each CTA runs one gate_up tile of the megakernel's batch-1 width (Tiling.linear_n on this GPU's SM count: 128 tiles
of 64 / 96 columns at llama-3.2-1b / qwen3-8b on 132 SMs) with the megakernel's own CUDA-core linear code, then
  phases: waits for every gate_up tile (a release add and an acquire spin, as the megakernel's event counters) and
          runs one down tile (16 / 32 columns over K = I) + the residual;
  fused:  streams its rows of the transposed down weight into fp32 partials of the whole row, adds them into an fp32
          accumulator (vector atomics), takes a ticket; the last CTA writes out = bf16(h + bf16(acc));
  nofin:  fused without the finisher (each CTA signals a counter after its atomics; the consumers would read
          h + acc): the finisher's cost is fused - nofin. Its output is formed on the host from acc, then acc zeroed.
Every output is checked against torch (the same rounding points; within_ulps) and reported with the time:
block (first start -> last output), gate_up (first start -> last gate_up tile done) and the rest.

Session 38 (H200, bench/results/s38/mlp): fused / phases 1.052 at llama-3.2-1b (+1.66 us a layer) and 1.049 at
qwen3-8b (+3.97 us); nofin 0.932 / 0.967 (-2.18 / -2.69 us). Mode inplace (the down weight read in its own (H, I)
layout by the megakernel's down share, what MPK_MLP_FUSE=1 ran) measured 1.155 / 1.223 (+5.0 / +18.1 us). The
design's drop rule was "below -1 us a layer at llama": MPK_MLP_FUSE was removed, and mode inplace with it (git history
has both).
"""
from __future__ import annotations

import ctypes
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OUT = Path(os.environ.get("OUT") or "gpu_out")
MODES = {"phases": 0, "fused": 1, "nofin": 2}


def reference(x, Wg, Wu, Wd, h):
    """The block with the kernel's rounding points, in fp32 on the same device: gate and up rounded to bf16, SiLU
    rounded, the product rounded (the intermediate row), down's sum rounded, then the residual add rounded."""
    import torch
    bf = torch.bfloat16
    g = (x.float() @ Wg.float().T).to(bf).float()
    u = (x.float() @ Wu.float().T).to(bf).float()
    inter = ((g * torch.sigmoid(g)).to(bf).float() * u).to(bf)
    y = (inter.float() @ Wd.float().T).to(bf)
    return (h.float() + y.float()).to(bf)


def within_ulps(out, ref, ulps: float = 4.0) -> tuple[bool, float]:
    """(every element within `ulps` units of 2^-8 x ref's magnitude (floored at the row's rms; a unit is half to one
    bf16 ulp), the largest error in those units). Four: the output's own rounding, and down's sum rounded to bf16
    from fp32 partials added in another order (one ulp of a term as large as the output)."""
    import torch
    r = ref.float()
    scale = torch.maximum(r.abs(), r.pow(2).mean().sqrt())
    err = ((out.float() - r).abs() / (scale * 2.0 ** -8)).max().item()
    return err <= ulps, err


class Block:
    """One model's MLP block on the GPU: random weights (std 0.02), a unit-rms input row and a residual row."""

    def __init__(self, cu, fn, H: int, I: int, sms: int, seed: int = 0):
        import torch
        from mpk_runtime.tasks.tiling import Tiling
        self.cu, self.fn, self.H, self.I = cu, fn, H, I
        dev = torch.device("cuda", 0)
        g = torch.Generator(device=dev).manual_seed(seed)
        bf = torch.bfloat16
        rnd = lambda *s: torch.randn(*s, generator=g, device=dev)   # noqa: E731
        self.x = rnd(H).to(bf)
        self.Wg, self.Wu = (rnd(I, H) * 0.02).to(bf), (rnd(I, H) * 0.02).to(bf)
        self.Wd = (rnd(H, I) * 0.02).to(bf)
        self.WdT = self.Wd.T.contiguous()
        self.h = rnd(H).to(bf)
        self.inter = torch.zeros(I, dtype=bf, device=dev)
        self.acc = torch.zeros(H, dtype=torch.float32, device=dev)
        self.out = torch.zeros(H, dtype=bf, device=dev)
        self.ctr = torch.zeros(2, dtype=torch.int64, device=dev)
        t = Tiling(num_sms=sms)
        self.cols, self.dcols = t.linear_n(None, None, I), t.linear_n(None, None, H)
        self.grid = max(-(-I // self.cols), -(-H // self.dcols))
        if self.grid > sms:
            raise SystemExit(f"{self.grid} tiles on {sms} SMs: the phases mode's barrier needs every CTA resident")
        self.stamps = torch.zeros(3 * self.grid, dtype=torch.int64, device=dev)
        self.scratch = torch.ones(64 << 20, dtype=torch.float32, device=dev)
        self.flushed = torch.zeros(1, dtype=torch.float32, device=dev)

    def result(self, mode: int):
        """The block's output row after a launch of `mode` (nofin: bf16(h + bf16(acc)) formed here, acc zeroed)."""
        import torch
        if mode != 2:
            return self.out
        out = (self.h.float() + self.acc.to(torch.bfloat16).float()).to(torch.bfloat16)
        self.acc.zero_()
        return out

    def launch(self, mode: int, flush: bool = True):
        """One launch (after zeroing the counters and, with flush, reading 256 MiB so no weight is in L2);
        returns the stamps (grid, 3) in us from the first CTA's start."""
        if mode not in MODES.values():
            raise ValueError(f"bench_mlp mode {mode}: the kernel runs {MODES} (mode 3, inplace, went with "
                             "MPK_MLP_FUSE in session 38)")
        import torch
        from mpk_runtime.codegen import layout as L
        from mpk_runtime.runtime.megakernel import _check
        self.ctr.zero_()
        self.out.zero_()
        if flush:
            torch.sum(self.scratch, dim=0, keepdim=True, out=self.flushed)
        p = lambda t: t.data_ptr()   # noqa: E731
        args = ((p(self.x), p(self.Wg), p(self.Wu), p(self.Wd), p(self.WdT), p(self.h), p(self.inter), p(self.acc),
                 p(self.out), p(self.ctr), self.H, self.I, self.cols, self.dcols, mode, p(self.stamps)),
                (ctypes.c_void_p,) * 10 + (ctypes.c_int,) * 5 + (ctypes.c_void_p,))
        stream = torch.cuda.current_stream()
        _check(self.cu.cuLaunchKernel(self.fn, self.grid, 1, 1, L.CONSTANTS["THREADS"], 1, 1, 0,
                                      self.cu.CUstream(stream.cuda_stream), args, 0), "cuLaunchKernel")
        st = self.stamps.view(self.grid, 3).cpu().double()   # (synchronises)
        return (st - st[:, 0].min()) / 1e3


def main():
    import argparse
    import torch
    from mpk_runtime.models.config import load_config
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-8b")
    ap.add_argument("--reps", type=int, default=30)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_mlp needs a CUDA GPU")
    cu, fn = load()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for model in a.models.split(","):
        cfg = load_config(model)
        blk = Block(cu, fn, cfg.hidden_size, cfg.intermediate_size, sms)
        ref = reference(blk.x, blk.Wg, blk.Wu, blk.Wd, blk.h)
        res = {}
        for name, mode in MODES.items():
            blk.launch(mode)   # loads the module's code; checks the output
            ok, err = within_ulps(blk.result(mode), ref)
            left = blk.acc.abs().max().item()
            spans, gus, rests = [], [], []
            for _ in range(a.reps):
                st = blk.launch(mode)
                blk.result(mode)
                spans.append(st[:, 2].max().item())
                gus.append(st[:, 1].max().item())
                rests.append(spans[-1] - gus[-1])
            r = dict(model=model, mode=name, H=blk.H, I=blk.I, tiles=blk.grid, cols=blk.cols, dcols=blk.dcols,
                     block_us=statistics.median(spans), gate_up_us=statistics.median(gus),
                     rest_us=statistics.median(rests), block_us_min=min(spans), ok=ok, max_err_ulps=err,
                     acc_left=left)
            res[name] = r
            rows.append(r)
            print(f"{model:<13} {name:<7} block {r['block_us']:7.2f} us (gate_up {r['gate_up_us']:6.2f}, rest "
                  f"{r['rest_us']:6.2f})  output within {err:.2f} ulps of torch: {'ok' if ok else 'FAIL'}"
                  + (f"  acc left {left:g}" if left else ""), flush=True)
        p = res["phases"]["block_us"]
        for name in ("fused", "nofin"):
            f = res[name]["block_us"]
            print(f"{model:<13} {name} / phases {f / p:.3f} ({f - p:+.2f} us a layer)", flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=torch.cuda.get_device_name(0), date=time.strftime("%Y-%m-%dT%H:%M:%S"),
                git_commit=os.environ.get("GIT_COMMIT", ""), reps=a.reps, sms=sms,
                timer="%globaltimer stamps per CTA, L2 flushed by a 256 MiB read before each launch; medians")
    (OUT / "bench_mlp.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {OUT / 'bench_mlp.json'}")
    if not all(r["ok"] and r["acc_left"] == 0 for r in rows):
        raise SystemExit("an output missed torch's (see above)")


def load():
    """bench_mlp.cu's kernel, loaded in the primary context (runtime/megakernel.py load_module)."""
    import torch
    from mpk_runtime.codegen import nvcc
    from mpk_runtime.runtime.megakernel import _check, load_module
    b = nvcc.build(source="bench_mlp.cu")
    torch.zeros(1, device="cuda")   # the primary context, current on this thread
    cu, mod = load_module(b.cubin)
    return cu, _check(cu.cuModuleGetFunction(mod, b"mpk_bench_mlp"), "cuModuleGetFunction")


if __name__ == "__main__":
    main()
