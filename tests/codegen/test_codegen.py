"""Codegen: the generated header matches the Python layout; the nvcc cache hits, misses and locks; the real
kernel sources compile for sm_90a where nvcc exists."""
from __future__ import annotations

import multiprocessing as mp
import re
from pathlib import Path

import pytest

from mpk_runtime.codegen import header, layout, nvcc
from mpk_runtime.tasks.ops import OPCODES, TASK_KINDS


def _consts(text: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"constexpr int (\w+) = (-?\d+);", text)}


def test_header_matches_layout():
    c = _consts(header.generate_header())
    for i, op in enumerate(OPCODES):
        assert c[f"OP_{op.upper()}"] == i
    assert c["NUM_OPCODES"] == len(OPCODES)
    assert c["TASK_WORDS"] == layout.TASK_WORDS and c["ARG_BASE"] == layout.ARG_BASE
    for op, args in layout.OP_ARGS.items():
        for a in args:
            assert c[f"A_{op.upper()}_{a.upper()}"] == layout.arg_index(op, a)
    for i, p in enumerate(layout.PARAMS):
        assert c[f"P_{p.upper()}"] == i
    for i, s in enumerate(layout.STATUS):
        assert c[f"S_{s.upper()}"] == i
    for k, v in layout.CONSTANTS.items():
        assert c[k] == v


def test_every_task_kind_has_an_opcode_and_device_file():
    assert set(TASK_KINDS) == set(OPCODES) == set(layout.OP_ARGS)
    ops_dir = nvcc.DEVICE_DIR / "ops"
    cpu_ops = {p.stem for p in (Path(__file__).resolve().parents[2] / "mpk_runtime/tasks/ops").glob("*.py")} - {
        "__init__", "common"}
    device = {p.stem for p in ops_dir.glob("*.cuh")}
    # helpers: a device file that is not an op of its own is included by the op files that use it
    helpers = {h for h in device - cpu_ops
               if any(f'#include "{h}.cuh"' in (ops_dir / f"{o}.cuh").read_text() for o in device & cpu_ops)}
    # (argmax.cuh's candidate selection; attention.cuh's chunk merge; qk_norm.cuh's per-head q / k norm)
    assert helpers == {"sample_select", "attention_merge", "qk_norm"}
    assert device - helpers == cpu_ops


def test_specialisation_constants_reach_header():
    c = _consts(header.generate_header({"UNROLL": 2}))
    assert c["UNROLL"] == 2


def _fake_nvcc(tmp_path: Path, sleep: float = 0.0) -> str:
    """A stand-in nvcc: writes the -o file, counts its invocations, optionally sleeps (for the lock test)."""
    script = tmp_path / "nvcc"
    count = tmp_path / "count"
    script.write_text(f"""#!/usr/bin/env python3
import sys, time, os
if "--version" in sys.argv:
    print("fake nvcc 1.0"); sys.exit(0)
with open({str(count)!r}, "a") as f: f.write("x")
time.sleep({sleep})
out = sys.argv[sys.argv.index("-o") + 1]
open(out, "wb").write(b"CUBIN")
print("ptxas info    : Compiling entry function 'k' for 'sm_90a'")
print("ptxas info    : Used 42 registers, used 1 barriers, 16 bytes smem")
""")
    script.chmod(0o755)
    return str(script)


def _src_tree(tmp_path: Path) -> Path:
    root = tmp_path / "dk"
    (root / "ops").mkdir(parents=True)
    (root / "megakernel.cu").write_text("// kernel\n")
    (root / "ops" / "a.cuh").write_text("// a\n")
    return root


