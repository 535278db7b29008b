"""The nvcc driver's cache (codegen/nvcc.py) under what a user's machine does to it: everything that changes the
binary keys it (any file the source may include, nvcc's own environment variables), a damaged entry is rebuilt
rather than loaded, a failed or killed build leaves nothing a later build uses, builders racing on one key from
several processes see only whole cubins, and a missing nvcc or an unwritable MPK_CACHE_DIR is a CompileError that
says what to do. A stand-in nvcc keeps most of these fast; the tests marked `real` run the installed nvcc on a
one-line kernel (a second or two each)."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from mpk_runtime.codegen import nvcc

REPO = Path(__file__).resolve().parents[2]
real = pytest.mark.skipif(nvcc.find_nvcc() is None, reason="nvcc not on PATH: cannot compile device sources")


def _fake_nvcc(tmp_path: Path, body: str = "", name: str = "nvcc") -> str:
    """A stand-in nvcc: answers --version, counts its compiles in tmp_path/count, writes its pid to tmp_path/pid,
    runs `body` (python, with `out` the -o path), then writes b"CUBIN-" + 4 KiB to `out` unless body exited."""
    script = tmp_path / name
    script.write_text(f"""#!{sys.executable}
import os, sys, time
if "--version" in sys.argv:
    print("fake nvcc 1.0"); sys.exit(0)
with open({str(tmp_path / 'count')!r}, "a") as f: f.write("x")
open({str(tmp_path / 'pid')!r}, "w").write(str(os.getpid()))
out = sys.argv[sys.argv.index("-o") + 1]
{body}
open(out, "wb").write(b"CUBIN-" + b"x" * 4096)
print("ptxas info    : Compiling entry function 'k' for 'sm_90a'")
""")
    script.chmod(0o755)
    return str(script)


def _src_tree(tmp_path: Path) -> Path:
    root = tmp_path / "dk"
    (root / "ops").mkdir(parents=True)
    (root / "megakernel.cu").write_text('#include "ops/a.cuh"\n#include "ops/tables.inc"\n')
    (root / "ops" / "a.cuh").write_text("// a\n")
    (root / "ops" / "tables.inc").write_text("// t\n")
    return root


def _count(tmp_path: Path) -> int:
    p = tmp_path / "count"
    return len(p.read_text()) if p.exists() else 0


WHOLE = b"CUBIN-" + b"x" * 4096


# --- the key -------------------------------------------------------------------------------------------------------

def test_an_included_file_of_any_suffix_keys_the_cache(tmp_path, monkeypatch):
    """device_sources hashed only .cu / .cuh / .h: an edit to an included .inc file (or .hpp, .cuinl) kept the key,
    and the stale cubin was loaded. Hidden files (an editor's swap file) do not key it."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    r1 = nvcc.build(root=root, nvcc=fake)
    (root / "ops" / "tables.inc").write_text("// t changed\n")
    r2 = nvcc.build(root=root, nvcc=fake)
    assert not r2.cached and r2.key != r1.key
    (root / "ops" / ".a.cuh.swp").write_bytes(b"\0swap")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.pyc").write_bytes(b"\0")
    r3 = nvcc.build(root=root, nvcc=fake)
    assert r3.cached and r3.key == r2.key
    assert _count(tmp_path) == 2


@pytest.mark.parametrize("var,value", [("NVCC_APPEND_FLAGS", "-DVAL=7"), ("NVCC_PREPEND_FLAGS", "-G"),
                                       ("NVCC_CCBIN", "/usr/bin/clang++")])
def test_nvccs_own_environment_variables_key_the_cache(tmp_path, monkeypatch, var, value):
    """nvcc adds $NVCC_PREPEND_FLAGS / $NVCC_APPEND_FLAGS to every command line and takes the host compiler from
    $NVCC_CCBIN, silently: a build with them set was a cache hit on the entry built without (and the reverse), so a
    -G or -D given that way was silently not in the binary loaded. They key the cache now, and the log shows them."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    for v in nvcc.NVCC_ENV:
        monkeypatch.delenv(v, raising=False)
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    r1 = nvcc.build(root=root, nvcc=fake)
    monkeypatch.setenv(var, value)
    r2 = nvcc.build(root=root, nvcc=fake)
    assert not r2.cached and r2.key != r1.key
    assert f"{var}={value!r}" in r2.log
    monkeypatch.delenv(var)
    assert nvcc.build(root=root, nvcc=fake).key == r1.key


@real
def test_nvcc_append_flags_reach_a_real_build_and_its_key(tmp_path, monkeypatch):
    """The same with the installed nvcc: -DVAL=7 through NVCC_APPEND_FLAGS changes the cubin, so it must change
    the key (it was a cache hit returning the VAL=1 cubin)."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    for v in nvcc.NVCC_ENV:
        monkeypatch.delenv(v, raising=False)
    root = tmp_path / "src"
    root.mkdir()
    (root / "k.cu").write_text('#include "mpk_generated.h"\n#ifndef VAL\n#define VAL 1\n#endif\n'
                               'extern "C" __global__ void k(int* p) { p[threadIdx.x] = VAL * mpk::NUM_OPCODES; }\n')
    r1 = nvcc.build("k.cu", root=root)
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "-DVAL=7")
    r2 = nvcc.build("k.cu", root=root)
    assert not r2.cached and r2.key != r1.key
    assert r1.cubin.read_bytes() != r2.cubin.read_bytes()
    assert r1.cubin.read_bytes()[:4] == r2.cubin.read_bytes()[:4] == b"\x7fELF"


