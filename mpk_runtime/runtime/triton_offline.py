"""Triton kernels built offline for sm_90 (no GPU needed: Triton brings ptxas and cuobjdump), with the divisibility
the JIT gives 16-aligned pointers and strides on the H200, and what the build says about a launch: registers, stack,
shared memory, SASS, and the CTAs an SM then holds. Used by tests/runtime/test_triton_build.py and
scripts/paged_build_report.py."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

from .triton_support import triton

# the paged attention partial kernel's run-time arguments (runtime/paged_kernels.py), typed as the JIT sees them: an
# int argument below 2^31 is an i32 (the strides here; until session 41 these builds took them as i64)
# bt_ptr: the page tables' type, part of the launch shape since session 43 (PagedAttnConfig.table, int32 where it names
# none; the decode step's int64 tables are copied once a step). Each type is its own build: session 42 found 128
# against 160 registers at llama B=8, 4096 keys (int32 / int64) and 126 against 96 at qwen3-8b B=8 / 128.
def partial_sig(table: str | None = None) -> dict:
    """The partial kernel's signature with page tables of `table` ("i32" / "i64"; None = "i32")."""
    return {**dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", bt_ptr=f"*{table or 'i32'}", pos_ptr="*i64",
                   o_ptr="*fp32", ml_ptr="*fp32", new_ptr="*bf16", scale="fp32", n_blocks="i32"),
            **{n: "i32" for n in ("s_qb", "s_kp", "s_ks", "s_kh", "s_vp", "s_vs", "s_vh", "s_bt", "s_ob", "s_oh",
                                  "s_os", "s_nb")}}


PARTIAL_SIG = partial_sig()

# sm_90 (H100 / H200) per SM: registers, their allocation unit a warp, shared memory (and what each CTA reserves),
# threads, CTAs
SM90 = dict(regs=65536, reg_unit=256, smem=233472, smem_reserved=1024, threads=2048, ctas=32)


@dataclass(frozen=True)
class Build:
    regs: int
    stack: int
    smem: int
    sass: str
    num_warps: int

    def ctas_per_sm(self) -> int:
        """CTAs of this kernel one SM holds at once (the tightest of the four limits)."""
        warp_regs = -(-self.regs * 32 // SM90["reg_unit"]) * SM90["reg_unit"]
        return min(SM90["ctas"], SM90["threads"] // (32 * self.num_warps),
                   SM90["regs"] // (warp_regs * self.num_warps),
                   SM90["smem"] // (self.smem + SM90["smem_reserved"]))


def with_defaults(fn, sig: dict, const: dict) -> dict:
    """const plus the kernel's constexprs it leaves out, at their defaults, as a JIT launch gives them (ASTSource
    would pass None)."""
    return {**{n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
               if p.default is not inspect.Parameter.empty and n not in sig}, **const}


def build_offline(fn, sig: dict, const: dict, num_warps: int = 4, num_stages: int = 3) -> Build:
    """fn compiled for sm_90 with these argument types and constexprs."""
    if triton is None:
        raise RuntimeError("building Triton kernels offline needs Triton (pip install triton)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    const = with_defaults(fn, sig, const)
    sig = {**sig, **{k: "constexpr" for k in const}}
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items()
               if t.startswith("*") or n.startswith("s_") or n.startswith("stride")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=aligned),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    regs, stack = (int(re.search(rf"{w}:(\d+)", usage).group(1)) for w in ("REG", "STACK"))
    return Build(regs, stack, k.metadata.shared, sass, num_warps)


def step_partial_constexprs(D: int, B: int, nq: int, nkv: int, L: int, config, heads: str | None = None) -> dict:
    """The partial kernel's constexprs as a decode step launches it with the defaults (the deferred appends through
    the cache, split rows, the used-splits merge) at B rows of nq / nkv heads of dim D under a cap of L keys with
    launch shape `config` (runtime/paged_attention.launch_shape's rule)."""
    from . import paged_attention as pa
    HG, GP, BN, S = pa.launch_shape(B, nq, nkv, L, config, heads=heads)
    return dict(G=nq // nkv, GP=GP, D=D, PS=16, BLOCK=BN, MULTI=S > 1, NKV=nkv, APPEND=True, ROW_KEYS=2,
                USED=True, APPEND_CACHE=True, HG=HG, IDX_AHEAD=config.idx_ahead)
