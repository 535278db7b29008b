"""The nvcc cache (codegen/nvcc.py) and scripts/compile_device.py under what a user's machine does to them, past
tests/codegen/test_nvcc_cache.py: a cache entry damaged into the wrong kind of file and a full disk are a
CompileError that says what to free or delete (they were bare OSErrors, and killed compile_device.py's pool with a
traceback); a cache this process cannot write still serves its intact entries; MPK_NVCC_DEFINES junk and removed
switches given through extra_flags or nvcc's own NVCC_*_FLAGS are refused by name. A stand-in nvcc keeps all of
them fast (no real compile)."""
from __future__ import annotations

import builtins
import errno
import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest

from mpk_runtime.codegen import nvcc

REPO = Path(__file__).resolve().parents[2]
WHOLE = b"CUBIN-" + b"x" * 4096


def _fake_nvcc(tmp_path: Path, ptxas: bool = True, name: str = "nvcc") -> str:
    """A stand-in nvcc: answers --version, counts its compiles in tmp_path/count, writes WHOLE to its -o path (and
    a ptxas line unless ptxas=False)."""
    script = tmp_path / name
    script.write_text(f"""#!{sys.executable}
import sys
if "--version" in sys.argv:
    print("fake nvcc 1.0"); sys.exit(0)
with open({str(tmp_path / 'count')!r}, "a") as f: f.write("x")
open(sys.argv[sys.argv.index("-o") + 1], "wb").write({WHOLE!r})
if {ptxas!r}:
    print("ptxas info    : Compiling entry function 'k' for 'sm_90a'")
""")
    script.chmod(0o755)
    return str(script)


def _src_tree(tmp_path: Path) -> Path:
    root = tmp_path / "dk"
    root.mkdir(parents=True)
    (root / "megakernel.cu").write_text("// k\n")
    return root


def _count(tmp_path: Path) -> int:
    p = tmp_path / "count"
    return len(p.read_text()) if p.exists() else 0


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MPK_NVCC_DEFINES", raising=False)
    for v in nvcc.NVCC_ENV:
        monkeypatch.delenv(v, raising=False)
    return tmp_path / "cache"