# --- damaged, failed and killed builds -----------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncate", "empty", "flip", "no_manifest"])
def test_a_damaged_cache_entry_is_rebuilt_not_loaded(tmp_path, monkeypatch, damage):
    """Only the cubin's presence was checked: a truncated / zeroed / altered cubin (a crash before its data reached
    the disk, a full disk, a stray write) was returned as a cache hit and failed at load, or loaded wrong code.
    The manifest's size and sha256 are checked on every hit now, and a mismatch rebuilds."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    r1 = nvcc.build(root=root, nvcc=fake)
    assert r1.cubin.read_bytes() == WHOLE and nvcc.build(root=root, nvcc=fake).cached
    if damage == "truncate":
        r1.cubin.write_bytes(WHOLE[:100])
    elif damage == "empty":
        r1.cubin.write_bytes(b"")
    elif damage == "flip":
        r1.cubin.write_bytes(WHOLE[:-1] + b"y")     # same size, other bytes
    else:
        next(r1.cubin.parent.glob("*.cubin.json")).unlink()   # an entry written before manifests
    r2 = nvcc.build(root=root, nvcc=fake)
    assert not r2.cached and r2.key == r1.key and r2.cubin.read_bytes() == WHOLE
    assert nvcc.build(root=root, nvcc=fake).cached
    assert _count(tmp_path) == 2


def test_a_failed_compile_leaves_no_entry_and_shows_the_diagnostics_and_command(tmp_path, monkeypatch):
    """nvcc's error and the command line are in the CompileError; the key's directory went away with the build
    (an empty <key>/ was left behind), and a damaged cubin that a failed rebuild found is removed too."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    root = _src_tree(tmp_path)
    bad = _fake_nvcc(tmp_path, 'sys.stderr.write("megakernel.cu(3): error: identifier \\"foo\\" is undefined\\n"); '
                               'sys.exit(2)', name="nvcc_bad")
    with pytest.raises(nvcc.CompileError) as e:
        nvcc.build(root=root, nvcc=bad)
    msg = str(e.value)
    assert "exit 2" in msg and 'identifier "foo" is undefined' in msg
    assert f"{bad} {nvcc.GENCODE} -cubin" in msg and str(root / "megakernel.cu") in msg
    cache = tmp_path / "cache"
    assert [p.name for p in cache.rglob("*") if p.suffix in (".cubin", ".json")] == []

    good = _fake_nvcc(tmp_path, name="nvcc_good")    # same --version: same key
    r = nvcc.build(root=root, nvcc=good)
    r.cubin.write_bytes(b"half")
    with pytest.raises(nvcc.CompileError):
        nvcc.build(root=root, nvcc=bad)
    assert not r.cubin.exists()
    assert nvcc.build(root=root, nvcc=good).cubin.read_bytes() == WHOLE


