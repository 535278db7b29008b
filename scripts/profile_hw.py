"""Measure the hardware profile the planner prices plans with, on the GPU machine, with this project's kernels.

    PYTHONPATH=. python3 scripts/profile_hw.py --out $OUT [--name h200_measured]
    PYTHONPATH=. python3 scripts/profile_hw.py --only conv --base h200_v36_cal --name h200_v38_cal --out $OUT
        (re-measure only the conventional ops' fixed costs into a copy of a calibrated profile: for a change
        to a conventional kernel sequence; every other term, the calibration's included, stays as it was)

Writes <out>/<name>.json (copy it to mpk_runtime/planner/profiles/). Measured here:
  hbm_bw_by_sms       the megakernel streaming one layer's linear weights on k SMs (grid = k), k = 16..132
  task_fixed_us_by_kind, stream_eff_by_kind
                      per task kind, least squares of the traced task duration (globaltimer, after its waits)
                      on its bytes: intercept = fixed cost, slope vs the fair-share rate = streaming efficiency
  megakernel_launch_us  launch + drain of a one-task megakernel
  conv_kernel_us, conv_bw_fraction
                      every op of a decode step run alone as conventional torch kernels in a CUDA graph, fitted
                      as t = kernels * c + bytes / (bw * f)
Cross-GPU terms (remote signal, NCCL) keep the values measured by the TP benchmarks (scripts/bench_allreduce.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpk_runtime.ir import build_graph  # noqa: E402
from mpk_runtime.models import load_config, random_weights  # noqa: E402
from mpk_runtime.models.reference import rope_inv_freq  # noqa: E402
from mpk_runtime.planner import HardwareProfile  # noqa: E402
from mpk_runtime.planner.cost import conv_kernels  # noqa: E402
from mpk_runtime.planner.trace_fit import fit_task_costs, med, merge_points, task_points  # noqa: E402
from mpk_runtime.runtime.memory import KVStore, RankMemory, StepCtx  # noqa: E402
from mpk_runtime.runtime.megakernel import Megakernel  # noqa: E402
from mpk_runtime.runtime.torch_exec import ConventionalExecutor  # noqa: E402
from mpk_runtime.tasks import Tiling, build_task_graphs  # noqa: E402




class Rig:
    def __init__(self, model: str, B: int, context: int = 512):
        self.cfg = cfg = load_config(model)
        self.w = random_weights(cfg, seed=0, device="cuda")
        self.ps, self.max_seq = 16, context + 64
        pps = -(-self.max_seq // self.ps)
        self.g = build_graph(cfg, batch=B, context_len=context, max_seq_len=self.max_seq, attn_splits=2)
        self.kv = KVStore(cfg.num_layers, B * pps + 1, self.ps, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16,
                          device="cuda", poison=False)
        for c in self.kv.k + self.kv.v:
            c.normal_()
        self.mem = RankMemory(self.g, self.w, self.kv, device="cuda")
        self.mem.t("tokens").copy_(torch.randint(0, cfg.vocab_size, (B,)))
        self.tables = ((torch.arange(B * pps) + 1).view(B, pps)).cuda()
        self.pos = torch.full((B,), context, dtype=torch.int64, device="cuda")
        self.inv = rope_inv_freq(cfg)
        # greedy steps (sampling inputs zero), as validate_planner measures and the planner prices them
        self.ctx = StepCtx(cfg, 0, self.pos, self.tables, self.ps, 1, self.inv.cuda(), kv_len_cap=context + 1,
                           greedy=True)

    def megakernel(self, ops=None, sms=132, trace=0):
        g = self.g.subgraph(ops) if ops else self.g
        tg = build_task_graphs([g], Tiling(num_sms=sms))[0]
        return tg, Megakernel(tg, self.mem, page_size=self.ps, block_tables=self.tables, pos=self.pos,
                              inv_freq=self.inv, head_dim=self.cfg.head_dim, trace_steps=trace)

    def time_mk(self, mk, reps=15) -> float:
        for _ in range(3):
            mk.launch(1)
        torch.cuda.synchronize()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); mk.launch(1); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        mk.check()
        return med(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--name", default="h200_measured")
    ap.add_argument("--model", default="llama-3.2-1b")
    ap.add_argument("--base", default="h200", help="the profile the unmeasured terms come from")
    ap.add_argument("--only", choices=("all", "conv"), default="all",
                    help="conv: measure only the conventional ops' fixed costs (step 4) into a copy of --base")
    a = ap.parse_args()
    base = HardwareProfile.load(a.base)
    prof = json.loads(base.to_json())
    prof["name"] = a.name
    log = {}
    rig = Rig(a.model, 1)
    if a.only == "conv":
        old = dict(prof["conv_fixed_us_by_kind"])
        prof["conv_fixed_us_by_kind"] = {**old, **measure_conv(rig, base, log)}
        log["conv_fixed_us_by_kind_before"] = old
        prof["source"] = (f"{base.name} with conv_fixed_us_by_kind re-measured by scripts/profile_hw.py --only conv on "
                          f"{torch.cuda.get_device_name()} {time.strftime('%Y-%m-%d')} (commit "
                          f"{os.environ.get('GIT_COMMIT', '?')}); before: {json.dumps(old)}")
        write(prof, log, a)
        return
    # 1. streaming bandwidth vs SMs: layer 0's linear weights (qkv + o + gate_up + down) on a k-SM grid
    lin_ops = [o.name for o in rig.g.ops if o.name.startswith("L0.") and o.kind in ("linear",)]
    wbytes = sum(rig.g.tensors[w].nbytes for o in rig.g.ops if o.name in lin_ops for w in o.attrs["weights"])
    bw = {}
    for k in (8, 16, 32, 66, 100, 132):
        tg, mk = rig.megakernel(lin_ops, sms=k)
        us = rig.time_mk(mk)
        bw[str(k)] = wbytes / (us * 1e-6)
        print(f"bw with {k:3d} SMs: {bw[str(k)] / 1e12:.2f} TB/s ({wbytes / 1e6:.1f} MB in {us:.1f} us)", flush=True)
        del mk
    prof["megakernel_linear_bw_by_sms"] = bw  # what our linear tiles achieve (HBM curve itself stays measured raw)
    # 2. megakernel launch: a one-task kernel (embed)
    tg, mk = rig.megakernel(["embed"], sms=132)
    prof["megakernel_launch_us"] = rig.time_mk(mk, reps=50)
    print(f"megakernel launch + drain: {prof['megakernel_launch_us']:.1f} us", flush=True)
    # 3. per-kind task fixed cost and streaming efficiency from a traced full step (batch 1 and 8)
    pts: dict[str, list[tuple[float, float, float]]] = {}
    for B in (1, 8):
        r = rig if B == 1 else Rig(a.model, B)
        tg, mk = r.megakernel(None, sms=132, trace=1)
        step_us = r.time_mk(mk)
        log[f"mono_step_us_b{B}"] = step_us
        mk.launch(1)
        torch.cuda.synchronize()
        tr = mk.chrome_trace()["traceEvents"]
        pts = merge_points(pts, task_points(tr, tg))
        print(f"mono step B={B}: {step_us:.1f} us, {len(tr)} traced tasks", flush=True)
        del mk
    # duration = fixed + bytes * s_b + flops * s_f over both batch sizes (planner/trace_fit.py)
    fixed, eff, fl = fit_task_costs(pts, base.bw(132) / 132 / 1e6)
    for kind in fixed:
        print(f"  {kind:15s} n={len(pts[kind]):5d} fixed {fixed[kind]:6.2f} us  streaming eff {eff[kind]:.2f}  "
              f"{fl[kind] * 1e6:.3f} us/Mflop", flush=True)
    prof["flop_us_by_kind"] = fl
    prof["task_fixed_us_by_kind"], prof["stream_eff_by_kind"] = fixed, eff
    # 4. conventional ops: each op alone in a CUDA graph; fixed cost per kernel sequence, bytes at one bandwidth
    prof["conv_fixed_us_by_kind"] = measure_conv(rig, base, log)
    prof["source"] = (f"measured by scripts/profile_hw.py on {torch.cuda.get_device_name()} {time.strftime('%Y-%m-%d')}"
                      f" (commit {os.environ.get('GIT_COMMIT', '?')}); sync/remote/NCCL terms from the seed profile")
    write(prof, log, a)


def measure_conv(rig: Rig, base: HardwareProfile, log: dict | None = None) -> dict[str, float]:
    """Each op of the first two layers and the step's last two (lm_head, argmax) alone as conventional torch
    kernels in a CUDA graph (greedy steps, as the rig's StepCtx promises): per kernel-sequence key, the median of
    (time - its bytes at the conventional streaming rate). The raw (bytes, us) samples go to log["conv_samples"]
    (to refit offline at another streaming rate)."""
    from mpk_runtime.planner.cost import conv_key
    samples: dict[str, list[tuple[float, float]]] = {}
    for op in rig.g.ops[:40] + rig.g.ops[-2:]:
        ex = ConventionalExecutor([rig.g.subgraph([op.name])], [rig.mem])
        ex.run([rig.ctx]); torch.cuda.synchronize()
        cg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cg):
            for _ in range(10):
                ex.run([rig.ctx])
        ts = []
        for _ in range(10):
            s_, e_ = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s_.record(); cg.replay(); e_.record(); e_.synchronize()
            ts.append(s_.elapsed_time(e_) * 1e3 / 10)
        samples.setdefault(conv_key(op), []).append((float(op.bytes), med(ts)))
    if log is not None:
        log["conv_samples"] = samples
        log["conv_stream_bw"] = base.bw(132) * base.conv_bw_fraction
    stream_us = lambda b: b / (base.bw(132) * base.conv_bw_fraction) * 1e6
    got = {k: max(0.0, med([t - stream_us(b) for b, t in v])) for k, v in samples.items()}
    for k, v in got.items():
        print(f"  conventional {k:14s} fixed {v:7.1f} us (n={len(samples[k])})", flush=True)
    return got


def write(prof: dict, log: dict, a) -> None:
    prof["log"] = log
    path = os.path.join(a.out, f"{a.name}.json")
    with open(path, "w") as f:
        json.dump(prof, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