def _compile_device():
    spec = importlib.util.spec_from_file_location("compile_device", REPO / "scripts" / "compile_device.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- damaged entries and a full disk -------------------------------------------------------------------------------

def test_a_file_where_the_keys_directory_should_be_names_it_to_delete(tmp_path, cache):
    """<cache>/<key> a file (a copy or a sync gone wrong): `out_dir.mkdir` raised a bare FileExistsError."""
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    r = nvcc.build(root=root, nvcc=fake)
    shutil.rmtree(r.cubin.parent)
    r.cubin.parent.write_text("junk")
    with pytest.raises(nvcc.CompileError, match=f"cannot write the nvcc cache entry {r.cubin.parent} .*File exists"
                                                f".*delete {r.cubin.parent} \\(a damaged entry\\)"):
        nvcc.build(root=root, nvcc=fake)
    r.cubin.parent.unlink()   # as told: the next build makes the entry again
    assert nvcc.build(root=root, nvcc=fake).cubin.read_bytes() == WHOLE


def test_a_directory_where_the_manifest_should_be_names_the_entry_to_delete(tmp_path, cache):
    """The manifest's rename onto a directory raised a bare IsADirectoryError (and the failed build's cleanup raised
    another, unlinking that directory)."""
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    r = nvcc.build(root=root, nvcc=fake)
    m = r.cubin.parent / (r.cubin.name + ".json")
    m.unlink()
    m.mkdir()
    with pytest.raises(nvcc.CompileError, match=f"cannot write the nvcc cache entry {r.cubin.parent} .*Is a "
                                                f"directory.*-> {m}\\).*delete {r.cubin.parent}"):
        nvcc.build(root=root, nvcc=fake)
    shutil.rmtree(r.cubin.parent)
    assert nvcc.build(root=root, nvcc=fake).cubin.read_bytes() == WHOLE


def _full_disk(monkeypatch):
    """ENOSPC from the write of the build's log (a write error carries no file name)."""
    write_text = Path.write_text

    def _write_text(self, *a, **kw):
        if self.name == "build.log":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write_text(self, *a, **kw)
    monkeypatch.setattr(Path, "write_text", _write_text)


def test_a_full_disk_is_a_compile_error_and_leaves_no_entry(tmp_path, cache, monkeypatch):
    """A full cache disk was a bare `OSError: [Errno 28] No space left on device`, naming neither the cache nor a
    fix; callers catching CompileError (compile_device.py) did not catch it."""
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    _full_disk(monkeypatch)
    with pytest.raises(nvcc.CompileError, match=f"cannot write the nvcc cache entry {cache}/\\w+ \\(No space left on "
                                                f"device\\): free space on its disk.*MPK_CACHE_DIR"):
        nvcc.build(root=root, nvcc=fake)
    assert not list(cache.rglob("*.cubin*"))
    monkeypatch.undo()
    monkeypatch.setenv("MPK_CACHE_DIR", str(cache))
    assert not nvcc.build(root=root, nvcc=fake).cached


def test_compile_device_reports_a_full_disk_as_a_failed_build(tmp_path, cache, monkeypatch):
    """compile_device.py's worker caught only CompileError: the OSError of a full disk went up through pool.map, a
    traceback instead of a FAIL line, and the builds after it were not reported."""
    (tmp_path / "bin").mkdir()
    _fake_nvcc(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    mod = _compile_device()
    _full_disk(monkeypatch)
    tag, lines, ok = mod._build(("bench_stream.cu", ""), "", False)
    assert not ok and lines[0].startswith("FAIL bench_stream.cu\ncannot write the nvcc cache entry")
    assert "No space left on device" in lines[0]


def test_compile_device_prints_an_ok_line_for_a_build_without_ptxas_lines(tmp_path, cache, monkeypatch):
    """A build whose log has no ptxas resource lines (here the stand-in prints none; a hit whose build.log was
    deleted) printed an empty line: no `ok` for it at all."""
    (tmp_path / "bin").mkdir()
    _fake_nvcc(tmp_path / "bin", ptxas=False)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    tag, lines, ok = _compile_device()._build(("bench_stream.cu", ""), "", False)
    assert ok and len(lines) == 1 and lines[0].startswith("ok   bench_stream.cu -> ") and "bench_stream.cubin" in lines[0]


# --- a cache this process cannot write -----------------------------------------------------------------------------

@pytest.mark.parametrize("err", [errno.EROFS, errno.EACCES])
def test_a_cache_that_cannot_be_written_serves_its_intact_entries(tmp_path, cache, monkeypatch, err):
    """A prebuilt cache mounted read-only (EROFS), or a shared one whose lock file another user made (EACCES on
    open(<key>.lock, "w")): every build was refused ("cannot write the nvcc cache"), even a hit on an intact entry.
    A hit is served now (writers rename whole files in; the manifest check stands in for the lock); a miss, a
    damaged entry and a forced rebuild are still refused with the message."""
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    r = nvcc.build(root=root, nvcc=fake)

    def _open(file, *a, **kw):   # (the tests run as root in CI: the mode bits would not refuse)
        if str(file).endswith(".lock"):
            raise OSError(err, os.strerror(err), str(file))
        return builtins.open(file, *a, **kw)
    monkeypatch.setattr(nvcc, "open", _open, raising=False)
    hit = nvcc.build(root=root, nvcc=fake)
    assert hit.cached and hit.cubin == r.cubin and hit.cubin.read_bytes() == WHOLE and "entry function 'k'" in hit.log
    assert _count(tmp_path) == 1
    msg = f"cannot write the nvcc cache {cache} \\({os.strerror(err)}\\): set MPK_CACHE_DIR"
    with pytest.raises(nvcc.CompileError, match=msg):
        nvcc.build(root=root, nvcc=fake, force=True)
    with pytest.raises(nvcc.CompileError, match=msg):
        nvcc.build(root=root, nvcc=fake, extra_flags=["-DOTHER=1"])   # another key: a miss
    r.cubin.write_bytes(WHOLE[:10])   # damaged
    with pytest.raises(nvcc.CompileError, match=msg):
        nvcc.build(root=root, nvcc=fake)
    assert _count(tmp_path) == 1


# --- MPK_NVCC_DEFINES junk, removed switches asked for elsewhere ---------------------------------------------------

@pytest.mark.parametrize("junk", ["-D", "-D=1", "-D1X=2", "-DA-B=1", "-DMPK_PDL -D"])
def test_a_define_without_a_macro_name_is_refused(cache, junk, monkeypatch):
    """A bare -D took the next option of nvcc's command line as its macro (-D -I <dir>: nvcc then failed with "A
    single input file is required for a non-link phase"); -D=1 was ignored by nvcc without a word."""
    monkeypatch.setenv("MPK_NVCC_DEFINES", junk)
    bad = junk.split()[-1]
    with pytest.raises(nvcc.CompileError, match=f"MPK_NVCC_DEFINES: {bad}: not -DNAME\\[=VALUE\\] with NAME a C "
                                                f"identifier"):
        nvcc.build_flags()


@pytest.mark.parametrize("ok", ["-DMPK_PDL", "-DMPK_ATT_STAGES=3", "-DMPK_X=", "-D_X=a=b", "-DF(x)=x"])
def test_a_define_with_a_macro_name_is_accepted(ok, monkeypatch):
    monkeypatch.setenv("MPK_NVCC_DEFINES", ok)
    assert nvcc._defines() == [ok]


@pytest.mark.parametrize("where,value", [
    ("extra_flags", ["-DMPK_ATT_SWIZZLE=1"]),
    ("extra_flags", ["-D", "MPK_ATT_GW=0"]),
    ("NVCC_APPEND_FLAGS", "-DMPK_ATT_SWIZZLE=1"),
    ("NVCC_PREPEND_FLAGS", "-O3 -D MPK_MLP"),
    ("NVCC_APPEND_FLAGS", "--define-macro=MPK_WRING=128"),
    ("NVCC_APPEND_FLAGS", "--define-macro MPK_ATT_ST=1"),
])
def test_a_removed_switch_asked_for_outside_mpk_nvcc_defines_is_refused(tmp_path, cache, monkeypatch, where, value):
    """Only MPK_NVCC_DEFINES was checked against REMOVED_DEFINES: build(extra_flags=[...]) and nvcc's own
    NVCC_PREPEND_FLAGS / NVCC_APPEND_FLAGS (which it adds to its command line itself) built the default code
    silently. Refused by name now, before nvcc runs; the value the code has stays harmless."""
    fake, root = _fake_nvcc(tmp_path), _src_tree(tmp_path)
    kw = {"extra_flags": value} if where == "extra_flags" else {}
    if where != "extra_flags":
        monkeypatch.setenv(where, value)
    with pytest.raises(nvcc.CompileError, match=f"{where}: -DMPK_\\w+(=\\w+)?: this switch was removed .*drop it "
                                                f"from {where}"):
        nvcc.build(root=root, nvcc=fake, **kw)
    assert _count(tmp_path) == 0
    if where == "extra_flags":
        kw = {"extra_flags": ["-DMPK_ATT_SWIZZLE=0", "-DMPK_ATT_GW=1"]}
    else:
        monkeypatch.setenv(where, "-DMPK_ATT_SWIZZLE=0 -DMPK_OTHER=1")
    assert nvcc.build(root=root, nvcc=fake, **kw).cubin.read_bytes() == WHOLE


def test_a_cache_dir_given_with_a_tilde_is_the_home_one(monkeypatch, tmp_path):
    """MPK_CACHE_DIR="~/x" (quoted: no shell expansion) made a directory named "~" in the working directory."""
    from mpk_runtime.codegen import nvcc
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MPK_CACHE_DIR", "~/kc")
    assert nvcc.cache_dir() == tmp_path / "kc"
