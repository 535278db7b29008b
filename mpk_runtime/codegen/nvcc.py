"""nvcc driver with a content-addressed cache (FlashInfer jit/ style).

Key = sha256 over: every file under device_kernels/ (path + bytes), the generated header, the arch, the
specialisation constants, the flags and `nvcc --version`. Outputs live in `$MPK_CACHE_DIR` (default
~/.cache/mpk_runtime/) under `<key>/`; an fcntl lock per key makes concurrent builds safe, and outputs are
written to a temp name and renamed into place, so a reader never sees a half-written cubin.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .header import HEADER_NAME, generate_header
from .layout import CONSTANTS

DEVICE_DIR = Path(__file__).resolve().parents[2] / "device_kernels"
ARCH = "sm_90a"
GENCODE = "-gencode=arch=compute_90a,code=sm_90a"
BASE_FLAGS = ["-O3", "-lineinfo", "-std=c++17", "-Xptxas", "-v", "--Werror", "all-warnings",
              "-Xptxas", "-warn-spills", "-Xcompiler", "-Wall"]
MAIN_SOURCE = "megakernel.cu"


class CompileError(RuntimeError):
    """nvcc failed or warned; the message holds its full output."""


def cache_dir() -> Path:
    return Path(os.environ.get("MPK_CACHE_DIR") or Path.home() / ".cache" / "mpk_runtime")


def find_nvcc() -> str | None:
    p = shutil.which("nvcc")
    if p:
        return p
    for c in ("/usr/local/cuda/bin/nvcc",):
        if os.path.exists(c):
            return c
    return None


_NVCC_VERSION: dict[str, str] = {}


def nvcc_version(nvcc: str) -> str:
    if nvcc not in _NVCC_VERSION:
        _NVCC_VERSION[nvcc] = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    return _NVCC_VERSION[nvcc]


def device_sources(root: Path = DEVICE_DIR) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix in (".cu", ".cuh", ".h") and p.is_file())


@dataclass
class BuildResult:
    cubin: Path
    log: str                     # nvcc / ptxas output (registers, smem, spills)
    key: str
    cached: bool
    seconds: float = 0.0
    resources: dict = field(default_factory=dict)
    flags: list = field(default_factory=list)   # the nvcc flags of this build (the -D switches among them)


def cache_key(header: str, constants: dict, flags: list[str], nvcc_ver: str, root: Path = DEVICE_DIR,
              source: str = MAIN_SOURCE) -> str:
    h = hashlib.sha256()
    for p in device_sources(root):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(header.encode())
    h.update(json.dumps({"arch": ARCH, "gencode": GENCODE, "constants": constants, "flags": flags,
                         "source": source}, sort_keys=True).encode())
    h.update(nvcc_ver.encode())
    return h.hexdigest()[:32]


def parse_ptxas(log: str) -> dict:
    """Registers / shared memory / spills of each kernel from `-Xptxas -v`: stack and spills are the entry
    function's own ("Function properties for <kernel>"); the out-of-line functions compiled with it follow, each
    under its own "Function properties" line, and their spill stores are summed into `callee_spill_stores`."""
    import re
    res, cur, props = {}, None, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            cur = m.group(1)
            res[cur] = {"callee_spill_stores": 0}
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            props = m.group(1)
        if cur is None:
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            res[cur]["registers"] = int(m.group(1))
        m = re.search(r"(\d+) bytes smem", line)
        if m:
            res[cur]["smem"] = int(m.group(1))
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            if props == cur:
                res[cur].update(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
            else:
                res[cur]["callee_spill_stores"] += int(m.group(2))
    return res


# Compile-time switches measured and removed from the device code (docs/perf-notes.md): name -> (the value the code
# now always has, why), so an old A/B script asking for the other side is told rather than silently building the
# default. Asking for the value the code has is harmless.
REMOVED_DEFINES = {
    "MPK_ATT_SWIZZLE": (0, "swizzled unpadded K/V rows, +3..+19% on llama-3.2-1b, session 21"),
    "MPK_ATT_ISSUE_UNROLL": (0, "the unrolled copy-issue loop, +1..+1.5% with pv1 and exp2, session 20"),
    "MPK_ATT_EXP2": (0, "exp2f scores, +1..+1.5% with pv1 and the unroll, session 20"),
    "MPK_ATT_LEAN_PASS": (0, "full attention passes without key masks, +0.5 / +0.9% at llama B=32 / 128 ctx 4096, "
                             "session 23"),
    "MPK_ATT_ST": (0, "attention scores as K Q^T, -0.7 / +0.2% at llama B=32 / 128 ctx 4096, session 23"),
    "MPK_ATT_GW": (1, "=0 ran a task's KV groups one after another: +4.7..+6.2% at llama / qwen3-8b B=128 ctx 512 "
                      "against side by side, session 24"),
    "MPK_LIN_EARLY": (0, "batch-1 tiles issuing their first weight round before x, +4.2% / +2.3% at llama-3.2-1b / "
                         "qwen3-8b B=1 ctx 512, session 25"),
    "MPK_B1_PREWAIT": (0, "batch-1 CUDA-core tiles issuing their first weight round (4 or 7 of 8 vectors a lane) before "
                          "their waits, polled inside the op: +3.2..+4.5% at llama-3.2-1b, +3.0..+4.0% at qwen3-8b B=1 "
                          "ctx 512 on an H100, session 70 (bench/results/s70/b1_prewait_nospill.patch)"),
    "MPK_B1_PREWAIT_UN": (0, "the vectors MPK_B1_PREWAIT issued early; removed with it in session 70"),
    "MPK_WRING": (0, "per-warp weight page rings for batch-1 tiles: no gain in any layout tried, llama-3.2-1b B=1 "
                     "-0.2% at best and up to +97%, sessions 28-32"),
    "MPK_RING_SLOT": (4096, "the page rings' slot size; the rings were removed in session 32"),
    "MPK_ATT_QKN_JOINT": (0, "Qwen3's q and k heads normed in one call, one barrier: +0.7% / +1.0..1.5% at qwen3-8b "
                             "B=1 / 8 ctx 512, the attention phase unchanged, session 34"),
    "MPK_ATT_QKN_EARLY": (0, "K / V copies issued before Qwen3's q / k norm: +0.0..+0.2% / +0.6..+1.1% at qwen3-8b "
                             "B=1 / 8 ctx 512 (the k-norm split stopped straggling, the others slowed), session 35"),
    "MPK_ATT_MERGE1": (0, "the folded merge's loads in one round trip: -0.1% at llama-3.2-1b B=1 / 8 (with "
                          "MPK_ARGMAX_RED1), session 35; qwen3-8b B=1 -0.1%, B=8 +0.5% (its merge 3.4 us a layer in "
                          "four round trips), session 36"),
    "MPK_ARGMAX_RED1": (0, "the greedy reduce's slot loads together: its task 4.6 -> 3.7 us, -0.1% a step at "
                           "llama-3.2-1b B=1 (with MPK_ATT_MERGE1), session 35"),
    "MPK_ATT_KV_PF": (0, "attention's cached K / V rows pulled into L2 by warp 2 while its waits were polled: +0.5 / "
                         "+0.6% at ctx 512, +2.7..+3.0% at ctx 4096, llama-3.2-1b / qwen3-8b B=1, session 49"),
    "MPK_MLP": (0, "MPK_MLP_FUSE's build, the down projection inside the gate_up tiles: a batch-1 MLP block "
                   "(scripts/bench_mlp.py) fused +1.66 / +3.97 us a layer, with the in-place down share it ran "
                   "+5.0 / +18.1, at llama-3.2-1b / qwen3-8b against two phases, session 38"),
}


def _define_value(d: str) -> str:
    """The value of one -DNAME[=VALUE] option as the preprocessor sees it (a bare -DNAME is 1)."""
    return d.split("=", 1)[1] if "=" in d else "1"


def _defines() -> list[str]:
    """MPK_NVCC_DEFINES="-DNAME=VALUE ...": compile-time switches of the device code for same-run A/B builds
    (part of the cache key, like every flag); only -D options are accepted."""
    defines = os.environ.get("MPK_NVCC_DEFINES", "").split()
    bad = [d for d in defines if not d.startswith("-D")]
    if bad:
        raise CompileError(f"MPK_NVCC_DEFINES accepts only -DNAME[=VALUE] options, got {bad}")
    gone = [d for d in defines if d.split("=", 1)[0][2:] in REMOVED_DEFINES
            and _define_value(d) != str(REMOVED_DEFINES[d.split("=", 1)[0][2:]][0])]
    if gone:
        name = gone[0].split("=", 1)[0][2:]
        raise CompileError(f"MPK_NVCC_DEFINES: {gone[0]}: this switch was removed ({REMOVED_DEFINES[name][1]}); "
                           f"drop it from MPK_NVCC_DEFINES")
    # the switches a task graph or launch mode needs in the kernel (q / k norm in attention, the LL all-reduce, PDL)
    # are not added here: build(needs=...) adds what the graph being launched needs (Megakernel passes the packer's)
    return defines


def check_defines(flags: list[str], needs: dict[str, tuple[str, str]]) -> None:
    """Raise (naming each) unless a build's flags set every define in `needs` ({name: (what needs it, how to get
    it)}) to a non-zero value: a packed task graph or launch mode that the kernel given would silently ignore."""
    have = {}
    for f in flags:   # the last -D of a name wins, as in the preprocessor
        if f.startswith("-D"):
            have[f[2:].split("=", 1)[0]] = _define_value(f)
    for name, (what, fix) in needs.items():
        if have.get(name, "0") in ("0", ""):
            raise ValueError(f"{what} need a build with -D{name}=1 (this one has "
                             f"{'-D' + name + '=' + have[name] if name in have else 'none'}): {fix}")


def define_int(name: str, default: int = 0) -> int:
    """The integer value of -D<name>=<value> in MPK_NVCC_DEFINES (the build's compile-time switches), else default:
    the host side of a diagnostic switch (e.g. MPK_STAGE_WORDS sizes the trace buffer) reads it from here."""
    for d in _defines():
        if d == f"-D{name}" or d.startswith(f"-D{name}="):
            try:
                return int(_define_value(d), 0)
            except ValueError:
                raise CompileError(f"MPK_NVCC_DEFINES: {d} is not an integer") from None
    return default


def build_flags(extra_flags: list[str] | None = None, needs=()) -> list[str]:
    """nvcc's flags for a build: BASE_FLAGS, `extra_flags`, MPK_NVCC_DEFINES, then -DNAME=1 for each name in
    `needs` (sorted: one cache entry per set) that MPK_NVCC_DEFINES does not name (a value set there stands, and
    check_defines refuses a 0). Spills are an error except in diagnostic stamp builds (MPK_STAGE_WORDS: the stamps
    take registers)."""
    defines = _defines()
    named = {d[2:].split("=", 1)[0] for d in defines}
    flags = BASE_FLAGS + list(extra_flags or []) + defines + [f"-D{n}=1" for n in sorted(needs) if n not in named]
    if define_int("MPK_STAGE_WORDS", 0) > 0:
        i = flags.index("-warn-spills")
        flags = flags[:i - 1] + flags[i + 1:]
    return flags


def build(source: str = MAIN_SOURCE, constants: dict | None = None, extra_flags: list[str] | None = None,
          root: Path = DEVICE_DIR, nvcc: str | None = None, force: bool = False, needs=()) -> BuildResult:
    """Compile `root/source` to an sm_90a cubin (cached), with the defines named in `needs` set to 1 (build_flags).
    Raises CompileError on any error or warning."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CompileError("nvcc not found: put the CUDA toolkit's bin/ on PATH (nvcc 13.0 builds sm_90a)")
    consts = {**CONSTANTS, **(constants or {})}
    header = generate_header(consts)
    flags = build_flags(extra_flags, needs)
    key = cache_key(header, consts, flags, nvcc_version(nvcc), root, source)
    out_dir = cache_dir() / key
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    cubin = out_dir / (Path(source).stem + ".cubin")
    logf = out_dir / "build.log"
    lock_path = cache_dir() / f"{key}.lock"
    t0 = time.time()
    with open(lock_path, "w") as lf:
        fcntl.flock(lf, fcntl.LOCK_EX)   # concurrent builders of one key wait here, then find the cubin
        try:
            if cubin.exists() and not force:
                log = logf.read_text() if logf.exists() else ""
                return BuildResult(cubin, log, key, True, time.time() - t0, parse_ptxas(log), flags)
            out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
                (Path(tmp) / HEADER_NAME).write_text(header)
                tmp_cubin = Path(tmp) / cubin.name
                cmd = [nvcc, GENCODE, "-cubin", *flags, "-I", tmp, "-I", str(root), "-o", str(tmp_cubin),
                       str(root / source)]
                p = subprocess.run(cmd, capture_output=True, text=True)
                log = " ".join(cmd) + "\n" + p.stdout + p.stderr
                if p.returncode != 0 or not tmp_cubin.exists():
                    raise CompileError(f"nvcc failed (exit {p.returncode}) for {source}:\n{log}")
                if _has_warning(p.stdout + p.stderr):
                    raise CompileError(f"nvcc warned for {source} (warnings are errors):\n{log}")
                (Path(tmp) / "build.log").write_text(log)
                (Path(tmp) / HEADER_NAME).replace(out_dir / HEADER_NAME)
                (Path(tmp) / "build.log").replace(logf)
                os.replace(tmp_cubin, cubin)   # last: its presence means the entry is complete
            return BuildResult(cubin, log, key, False, time.time() - t0, parse_ptxas(log), flags)
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)


def _has_warning(text: str) -> bool:
    return any("warning" in line.lower() for line in text.splitlines())