def test_a_failed_force_rebuild_keeps_the_intact_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    root = _src_tree(tmp_path)
    good = _fake_nvcc(tmp_path, name="nvcc_good")
    bad = _fake_nvcc(tmp_path, "sys.exit(1)", name="nvcc_bad")
    r = nvcc.build(root=root, nvcc=good)
    with pytest.raises(nvcc.CompileError):
        nvcc.build(root=root, nvcc=bad, force=True)
    again = nvcc.build(root=root, nvcc=bad)
    assert again.cached and again.cubin == r.cubin and r.cubin.read_bytes() == WHOLE


@real
def test_a_real_failed_compile_shows_nvccs_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "src"
    root.mkdir()
    (root / "bad.cu").write_text('extern "C" __global__ void k(int* p) { p[0] = undefined_name; }\n')
    with pytest.raises(nvcc.CompileError) as e:
        nvcc.build("bad.cu", root=root)
    msg = str(e.value)
    assert "nvcc failed" in msg and "undefined_name" in msg and "error" in msg and nvcc.GENCODE in msg
    assert not list((tmp_path / "cache").rglob("*.cubin"))


@real
def test_a_failed_compiles_command_reruns_with_its_generated_header():
    """The failed build's log printed `-I <temp dir>`, a directory deleted with the failure, so the command as
    printed failed on the missing generated header instead of reproducing the error; the header is kept and the
    command names where."""
    import re
    import shlex
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "src"
        root.mkdir()
        (root / "bad.cu").write_text(f'#include "{nvcc.HEADER_NAME}"\n'
                                     'extern "C" __global__ void k(int* p) { p[0] = undefined_name; }\n')
        os.environ["MPK_CACHE_DIR"] = str(Path(d) / "cache")
        try:
            with pytest.raises(nvcc.CompileError) as e:
                nvcc.build("bad.cu", root=root)
        finally:
            del os.environ["MPK_CACHE_DIR"]
        msg = str(e.value)
        line = next(x for x in msg.splitlines() if nvcc.GENCODE in x)
        cmd = shlex.split(re.sub(r"^(\w+='[^']*' )*", "", line))
        cmd[cmd.index("-o") + 1] = str(Path(d) / "out.cubin")
        p = subprocess.run(cmd, capture_output=True, text=True)
        assert p.returncode != 0 and "undefined_name" in p.stdout + p.stderr, p.stdout + p.stderr
        assert "kept in" in msg


def _build_killable(args):
    cache, root, fake = args
    os.environ["MPK_CACHE_DIR"] = cache
    from mpk_runtime.codegen import nvcc as n
    n.build(root=Path(root), nvcc=fake)


def test_a_killed_build_leaves_nothing_a_later_build_uses(tmp_path, monkeypatch):
    """A builder killed while nvcc has written half its cubin: the next build of the key compiles afresh and
    gets a whole cubin, and the killed build's temp directory (with its half cubin) is cleared."""
    cache, root = tmp_path / "cache", _src_tree(tmp_path)
    slow = _fake_nvcc(tmp_path, 'open(out, "wb").write(b"CUB"); time.sleep(60)', name="nvcc_slow")
    p = mp.get_context("spawn").Process(target=_build_killable, args=((str(cache), str(root), slow),))
    p.start()
    try:
        deadline = time.time() + 60
        while not list(cache.rglob(".build-*/megakernel.cubin")):
            assert time.time() < deadline and p.is_alive(), "the slow build never started"
            time.sleep(0.05)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        os.kill(int((tmp_path / "pid").read_text()), signal.SIGKILL)   # the orphaned stand-in nvcc
    fast = _fake_nvcc(tmp_path, name="nvcc_fast")
    monkeypatch.setenv("MPK_CACHE_DIR", str(cache))
    r = nvcc.build(root=root, nvcc=fast)
    assert not r.cached and r.cubin.read_bytes() == WHOLE
    assert not list(cache.rglob(".build-*"))


