"""nvcc driver with a content-addressed cache (FlashInfer jit/ style).

Key = sha256 over: every file under device_kernels/ (path + bytes), the generated header, the arch, the
specialisation constants, the flags, `nvcc --version` and the environment variables nvcc reads itself
(NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS / NVCC_CCBIN). Outputs live in `$MPK_CACHE_DIR` (default
~/.cache/mpk_runtime/) under `<key>/`; an fcntl lock per key makes concurrent builds safe, and outputs are
written to a temp name and renamed into place, so a reader never sees a half-written cubin. A manifest (the cubin's
size and sha256, renamed in just before it) is checked on every hit: a cubin damaged after the fact (a crash before
the data reached the disk, a full disk, a stray write) is rebuilt, not loaded. A cache this process cannot write (a
read-only mount, another user's lock file) still serves its intact entries; an entry that cannot be written (a full
disk, a file or directory in the way) is a CompileError naming what to free or delete.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
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
    # (expanded as a shell would not inside quotes: MPK_CACHE_DIR="~/x" made a directory named "~" here)
    return Path(os.path.expanduser(os.environ.get("MPK_CACHE_DIR") or "~/.cache/mpk_runtime"))


# where nvcc is looked for when PATH has none: the toolkit roots torch's extensions and the CUDA installers use
CUDA_ROOT_VARS = ("CUDA_HOME", "CUDA_PATH")
NVCC_FALLBACKS = ("/usr/local/cuda/bin/nvcc",)
# environment variables nvcc itself reads: they change the binary as much as a flag does, so they key the cache
NVCC_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN")


def find_nvcc() -> str | None:
    """nvcc on PATH, else $CUDA_HOME/bin/nvcc or $CUDA_PATH/bin/nvcc (a toolkit installed off PATH and away from
    /usr/local/cuda, as torch's extensions find it), else NVCC_FALLBACKS."""
    p = shutil.which("nvcc")
    if p:
        return p
    roots = [os.environ[v] for v in CUDA_ROOT_VARS if os.environ.get(v)]
    for c in [os.path.join(r, "bin", "nvcc") for r in roots] + list(NVCC_FALLBACKS):
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def nvcc_missing_message() -> str:
    """What to do when find_nvcc finds nothing (build's CompileError, scripts/compile_device.py)."""
    bad = [f"{v}={os.environ[v]} has no bin/nvcc" for v in CUDA_ROOT_VARS if os.environ.get(v)]
    return ("nvcc not found: not on PATH, nor in $CUDA_HOME/bin or $CUDA_PATH/bin, nor at "
            f"{', '.join(NVCC_FALLBACKS)}{' (' + '; '.join(bad) + ')' if bad else ''}. Install the CUDA toolkit "
            "(13.0: its nvcc builds sm_90a), then put its bin/ on PATH or set CUDA_HOME to its root "
            "(e.g. CUDA_HOME=/usr/local/cuda-13.0)")


_NVCC_VERSION: dict[str, str] = {}


def nvcc_version(nvcc: str) -> str:
    """`nvcc --version` (part of the cache key); a CompileError naming `nvcc` where it does not run."""
    if nvcc not in _NVCC_VERSION:
        try:
            p = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
        except OSError as e:
            raise CompileError(f"cannot run nvcc {nvcc!r}: {e.strerror or e}. {nvcc_missing_message()}") from None
        if p.returncode != 0:
            raise CompileError(f"{nvcc} --version failed (exit {p.returncode}):\n{p.stdout}{p.stderr}")
        _NVCC_VERSION[nvcc] = p.stdout
    return _NVCC_VERSION[nvcc]


def device_sources(root: Path = DEVICE_DIR) -> list[Path]:
    """Every file a build may include from `root`: all regular files but hidden ones (editor swap files) and
    __pycache__, whatever their suffix (an `#include "x.inc"` changes the binary as much as a .cuh does)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not any(
        part.startswith(".") or part == "__pycache__" for part in p.relative_to(root).parts))


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
                         "source": source, "env": _nvcc_env()}, sort_keys=True).encode())
    h.update(nvcc_ver.encode())
    return h.hexdigest()[:32]


def _nvcc_env() -> dict[str, str]:
    """The NVCC_ENV variables that are set (nvcc adds NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS to every command line
    and NVCC_CCBIN picks the host compiler, silently)."""
    return {v: os.environ[v] for v in NVCC_ENV if os.environ.get(v)}


def parse_ptxas(log: str) -> dict:
    """Registers / shared memory / spills of each kernel from `-Xptxas -v`: stack and spills are the entry
    function's own ("Function properties for <kernel>"); the out-of-line functions compiled with it follow, each
    under its own "Function properties" line, and their spill stores are summed into `callee_spill_stores`."""
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


_DEFINE_RE = re.compile(r"-D[A-Za-z_]\w*(\([\w\s,.]*\))?(=|$)")


def _refuse_removed(defines: list[str], where: str) -> None:
    """CompileError naming the first -DNAME[=VALUE] of `defines` (given through `where`) that asks for the side of
    a REMOVED_DEFINES switch the code no longer has."""
    for d in defines:
        name = d.split("=", 1)[0][2:]
        if name in REMOVED_DEFINES and _define_value(d) != str(REMOVED_DEFINES[name][0]):
            raise CompileError(f"{where}: {d}: this switch was removed ({REMOVED_DEFINES[name][1]}); "
                               f"drop it from {where}")


def _option_defines(tokens: list[str]) -> list[str]:
    """The -DNAME[=VALUE] of nvcc options given elsewhere than MPK_NVCC_DEFINES (build's extra_flags,
    NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS), in nvcc's spellings: -DX, -D X, --define-macro X, --define-macro=X."""
    out = []
    for i, t in enumerate(tokens):
        if t in ("-D", "--define-macro") and i + 1 < len(tokens):
            out.append("-D" + tokens[i + 1])
        elif t.startswith("--define-macro="):
            out.append("-D" + t.split("=", 1)[1])
        elif t.startswith("-D") and t != "-D":
            out.append(t)
    return out


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
    # a bare -D took nvcc's next option as its macro ("-D -I <dir>": "a single input file is required"), -D=1 was
    # dropped without a word: the name must be a macro name
    bad = [d for d in defines if not _DEFINE_RE.match(d)]
    if bad:
        raise CompileError(f"MPK_NVCC_DEFINES: {bad[0]}: not -DNAME[=VALUE] with NAME a C identifier")
    _refuse_removed(defines, "MPK_NVCC_DEFINES")
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
    # a removed switch asked for another way than MPK_NVCC_DEFINES is refused the same (nvcc adds the NVCC_*_FLAGS
    # variables to its command line itself: they built the default silently)
    _refuse_removed(_option_defines(list(extra_flags or [])), "extra_flags")
    for v in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"):
        _refuse_removed(_option_defines(os.environ.get(v, "").split()), v)
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
        raise CompileError(nvcc_missing_message())
    consts = {**CONSTANTS, **(constants or {})}
    header = generate_header(consts)
    flags = build_flags(extra_flags, needs)
    key = cache_key(header, consts, flags, nvcc_version(nvcc), root, source)
    cdir = cache_dir()
    out_dir = cdir / key
    cubin = out_dir / (Path(source).stem + ".cubin")
    logf = out_dir / "build.log"
    manifest = out_dir / (cubin.name + ".json")
    lock_path = cdir / f"{key}.lock"
    t0 = time.time()
    now = os.environ.get('MPK_CACHE_DIR') or 'unset: ~/.cache/mpk_runtime'
    try:
        cdir.mkdir(parents=True, exist_ok=True)
        lf = open(lock_path, "w")
    except OSError as e:
        if not force and _entry_ok(cubin, manifest):
            # a cache this process may not write (a read-only mount, another user's lock file) still serves its
            # intact entries: writers rename whole files in, and the manifest check refuses a mixed pair
            return _hit(cubin, logf, key, t0, flags)
        raise CompileError(f"cannot write the nvcc cache {cdir} ({e.strerror or e}): set MPK_CACHE_DIR to a "
                           f"writable directory (now {now})") from None
    with lf:
        fcntl.flock(lf, fcntl.LOCK_EX)   # concurrent builders of one key wait here, then find the cubin
        try:
            if not force and _entry_ok(cubin, manifest):
                return _hit(cubin, logf, key, t0, flags)
            out_dir.mkdir(parents=True, exist_ok=True)
            for stale in out_dir.glob(".build-*"):   # a build killed mid-way (we hold the key's lock: none runs)
                shutil.rmtree(stale, ignore_errors=True)
            try:
                return _compile(nvcc, source, root, header, flags, key, out_dir, cubin, logf, manifest, t0)
            except BaseException:
                if not _entry_ok(cubin, manifest):   # (a failed force rebuild keeps the intact entry it had)
                    _remove_entry(out_dir, cubin, logf, manifest)
                raise
        except OSError as e:
            # the entry's files (a full disk, a file where the key's directory should be, a directory where its
            # cubin or manifest should be) were a bare OSError: a CompileError naming what to free or delete. An
            # OSError about a path outside the cache (nvcc itself) stays as it is.
            if e.filename is not None and not Path(os.fsdecode(e.filename)).is_relative_to(cdir):
                raise
            where = "".join(f"{sep} {os.fsdecode(f)}" for sep, f in ((":", e.filename), (" ->", e.filename2))
                            if f is not None)
            raise CompileError(f"cannot write the nvcc cache entry {out_dir} ({e.strerror or e}{where}): free space "
                               f"on its disk, or delete {out_dir} (a damaged entry), or set MPK_CACHE_DIR to a "
                               f"writable directory (now {now})") from e
        finally:
            fcntl.flock(lf, fcntl.LOCK_UN)


def _hit(cubin: Path, logf: Path, key: str, t0: float, flags: list[str]) -> BuildResult:
    log = logf.read_text() if logf.exists() else ""
    return BuildResult(cubin, log, key, True, time.time() - t0, parse_ptxas(log), flags)


def _compile(nvcc, source, root, header, flags, key, out_dir, cubin, logf, manifest, t0) -> BuildResult:
    """Compile into a temp dir of `out_dir` and rename the outputs in, the manifest just before the cubin (the
    caller holds the key's lock)."""
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        (Path(tmp) / HEADER_NAME).write_text(header)
        tmp_cubin = Path(tmp) / cubin.name
        cmd = [nvcc, GENCODE, "-cubin", *flags, "-I", tmp, "-I", str(root), "-o", str(tmp_cubin),
               str(root / source)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        env = "".join(f"{k}={v!r} " for k, v in _nvcc_env().items())   # (what nvcc added to the command line)
        log = env + " ".join(cmd) + "\n" + p.stdout + p.stderr
        if p.returncode != 0 or not tmp_cubin.exists():
            raise CompileError(f"nvcc failed (exit {p.returncode}) for {source}:\n{_kept(tmp, out_dir, log)}")
        if _has_warning(p.stdout + p.stderr):
            raise CompileError(f"nvcc warned for {source} (warnings are errors):\n{_kept(tmp, out_dir, log)}")
        data = tmp_cubin.read_bytes()
        if not data:
            raise CompileError(f"nvcc wrote an empty {cubin.name} for {source}:\n{log}")
        (Path(tmp) / "build.log").write_text(log)
        (Path(tmp) / manifest.name).write_text(json.dumps(
            {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
        (Path(tmp) / HEADER_NAME).replace(out_dir / HEADER_NAME)
        (Path(tmp) / "build.log").replace(logf)
        (Path(tmp) / manifest.name).replace(manifest)
        os.replace(tmp_cubin, cubin)   # last: its presence (and the manifest's digest) means the entry is complete
    return BuildResult(cubin, log, key, False, time.time() - t0, parse_ptxas(log), flags)


def _kept(tmp: str, out_dir: Path, log: str) -> str:
    """A failed build's log, with its generated header kept: the build's temp dir (which the command's `-I` names)
    goes with the failure, so the header is copied to <cache>/failed/<key>/ and the log's command names that
    directory (the command as printed reruns the failure)."""
    keep = out_dir.parent / "failed" / out_dir.name
    try:
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path(tmp) / HEADER_NAME, keep / HEADER_NAME)
        log = log.replace(tmp, str(keep))
        (keep / "build.log").write_text(log)
    except OSError:   # (a full or read-only disk: the log as it was)
        return log
    return log + f"\n(the generated {HEADER_NAME} and this log are kept in {keep})"


def _entry_ok(cubin: Path, manifest: Path) -> bool:
    """A cache entry is complete and intact: its cubin has the size and sha256 its manifest recorded. The rename
    order alone does not guarantee it (the data of a renamed file may not have reached the disk before a crash, and
    nothing stops a later write to the file); an entry from before manifests is rebuilt once."""
    try:
        want = json.loads(manifest.read_text())
        data = cubin.read_bytes()
    except (OSError, ValueError):
        return False
    return isinstance(want, dict) and want.get("size") == len(data) and \
        want.get("sha256") == hashlib.sha256(data).hexdigest()


def _remove_entry(out_dir: Path, *files: Path) -> None:
    """A failed build leaves no entry: its files (a damaged cubin being rebuilt) and the key's directory go."""
    for f in (*files, out_dir / HEADER_NAME):
        try:
            f.unlink(missing_ok=True)
        except OSError:   # (e.g. a directory where the manifest should be: build's CompileError names the entry)
            pass
    try:
        out_dir.rmdir()
    except OSError:
        pass


def _has_warning(text: str) -> bool:
    return any("warning" in line.lower() for line in text.splitlines())
