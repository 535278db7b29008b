"""Host side of the GPU megakernel: pack one rank's TaskGraph + CUDA RankMemory into device arrays (packer.py), launch
the persistent kernel (cuda.bindings driver API, torch's current stream), surface timeouts, export traces.

Counters are allocated once and never reset: `steps_done` is the host's global step count (as PyVM's), and a
launch runs steps [steps_done + 1, steps_done + nsteps]. CUDA / cuda-python are imported lazily.
"""
from __future__ import annotations

import ctypes
import json
from pathlib import Path

import torch

from ..codegen import layout as L
from ..envflags import env_flag, env_int, kernel_timeout_s
from ..tasks.graph import TaskGraph
from .base import KernelTimeout
from .memory import RankMemory
from .packer import L_OPCODE, SMEM_BUDGET, PeerTable, TaskPacker, f32_bits  # noqa: F401  (re-exported)


def _cu():
    try:
        from cuda.bindings import driver
    except ImportError:  # older cuda-python layout
        from cuda import cuda as driver  # type: ignore
    return driver


def launch_config(grid: int, threads: int, smem: int, stream, pdl: bool):
    """cuLaunchKernelEx's config for a 1-D grid; pdl: the programmatic-stream-serialization attribute (the launch
    may begin before the previous kernel on the stream has finished; the kernel's griddepcontrol.wait orders it)."""
    cu = _cu()
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid, 1, 1
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
    cfg.sharedMemBytes, cfg.hStream = smem, stream
    attrs = []
    if pdl:
        a = cu.CUlaunchAttribute()
        a.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        a.value.programmaticStreamSerializationAllowed = 1
        attrs.append(a)
    cfg.attrs, cfg.numAttrs = attrs, len(attrs)
    return cfg


def _check(res, what: str):
    cu = _cu()
    err = res[0] if isinstance(res, tuple) else res
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err}")
    if isinstance(res, tuple):
        return res[1] if len(res) == 2 else res[1:]
    return None


def load_module(cubin, device_index: int = 0):
    """(cuda driver module, CUmodule): a cubin loaded into the device's primary context, which is made current on
    this thread if no context is (the megakernel, and the micro-benchmarks' kernels in scripts/)."""
    cu = _cu()
    torch.cuda.init()
    _check(cu.cuInit(0), "cuInit")
    ctx = _check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        d = _check(cu.cuDeviceGet(device_index), "cuDeviceGet")
        _check(cu.cuCtxSetCurrent(_check(cu.cuDevicePrimaryCtxRetain(d), "cuDevicePrimaryCtxRetain")), "cuCtxSetCurrent")
    return cu, _check(cu.cuModuleLoadData(Path(cubin).read_bytes()), "cuModuleLoadData")