def _force_builds(args):
    cache, root, fake, n = args
    os.environ["MPK_CACHE_DIR"] = cache
    from mpk_runtime.codegen import nvcc as nv
    return [nv.build(root=Path(root), nvcc=fake, force=True).key for _ in range(n)]


def _read_cubins(args):
    """Read the entry's cubin, unlocked, as a loader would, until `stop` appears: every read is a whole one."""
    cubin, stop = Path(args[0]), Path(args[1])
    seen = bad = 0
    while not stop.exists():
        try:
            data = cubin.read_bytes()
        except FileNotFoundError:
            continue
        seen += 1
        bad += data != WHOLE
    return seen, bad


def test_racing_force_rebuilds_never_show_a_reader_a_partial_cubin(tmp_path, monkeypatch):
    """Two processes rebuilding one key over and over (nvcc writing its cubin in two halves, 20 ms apart) while a
    third reads the entry's cubin without the lock: each read is a whole cubin, and the manifest matches at the
    end."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    root = _src_tree(tmp_path)
    halves = _fake_nvcc(tmp_path, 'f = open(out, "wb"); f.write(b"CUBIN-"); f.flush(); time.sleep(0.02); '
                                  'f.write(b"x" * 4096); f.close(); sys.exit(0)')
    first = nvcc.build(root=root, nvcc=halves)
    stop = tmp_path / "stop"
    ctx = mp.get_context("spawn")
    with ctx.Pool(3) as pool:
        reader = pool.apply_async(_read_cubins, ((str(first.cubin), str(stop)),))
        builders = pool.map_async(_force_builds, [(str(tmp_path / "cache"), str(root), halves, 5)] * 2)
        keys = builders.get(timeout=120)
        stop.write_text("")
        seen, bad = reader.get(timeout=60)
    assert {k for ks in keys for k in ks} == {first.key}
    assert seen > 0 and bad == 0
    assert _count(tmp_path) == 11
    assert nvcc.build(root=root, nvcc=halves).cached


def _real_build(args):
    cache, root = args
    os.environ["MPK_CACHE_DIR"] = cache
    from mpk_runtime.codegen import nvcc as n
    r = n.build("k.cu", root=Path(root))
    return r.key, r.cached, r.cubin.read_bytes()


@real
def test_two_processes_building_one_key_with_the_real_nvcc(tmp_path):
    """The installed nvcc, two processes, one key: one compiles, the other waits on the lock and hits the entry;
    both get the same whole ELF cubin."""
    root = tmp_path / "src"
    root.mkdir()
    (root / "k.cu").write_text('#include "mpk_generated.h"\n'
                               'extern "C" __global__ void k(int* p) { p[threadIdx.x] = mpk::NUM_OPCODES; }\n')
    with mp.get_context("spawn").Pool(2) as pool:
        res = pool.map(_real_build, [(str(tmp_path / "cache"), str(root))] * 2)
    assert len({k for k, _, _ in res}) == 1 and sorted(c for _, c, _ in res) == [False, True]
    assert res[0][2] == res[1][2] and res[0][2][:4] == b"\x7fELF"


# --- nvcc missing, cache unwritable --------------------------------------------------------------------------------

def _no_nvcc(tmp_path, monkeypatch):
    empty = tmp_path / "emptybin"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(empty))
    for v in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(nvcc, "NVCC_FALLBACKS", (str(tmp_path / "nowhere" / "nvcc"),))


def test_nvcc_missing_says_what_to_install_and_set(tmp_path, monkeypatch):
    """The message said only "put the CUDA toolkit's bin/ on PATH"; it now names the toolkit to install, CUDA_HOME,
    and where it looked (a CUDA_HOME that has no bin/nvcc is named as such)."""
    _no_nvcc(tmp_path, monkeypatch)
    assert nvcc.find_nvcc() is None
    with pytest.raises(nvcc.CompileError, match=r"nvcc not found.*Install the CUDA toolkit \(13\.0.*CUDA_HOME"):
        nvcc.build(root=_src_tree(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-old"))
    with pytest.raises(nvcc.CompileError, match=f"CUDA_HOME={tmp_path / 'cuda-old'} has no bin/nvcc"):
        nvcc.build(root=_src_tree(tmp_path / "b"))


def test_cuda_home_finds_an_nvcc_off_path(tmp_path, monkeypatch):
    """A toolkit installed off PATH and away from /usr/local/cuda (/opt/cuda-13.0, say), named by CUDA_HOME as
    torch's extensions take it: it was not found ("nvcc not found")."""
    _no_nvcc(tmp_path, monkeypatch)
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    fake = _fake_nvcc(tmp_path / "cuda" / "bin")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    assert nvcc.find_nvcc() == fake
    assert nvcc.build(root=_src_tree(tmp_path)).cubin.read_bytes() == WHOLE