def test_cache_hit_and_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    r1 = nvcc.build(root=root, nvcc=fake)
    assert not r1.cached and r1.cubin.read_bytes() == b"CUBIN"
    assert r1.resources["k"]["registers"] == 42
    assert str(r1.cubin).startswith(str(tmp_path / "cache"))
    r2 = nvcc.build(root=root, nvcc=fake)
    assert r2.cached and r2.key == r1.key
    (root / "ops" / "a.cuh").write_text("// a changed\n")        # any device source changes the key
    r3 = nvcc.build(root=root, nvcc=fake)
    assert not r3.cached and r3.key != r1.key
    r4 = nvcc.build(root=root, nvcc=fake, constants={"UNROLL": 2})  # so does a specialisation constant
    assert not r4.cached and r4.key not in (r1.key, r3.key)
    assert (tmp_path / "count").read_text() == "xxx"
    assert not list((tmp_path / "cache").rglob(".build-*"))       # temp dirs cleaned, outputs renamed in


def test_nvcc_defines_env_keys_the_cache_and_rejects_other_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    r1 = nvcc.build(root=root, nvcc=fake)
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_TC_L2_PF_KB=64 -DMPK_STAGE_WORDS=4")
    r2 = nvcc.build(root=root, nvcc=fake)
    assert not r2.cached and r2.key != r1.key and "-DMPK_TC_L2_PF_KB=64" in r2.log
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-O0")
    with pytest.raises(nvcc.CompileError, match="only -DNAME"):
        nvcc.build(root=root, nvcc=fake)
    monkeypatch.delenv("MPK_NVCC_DEFINES")
    assert nvcc.build(root=root, nvcc=fake).key == r1.key


def test_define_int_reads_the_build_switches(monkeypatch):
    # the host side of a diagnostic switch (MPK_STAGE_WORDS sizes the trace buffer) reads the same variable
    monkeypatch.delenv("MPK_NVCC_DEFINES", raising=False)
    assert nvcc.define_int("MPK_STAGE_WORDS") == 0 and nvcc.define_int("MPK_STAGE_WORDS", 5) == 5
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_TC_L2_PF_KB=64 -DMPK_STAGE_WORDS=12")
    assert nvcc.define_int("MPK_STAGE_WORDS") == 12 and nvcc.define_int("MPK_TC_L2_PF_KB", 0) == 64
    assert nvcc.define_int("MPK_STAGE") == 0     # a prefix of another name is not a match
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_STAGE_WORDS=twelve")
    with pytest.raises(nvcc.CompileError, match="not an integer"):
        nvcc.define_int("MPK_STAGE_WORDS")


def test_attention_shared_memory_fits_one_cta():
    # attention.cuh's layout (two buffers of ATT_KP K/V rows) must fit the 227 KiB a CTA can have, for every
    # head dim the packer accepts, and grow with the head dim
    from mpk_runtime.codegen import layout as L
    C = L.CONSTANTS
    sizes = [L.att_smem_bytes(d) for d in range(8, C["MAX_HEAD_DIM"] + 1, 8)]
    assert max(sizes) <= 227 * 1024 and sizes == sorted(sizes)
    assert L.att_smem_bytes(128) - L.att_smem_bytes(64) == 2 * C["ATT_KP"] * 64 * 2 * 2


def test_cache_warning_is_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    Path(fake).write_text(Path(fake).read_text() + "print('foo.cu(1): warning #177-D: unused')\n")
    with pytest.raises(nvcc.CompileError, match="warn"):
        nvcc.build(root=root, nvcc=fake)
    assert not list((tmp_path / "cache").rglob("*.cubin"))


def _build_in_child(args):
    cache, root, fake = args
    import os
    os.environ["MPK_CACHE_DIR"] = cache
    from mpk_runtime.codegen import nvcc as n
    return n.build(root=Path(root), nvcc=fake).key


def test_concurrent_builds_compile_once(tmp_path):
    fake, root = _fake_nvcc(tmp_path, sleep=0.5), _src_tree(tmp_path)
    with mp.get_context("spawn").Pool(3) as pool:
        keys = pool.map(_build_in_child, [(str(tmp_path / "cache"), str(root), fake)] * 3)
    assert len(set(keys)) == 1
    assert (tmp_path / "count").read_text() == "x"   # the lock made the others wait and hit the cache


