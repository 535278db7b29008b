#!/usr/bin/env python3
"""In-kernel all-reduce latency (device_kernels/bench_allreduce.cu: the megakernel's push + signal_counter +
system-scope acquire + rank-ordered sum, through nvshmem_ptr peer addresses; and the LL protocol, a flag in every
8 bytes and no counter, as a candidate) vs torch.distributed NCCL all_reduce, eager and inside a CUDA graph, in the
same run on two GPUs (one process per GPU, tp_launch).

Sizes are the all-reduced tensor's bytes in bf16 (as NCCL is called); the in-kernel path moves fp32 partials,
as the megakernel does (2x the bytes). In-kernel latency = (globaltimer at the last iteration's end - at the first
iteration's end) / (iters - 1) on CTA 0, each iteration depending on the previous one's result.

    PYTHONPATH=. python3 scripts/bench_allreduce.py      -> $OUT/bench_allreduce.json
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.update({"NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"})

OUT = Path(os.environ.get("OUT") or "gpu_out")
SIZES = [4 << 10, 8 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]


def _kernel():
    from mpk_runtime.codegen import nvcc
    from mpk_runtime.runtime.megakernel import _check, _cu
    cu = _cu()
    import torch
    torch.cuda.init()
    b = nvcc.build(source="bench_allreduce.cu")
    _check(cu.cuInit(0), "cuInit")
    mod = _check(cu.cuModuleLoadData(Path(b.cubin).read_bytes()), "cuModuleLoadData")
    fn = _check(cu.cuModuleGetFunction(mod, b"mpk_bench_allreduce"), "cuModuleGetFunction")
    fn_ll = _check(cu.cuModuleGetFunction(mod, b"mpk_bench_allreduce_ll"), "cuModuleGetFunction")
    return cu, mod, fn, fn_ll


def rank_main(ctx, iters):
    import torch
    from mpk_runtime.codegen import layout as L
    from mpk_runtime.runtime.megakernel import _check
    heap, rank, W = ctx.heap(), ctx.rank, ctx.nranks
    cu, mod, fn, fn_ll = _kernel()
    dev = torch.device("cuda", rank)
    res = []
    nmax = max(SIZES) // 2
    buf = heap.tensor((2, W, nmax), torch.float32)          # parity x slot x elements (fp32 partials)
    ctr = heap.tensor((256,), torch.int64)                  # one counter per CTA, never reset
    peers = torch.tensor(heap.peer_ptrs(buf), dtype=torch.int64, device=dev)
    cpeers = torch.tensor(heap.peer_ptrs(ctr), dtype=torch.int64, device=dev)
    status = torch.zeros(1, dtype=torch.int64, device=dev)
    times = torch.zeros(2, dtype=torch.int64, device=dev)
    x = torch.randn(nmax, device=dev)
    out = torch.zeros(nmax, device=dev)
    dist = ctx.dist()
    stream = torch.cuda.current_stream(dev)
    # LL: (value, flag) pairs, parity x slot x elements x 2 words; flags are step numbers, never reused
    llbuf = heap.tensor((2, W, nmax, 2), torch.float32)
    llbuf.zero_()
    llpeers = torch.tensor(heap.peer_ptrs(llbuf), dtype=torch.int64, device=dev)
    ll_step = [1]
    ll_types = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p)

    def run_ll(n, grid, chunk, k):
        heap.barrier()
        args = ((llpeers.data_ptr(), x.data_ptr(), out.data_ptr(), n, chunk, W, rank, k, ll_step[0], W * nmax * 8,
                 int(2e9), status.data_ptr(), times.data_ptr()), ll_types)
        ll_step[0] += k
        _check(cu.cuLaunchKernel(fn_ll, grid, 1, 1, L.CONSTANTS["THREADS"], 1, 1, 0, cu.CUstream(stream.cuda_stream),
                                 args, 0), "cuLaunchKernel")
        torch.cuda.synchronize(dev)
        if int(status.item()) != 0:
            raise RuntimeError(f"LL all-reduce timed out (n={n}, grid={grid})")
        t = times.cpu().tolist()
        return (t[1] - t[0]) / max(1, k - 1) / 1e3

    for nbytes in SIZES:
        n = nbytes // 2
        ll_best = None
        for grid in sorted({max(1, min(132, n // 2048)), max(1, min(132, n // 512)), min(132, max(1, n // 8192))}):
            chunk = -(-(-(-n // grid)) // 2) * 2
            grid = -(-n // chunk)
            x[:n].copy_(torch.randn(n, device=dev))
            us = sorted(run_ll(n, grid, chunk, iters) for _ in range(3))[1]
            if ll_best is None or us < ll_best[0]:
                ll_best = (us, grid, chunk)
        best = None
        for grid in sorted({max(1, min(132, n // 2048)), max(1, min(132, n // 512)), min(132, max(1, n // 8192))}):
            chunk = -(-n // grid)
            chunk = -(-chunk // 4) * 4
            grid = -(-n // chunk)
            par_stride = W * nmax * 4
            # sanity: one iteration from a known input must give sum over ranks * 0.5
            lat = []
            for rep in range(3):
                ctr.zero_()      # no kernel in flight on either rank here (the barrier syncs both devices)
                heap.barrier()
                args = ((peers.data_ptr(), cpeers.data_ptr(), x.data_ptr(), out.data_ptr(), n, chunk, W, rank, iters,
                         1, par_stride, int(2e9), status.data_ptr(), times.data_ptr()),
                        (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                         ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64,
                         ctypes.c_void_p, ctypes.c_void_p))
                _check(cu.cuLaunchKernel(fn, grid, 1, 1, L.CONSTANTS["THREADS"], 1, 1, 0,
                                         cu.CUstream(stream.cuda_stream), args, 0), "cuLaunchKernel")
                torch.cuda.synchronize(dev)
                if int(status.item()) != 0:
                    raise RuntimeError(f"bench all-reduce timed out (n={n}, grid={grid})")
                t = times.cpu().tolist()
                lat.append((t[1] - t[0]) / (iters - 1) / 1e3)
            us = sorted(lat)[1]
            if best is None or us < best[0]:
                best = (us, grid)
        # correctness of one all-reduce (x differs per rank): out = 0.5 * sum_r x_r, checked against NCCL
        xr = torch.randn(n, device=dev) * (rank + 1)
        x[:n].copy_(xr)
        grid = best[1]
        chunk = -(-(-(-n // grid)) // 4) * 4
        grid = -(-n // chunk)
        args = ((peers.data_ptr(), cpeers.data_ptr(), x.data_ptr(), out.data_ptr(), n, chunk, W, rank, 1, 1,
                 W * nmax * 4, int(2e9), status.data_ptr(), times.data_ptr()),
                (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                 ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64,
                 ctypes.c_void_p, ctypes.c_void_p))
        ctr.zero_()
        heap.barrier()
        _check(cu.cuLaunchKernel(fn, grid, 1, 1, L.CONSTANTS["THREADS"], 1, 1, 0, cu.CUstream(stream.cuda_stream),
                                 args, 0), "cuLaunchKernel")
        torch.cuda.synchronize(dev)
        ref = xr.clone()
        dist.all_reduce(ref)
        err = (out[:n] - 0.5 * ref).abs().max().item()
        run_ll(n, ll_best[1], ll_best[2], 1)   # one LL all-reduce of the same input
        ll_err = (out[:n] - 0.5 * ref).abs().max().item()
        # NCCL eager and in a CUDA graph (bf16, same element count)
        t = torch.randn(n, device=dev, dtype=torch.bfloat16)
        for _ in range(5):
            dist.all_reduce(t)
        torch.cuda.synchronize(dev)
        dist.barrier()
        k = 100
        t0 = time.perf_counter()
        for _ in range(k):
            dist.all_reduce(t)
        torch.cuda.synchronize(dev)
        eager = (time.perf_counter() - t0) / k * 1e6
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream(dev)
        s.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(s):
            dist.all_reduce(t)
            torch.cuda.synchronize(dev)
            kg = 20
            with torch.cuda.graph(g, stream=s):
                for _ in range(kg):
                    dist.all_reduce(t)
        torch.cuda.synchronize(dev)
        g.replay(); torch.cuda.synchronize(dev)
        gl = []
        for _ in range(5):
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); b.record(); b.synchronize()
            gl.append(a.elapsed_time(b) * 1e3 / kg)
        graph_us = sorted(gl)[2]
        r = dict(bytes_bf16=nbytes, elems=n, in_kernel_us=best[0], in_kernel_grid=best[1], in_kernel_iters=iters,
                 in_kernel_max_abs_err_vs_nccl=err, ll_us=ll_best[0], ll_grid=ll_best[1], ll_max_abs_err_vs_nccl=ll_err,
                 nccl_eager_us=eager, nccl_cuda_graph_us=graph_us)
        if rank == 0:
            print(json.dumps(r), flush=True)
        res.append(r)
        del g
    return res


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    from mpk_runtime.runtime import tp_launch
    iters = int(os.environ.get("BENCH_ITERS", "2000"))
    res = tp_launch.run(rank_main, 2, (iters,), timeout_s=float(os.environ.get("BENCH_TIMEOUT", "240")))[0]
    import torch
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, time=time.ctime(),
                note="in-kernel: fp32 partials pushed through nvshmem_ptr peer stores + red.release.sys counters; "
                     "LL: (fp32, step flag) pairs in 16-byte volatile peer stores, receiver polls the flags; "
                     "NCCL: bf16 all_reduce, eager back-to-back and 20 per CUDA graph replay")
    (OUT / "bench_allreduce.json").write_text(json.dumps({"meta": meta, "results": res}, indent=1))
    print(f"{'bytes':>9} {'in-kernel us':>12} {'grid':>5} {'LL us':>7} {'grid':>5} {'NCCL eager':>10} {'NCCL graph':>10}")
    for r in res:
        print(f"{r['bytes_bf16']:>9} {r['in_kernel_us']:>12.2f} {r['in_kernel_grid']:>5} {r['ll_us']:>7.2f} "
              f"{r['ll_grid']:>5} {r['nccl_eager_us']:>10.1f} {r['nccl_cuda_graph_us']:>10.1f}")


if __name__ == "__main__":
    main()