def test_an_nvcc_that_does_not_run_is_a_compile_error(tmp_path, monkeypatch):
    """nvcc=<a path that is not there> raised a bare FileNotFoundError from `nvcc --version`."""
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(nvcc.CompileError, match="cannot run nvcc .*nowhere/nvcc"):
        nvcc.build(root=_src_tree(tmp_path), nvcc=str(tmp_path / "nowhere" / "nvcc"))


def test_compile_device_script_without_nvcc_exits_2_with_the_message(tmp_path, monkeypatch, capsys):
    import importlib.util
    _no_nvcc(tmp_path, monkeypatch)
    spec = importlib.util.spec_from_file_location("compile_device", REPO / "scripts" / "compile_device.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", ["compile_device.py", "--no-variants"])
    assert mod.main() == 2
    err = capsys.readouterr().err
    assert "nvcc not found" in err and "CUDA_HOME" in err and "Install the CUDA toolkit" in err


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_an_unwritable_cache_dir_is_a_clear_error(tmp_path, monkeypatch, where):
    """MPK_CACHE_DIR that cannot hold the cache raised a bare NotADirectoryError / FileExistsError from mkdir (a
    read-only directory, PermissionError from the lock file's open): a CompileError naming MPK_CACHE_DIR now."""
    f = tmp_path / "afile"
    f.write_text("")
    bad = f / "cache" if where == "under_a_file" else f
    monkeypatch.setenv("MPK_CACHE_DIR", str(bad))
    with pytest.raises(nvcc.CompileError, match=f"cannot write the nvcc cache {bad} .*set MPK_CACHE_DIR to a "
                                                f"writable directory \\(now {bad}\\)"):
        nvcc.build(root=_src_tree(tmp_path), nvcc=_fake_nvcc(tmp_path))


def test_a_read_only_cache_dir_is_a_clear_error(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    monkeypatch.setenv("MPK_CACHE_DIR", str(ro))
    if os.geteuid() == 0:
        # root ignores the mode bits (CI runs as root: a bare skip here never ran the test), so the EACCES that
        # open(<cache>/<key>.lock, "w") gets from the kernel for anyone else is raised at that same call: an
        # `open` in nvcc's module namespace shadows the builtin for nvcc.build only
        import builtins
        import errno

        def _open(file, *a, **kw):
            if Path(file).parent == ro and len(a) > 0 and "w" in a[0]:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(file))
            return builtins.open(file, *a, **kw)
        monkeypatch.setattr(nvcc, "open", _open, raising=False)
    try:
        with pytest.raises(nvcc.CompileError, match=f"cannot write the nvcc cache {ro} \\(Permission denied\\): "
                                                    f"set MPK_CACHE_DIR to a writable directory \\(now {ro}\\)"):
            nvcc.build(root=_src_tree(tmp_path), nvcc=_fake_nvcc(tmp_path))
        assert not any(ro.iterdir())   # nothing was written there
    finally:
        ro.chmod(0o700)