@pytest.mark.skipif(nvcc.find_nvcc() is None, reason="nvcc not on PATH: cannot compile device sources")
def test_real_kernel_compiles_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    r = nvcc.build()
    res = r.resources[layout.KERNEL_NAME]
    assert res["spill_stores"] == 0 and res["spill_loads"] == 0
    assert res["registers"] <= 65536 // layout.CONSTANTS["THREADS"]
    assert r.cubin.stat().st_size > 0


def test_linear_tensor_core_geometry():
    """Which linear tiles run on Tensor Cores and with how many rows per pass (weights stream once per pass)."""
    from mpk_runtime.codegen.layout import SMEM_BUDGET, linear_geometry as geo
    assert geo(1, 2048, 16, 1, 1)[0] == 0                     # batch 1: CUDA cores
    assert geo(2, 2048, 16, 1, 1)[0] == 0
    assert geo(8, 2048, 64, 2, 1)[0] == 8                     # gate_up at batch 8: one pass
    assert geo(32, 2048, 16, 1, 1)[0] == 32                   # o_proj at batch 32: one pass of 32 rows
    assert geo(128, 8192, 16, 1, 1)[0] == 8                   # down (K=8192): only 8 rows of x fit
    assert geo(16, 2048, 16, 1, 3)[0] == 0                    # K not in 32-wide rounds per segment
    for M in (3, 8, 13, 32, 128):
        for K, w, nw in ((2048, 972, 1), (4096, 1151, 1), (12288, 32, 1), (2048, 64, 2), (4096, 96, 2)):
            rows, need = geo(M, K, w, nw, 1)
            assert need <= 227 * 1024 and (rows == 0 or need <= SMEM_BUDGET)
            assert rows in (0, 8, 16, 32)


@pytest.mark.parametrize("defines,spills_refused", [("", True), ("-DMPK_ATT_STAGES=3", True), ("-DMPK_STAGE_WORDS=12", False),
                                                    ("-DMPK_PDL=1", True)])
def test_spills_are_refused_except_in_the_diagnostic_builds(monkeypatch, defines, spills_refused):
    """ptxas's spill warning (an error under --Werror) guards every build but the stage-stamp builds (the stamps
    take registers)."""
    monkeypatch.setenv("MPK_NVCC_DEFINES", defines)
    flags = nvcc.build_flags()
    assert ("-warn-spills" in flags) == spills_refused
    assert "--Werror" in flags and defines.split() == [f for f in flags if f.startswith("-D")]



def test_ptxas_summary_keeps_the_kernels_own_spills_apart_from_its_callees():
    """The entry function's stack and spills are its own; the out-of-line functions reported after it (each under
    its own "Function properties" line) must not overwrite them (they did: a 20-byte spill in mpk_megakernel read
    as 0 because a callee without spills came last); theirs are summed apart."""
    log = "\n".join([
        "ptxas info    : Compiling entry function 'mpk_megakernel' for 'sm_90a'",
        "ptxas info    : Function properties for mpk_megakernel",
        "    136 bytes stack frame, 20 bytes spill stores, 24 bytes spill loads",
        "ptxas info    : Used 255 registers, used 1 barriers, 136 bytes cumulative stack size, 1904 bytes smem",
        "ptxas info    : Function properties for _ZN3mpk8op_smallERKNS_3CtxE",
        "    0 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads",
        "ptxas info    : Function properties for _ZN3mpk12op_linear_tcERKNS_3CtxE",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Compiling entry function 'other' for 'sm_90a'",
        "ptxas info    : Function properties for other",
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
        "ptxas info    : Used 40 registers, 0 bytes smem"])
    res = nvcc.parse_ptxas(log)
    assert res["mpk_megakernel"] == {"stack": 136, "spill_stores": 20, "spill_loads": 24, "registers": 255,
                                     "smem": 1904, "callee_spill_stores": 8}
    assert res["other"]["spill_stores"] == 0 and res["other"]["registers"] == 40