class Megakernel:
    """One rank's compiled + packed megakernel. `launch(nsteps)` runs steps steps_done+1 .. steps_done+nsteps."""

    def __init__(self, tg: TaskGraph, mem: RankMemory, *, page_size: int, block_tables: torch.Tensor,
                 pos: torch.Tensor, inv_freq: torch.Tensor, head_dim: int, timeout_s: float | None = None,
                 trace_steps: int = 0, build_result=None, peers: PeerTable | None = None,
                 counters: torch.Tensor | None = None, stage_smem: int | None = None):
        """World size > 1: `counters` (int64, >= len(tg.events) + 1 words, zeroed, on the symmetric heap) and
        `peers` (their and the symmetric buffers' peer addresses) come from runtime.nvshmem.SymmetricHeap."""
        from ..codegen import nvcc
        self.tg, self.mem = tg, mem
        dev = mem.t("tokens").device
        assert dev.type == "cuda", "Megakernel needs a RankMemory on a CUDA device"
        self.device = dev
        self.steps_done = 0
        if counters is None:
            counters = torch.zeros(len(tg.events) + 1, dtype=torch.int64, device=dev)  # never reset
        elif counters.numel() < len(tg.events) + 1 or counters.dtype != torch.int64:
            raise ValueError(f"counters: need >= {len(tg.events) + 1} int64 words, got {counters.numel()} {counters.dtype}")
        self.counters = counters
        self.status = torch.zeros(len(L.STATUS), dtype=torch.int64, device=dev)
        self.pos, self.block_tables = pos, block_tables            # (B,) int64, (B, max_pages) int64 on dev
        self.inv_freq = inv_freq.to(device=dev, dtype=torch.float32).contiguous()
        self.trace_steps = trace_steps
        # a diagnostic build (-DMPK_STAGE_WORDS=K) writes K stage stamps per task after the start/end words
        self.stage_words = nvcc.define_int("MPK_STAGE_WORDS", 0)
        self.trace = torch.zeros(max(trace_steps, 1) * len(tg.tasks) * (2 + self.stage_words), dtype=torch.int64,
                                 device=dev)
        packer = TaskPacker(tg, mem, self.counters.data_ptr(), head_dim, peers=peers, device=dev,
                            stage_smem=stage_smem)
        tasks, waits, signals, offs, flat = packer.pack()
        self._keep = packer._peer_arrays
        self.tickets = packer.tickets   # folded attention merges' counters (zeroed here, never reset, as counters)
        self.prefetch = packer.prefetch.to(dev)
        self.tasks, self.waits, self.signals = tasks.to(dev), waits.to(dev), signals.to(dev)
        self.sm_offsets, self.sm_tasks = offs.to(dev), flat.to(dev)
        self.staged_bytes = packer.staged_bytes   # weight bytes copied into shared memory during waits, per step
        self.stage_info = packer.stage_info
        # MPK_SMEM_FLOOR_KB (diagnostic): launch with at least this much dynamic shared memory (a smaller L1)
        self.smem = max(packer.smem, 1024, env_int("MPK_SMEM_FLOOR_KB", 0, lo=0, hi=227) * 1024)
        self.timeout_ns = int(kernel_timeout_s(timeout_s) * 1e9)   # None: $MPK_KERNEL_TIMEOUT_S, else 2 s
        # MPK_MK_PDL=1: programmatic dependent launches (launch()); the build carries -DMPK_PDL=1 (needs, below)
        self.pdl = env_flag("MPK_MK_PDL")
        self.params = torch.zeros(len(L.PARAMS), dtype=torch.int64, device=dev)
        self._write_params()
        # the defines the packed tasks and the launch mode rely on: a build of its own has them (only these, so a
        # graph without e.g. q / k head norms runs the kernel without that path); a given build_result (it may come
        # from another environment) is checked: without them the kernel would ignore them silently
        needs = {**packer.needs, **({"MPK_PDL": (
            "MPK_MK_PDL=1 launches the kernel before the previous one has finished, which needs the kernel's wait: "
            "its launches", "drop -DMPK_PDL=0 from MPK_NVCC_DEFINES, build the kernel given in build_result under "
            "MPK_MK_PDL=1, or unset MPK_MK_PDL")} if self.pdl else {})}
        self.build = build_result or nvcc.build(needs=needs)
        nvcc.check_defines(self.build.flags, needs)
        static = int(self.build.resources.get(L.KERNEL_NAME, {}).get("smem", 0))
        if self.smem + static > L.SMEM_PER_CTA:   # (cuFuncSetAttribute would refuse it with a bare error)
            need, op, kind = packer.largest
            fix = (f"{op} keeps its input rows whole in shared memory, too many bytes at this batch: run it outside "
                   "the megakernel (plan='auto' does: the planner keeps such ops out, planner/feasible.py) or decode "
                   f"fewer than {L.CONSTANTS['TC_MIN_M']} sequences a step"
                   if kind in ("linear", "qkv_rope") and need + static > L.SMEM_PER_CTA
                   else "fewer attention stages or groups (MPK_NVCC_DEFINES, MPK_ATT_GROUPS), a smaller MPK_STAGE_KB, "
                   "or a lower ROW_TILE")
            raise ValueError(f"megakernel needs {self.smem} B of dynamic + {static} B of static shared memory per CTA "
                             f"(> {L.SMEM_PER_CTA} B; its largest task, {op} ({kind}), {need} B): {fix}")
        self._load()

    def _write_params(self):
        v = dict(tasks=self.tasks.data_ptr(), sm_offsets=self.sm_offsets.data_ptr(),
                 sm_tasks=self.sm_tasks.data_ptr(), waits=self.waits.data_ptr(), signals=self.signals.data_ptr(),
                 counters=self.counters.data_ptr(), status=self.status.data_ptr(),
                 trace=self.trace.data_ptr() if self.trace_steps else 0, trace_steps=self.trace_steps,
                 pos=self.pos.data_ptr(), block_tables=self.block_tables.data_ptr(),
                 max_pages=self.block_tables.shape[1], page_size=self.mem.kvstore.page_size,
                 inv_freq=self.inv_freq.data_ptr(), timeout_ns=self.timeout_ns, num_tasks=len(self.tg.tasks),
                 batch=self.pos.shape[0], num_sms=self.tg.num_sms, prefetch=self.prefetch.data_ptr())
        self.params.copy_(torch.tensor([v[k] for k in L.PARAMS], dtype=torch.int64))

    def _load(self):
        cu, self._module = load_module(self.build.cubin, self.device.index or 0)
        self._fn = _check(cu.cuModuleGetFunction(self._module, L.KERNEL_NAME.encode()), "cuModuleGetFunction")
        _check(cu.cuFuncSetAttribute(self._fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     self.smem), "cuFuncSetAttribute")
        occ = _check(cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(self._fn, L.CONSTANTS["THREADS"], self.smem),
                     "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        nsm = torch.cuda.get_device_properties(self.device).multi_processor_count
        self.occupancy = int(occ)
        if occ < 1 or self.tg.num_sms > nsm * occ:
            raise RuntimeError(f"megakernel cannot be co-resident: grid {self.tg.num_sms} CTAs, {nsm} SMs x {occ} "
                               f"CTA/SM ({self.smem} B smem, {L.CONSTANTS['THREADS']} threads); build the TaskGraph "
                               f"for at most {nsm * occ} SMs")

    def launch(self, nsteps: int = 1) -> None:
        """Enqueue one launch of nsteps steps on torch's current stream (asynchronous). With MPK_MK_PDL=1 (a
        build with -DMPK_PDL=1) it is a programmatic dependent launch: the grid may start while the previous kernel
        on the stream drains, and waits for its writes after the prologue (megakernel.cu)."""
        cu = _cu()
        stream = cu.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        first = self.steps_done + 1
        args = ((self.params.data_ptr(), first, nsteps), (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int))
        if self.pdl:
            cfg = launch_config(self.tg.num_sms, L.CONSTANTS["THREADS"], self.smem, stream, pdl=True)
            _check(cu.cuLaunchKernelEx(cfg, self._fn, args, 0), "cuLaunchKernelEx")
        else:
            _check(cu.cuLaunchKernel(self._fn, self.tg.num_sms, 1, 1, L.CONSTANTS["THREADS"], 1, 1, self.smem,
                                     stream, args, 0), "cuLaunchKernel")
        self.steps_done += nsteps

    def check(self, status: torch.Tensor | None = None) -> None:
        """Synchronise and raise KernelTimeout naming the task if any SM's wait timed out. status: a host copy of
        the status words taken after the launches in question (a burst's, read when the burst is; the device's
        words may already be a later launch's)."""
        st = (self.status if status is None else status).cpu().tolist()
        s = dict(zip(L.STATUS, st))
        if s["flag"] != L.STATUS_OK:
            t = self.tg.tasks[s["task"]]
            raise KernelTimeout(
                f"megakernel wait timed out after {s['elapsed_ns'] / 1e9:.3f}s: SM {s['sm']} step {s['step']}: "
                f"{t.label()} waits on event {s['event']} (counter {s['counter']}, needed {s['needed']}); "
                f"the kernel exited, counters are now inconsistent: rebuild the Megakernel")

    def trace_times(self) -> torch.Tensor:
        """(trace_steps, tasks, 2) globaltimer start / end of each task in the traced steps of the last launch (the
        first words of the trace buffer; a stage-stamp build's rows follow them), on the CPU."""
        nt = len(self.tg.tasks)
        return self.trace[:self.trace_steps * nt * 2].view(self.trace_steps, nt, 2).cpu()

    def stage_stamps(self) -> torch.Tensor:
        """(trace_steps, tasks, K) globaltimer stamps of a -DMPK_STAGE_WORDS=K build (0 where not reached); the
        last two words of a task are 'op done, all threads' and 'signals issued' (megakernel.cu), the others the
        MPK_STAMP points of its op (device_kernels/ops)."""
        nt, k = len(self.tg.tasks), self.stage_words
        if k == 0 or self.trace_steps == 0:
            raise ValueError("stage stamps need a build with MPK_NVCC_DEFINES=-DMPK_STAGE_WORDS=K and trace_steps > 0")
        base = self.trace_steps * nt * 2
        return self.trace[base:base + self.trace_steps * nt * k].view(self.trace_steps, nt, k).cpu()

    def chrome_trace(self, path: str | None = None) -> dict:
        """Per-task globaltimer start/end of the first trace_steps steps of the last launch, as Chrome trace JSON."""
        tr = self.trace_times()
        t0 = int(tr[tr > 0].min()) if (tr > 0).any() else 0
        ev = []
        for k in range(self.trace_steps):
            for t in self.tg.tasks:
                a, b = int(tr[k, t.id, 0]), int(tr[k, t.id, 1])
                if a and b:
                    ev.append({"name": t.kind, "cat": t.op, "ph": "X", "ts": (a - t0) / 1e3, "dur": (b - a) / 1e3,
                               "pid": self.tg.rank, "tid": t.sm, "args": {"label": t.label(), "step": k}})
        d = {"traceEvents": ev, "displayTimeUnit": "ns"}
        if path:
            Path(path).write_text(json.dumps(d))
        return d