def test_pf_cur_kb_sets_the_headers_prefetch_size_and_refuses_bad_values():
    """$MPK_PF_CUR_KB (the L2 prefetch before a task's waits, gpu_pending.sh ab variants pf0 / pf32 / pf128) is read
    when layout is imported: it becomes the generated header's PF_CUR in bytes (a different header, so a different
    cache entry), unset is 64 KiB (the default since session 46), 0 turns it off, and a value that is not 0-4096 KiB is
    refused with what it takes."""
    import os
    import subprocess
    import sys
    code = ("from mpk_runtime.codegen import header; "
            "print([l for l in header.generate_header().splitlines() if 'PF_CUR' in l][0])")
    root = Path(__file__).resolve().parents[2]

    def run(val):
        env = {k: v for k, v in os.environ.items() if k != "MPK_PF_CUR_KB"}
        if val is not None:
            env["MPK_PF_CUR_KB"] = val
        return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)

    dflt, off, big = run(None), run("0"), run("128")
    assert dflt.returncode == 0 and off.returncode == 0 and big.returncode == 0, dflt.stderr + off.stderr + big.stderr
    assert "65536" in dflt.stdout and "131072" in big.stdout and "65536" not in off.stdout and " 0" in off.stdout
    bad = run("lots")
    assert bad.returncode != 0 and "MPK_PF_CUR_KB='lots': expected kilobytes" in bad.stderr
    assert "expected 0-4096 KiB" in run("5000").stderr


def test_long_input_rows_in_chunks_only_where_whole_rows_fit_nowhere():
    """layout.linear_tile: a Tensor Core tile whose whole input rows fit no layout (K past ~14k at 8 rows: the down
    projections of llama-3.1-8b, qwen3-14b / 32b, qwen2.5-7b) holds them in the fewest chunks of 32-wide rounds that
    fit; every tile that fits today (every linear op of the presets at batch 1-128 that launches) keeps whole rows."""
    from mpk_runtime.codegen import layout as L
    from mpk_runtime.ir.build import build_graph
    from mpk_runtime.models import PRESETS
    for K, want in ((14336, 2), (17408, 2), (18944, 2), (25600, 4), (28672, 4)):
        for M in (3, 8, 32, 128):
            for w, nw in ((32, 1), (64, 1), (64, 2)):
                rows, need, chunks = L.linear_tile(M, K, w, nw, 1)
                assert chunks == want and rows in (8, 16, 32) and need <= L.SMEM_BUDGET, (K, M, w, nw)
                assert K % (32 * chunks) == 0
                assert L.linear_geometry(M, K // chunks, w, nw, 1) == (rows, need)
        assert L.linear_tile(2, K, 32, 1, 1)[2] == 1      # below TC_MIN_M rows: its own rows only, whole
        assert L.linear_tile(8, K, 32, 1, 2)[2] == 1      # K segments (tp_invariant): no chunks
    for name, cfg in PRESETS.items():
        g = build_graph(cfg.replace(num_layers=1), batch=8, context_len=64)
        for o in g.ops:
            if o.kind != "linear":
                continue
            M, K = g.tensors[o.attrs["out"]].shape[-2], g.tensors[o.attrs["x"]].shape[1]
            for w in (16, 32, 64, 128):
                rows, need, chunks = L.linear_tile(M, K, w, len(o.attrs["weights"]), 1)
                whole = L._tile_geometry(M, K, w, len(o.attrs["weights"]), 1)[1]   # whole input rows
                assert (chunks > 1) == (whole > L.ATT_SMEM_MAX and M >= L.CONSTANTS["TC_MIN_M"]), (name, o.name, w)
