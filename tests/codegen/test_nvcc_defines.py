"""Build defines (codegen/nvcc.py: MPK_NVCC_DEFINES, and the ones a packed graph or launch mode needs) and the
programmatic dependent launch's configuration (runtime/megakernel.py launch_config); all run without a GPU."""
import pytest

from mpk_runtime.codegen import nvcc


def _d(flags):
    return [f for f in flags if f.startswith("-D")]


def test_needed_defines_join_the_build_sorted_once_and_a_hand_set_value_stands(monkeypatch):
    """build(needs=...) (Megakernel passes its packer's needs, plus MPK_PDL under MPK_MK_PDL=1): each needed define
    set to 1 after MPK_NVCC_DEFINES, in name order (one cache entry per set, whatever order the packer met them);
    one that MPK_NVCC_DEFINES names keeps its value there (check_defines then refuses a 0). Environment switches add
    no define of their own: a graph without Qwen3's head norms builds the kernel without that path."""
    monkeypatch.delenv("MPK_NVCC_DEFINES", raising=False)
    for k in ("MPK_ATTN_QKNORM", "MPK_MK_PDL", "MPK_AR_LL"):
        monkeypatch.setenv(k, "1")
    assert _d(nvcc.build_flags()) == []
    needs = {"MPK_PDL": ("a", "b"), "MPK_ATT_QKNORM": ("c", "d")}
    assert _d(nvcc.build_flags(needs=needs)) == ["-DMPK_ATT_QKNORM=1", "-DMPK_PDL=1"]
    assert _d(nvcc.build_flags(needs=dict(reversed(needs.items())))) == ["-DMPK_ATT_QKNORM=1", "-DMPK_PDL=1"]
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_STAGES=3 -DMPK_PDL")
    assert _d(nvcc.build_flags(needs=needs)) == ["-DMPK_ATT_STAGES=3", "-DMPK_PDL", "-DMPK_ATT_QKNORM=1"]
    nvcc.check_defines(nvcc.build_flags(needs=needs), needs)
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_PDL=0")
    assert _d(nvcc.build_flags(needs=needs)) == ["-DMPK_PDL=0", "-DMPK_ATT_QKNORM=1"]
    with pytest.raises(ValueError, match=r"a need a build with -DMPK_PDL=1 \(this one has -DMPK_PDL=0\): b"):
        nvcc.check_defines(nvcc.build_flags(needs=needs), needs)


def test_launch_config_sets_programmatic_stream_serialization_only_when_asked():
    cu = pytest.importorskip("cuda.bindings.driver")
    from mpk_runtime.runtime.megakernel import launch_config
    plain = launch_config(132, 256, 200 * 1024, cu.CUstream(0), pdl=False)
    assert (plain.gridDimX, plain.blockDimX, plain.sharedMemBytes, plain.numAttrs) == (132, 256, 200 * 1024, 0)
    cfg = launch_config(132, 256, 200 * 1024, cu.CUstream(0), pdl=True)
    assert cfg.numAttrs == 1
    a = cfg.attrs[0]
    assert a.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert a.value.programmaticStreamSerializationAllowed == 1


def test_a_bare_define_is_one_and_a_removed_switch_set_to_zero_is_allowed(monkeypatch):
    monkeypatch.delenv("MPK_MK_PDL", raising=False)
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_PDL -DMPK_ATT_SWIZZLE=0")
    assert nvcc.define_int("MPK_PDL", 0) == 1
    assert nvcc.define_int("MPK_ATT_STAGES", 2) == 2
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_SWIZZLE=1")
    with pytest.raises(nvcc.CompileError, match="removed"):
        nvcc._defines()
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_ST=1 -DMPK_ATT_LEAN_PASS=1")   # session 23's refuted pair
    with pytest.raises(nvcc.CompileError, match=r"-DMPK_ATT_ST=1: this switch was removed .*session 23"):
        nvcc._defines()


def test_a_removed_switch_is_refused_only_on_the_side_the_code_no_longer_has(monkeypatch):
    """MPK_ATT_GW was a default-on switch: its =1 is what the code always does now (allowed, like a removed opt-in
    switch's =0), and =0 (the removed order) is refused with the measurement; a bare -DNAME counts as 1."""
    for ok in ("-DMPK_ATT_GW=1", "-DMPK_ATT_GW", "-DMPK_ATT_ST=0"):
        monkeypatch.setenv("MPK_NVCC_DEFINES", ok)
        assert nvcc._defines() == [ok]
    for bad in ("-DMPK_ATT_GW=0", "-DMPK_ATT_ST"):
        monkeypatch.setenv("MPK_NVCC_DEFINES", bad)
        with pytest.raises(nvcc.CompileError, match=f"{bad}: this switch was removed .*session 2[34].*drop it"):
            nvcc._defines()


def test_a_build_without_a_needed_define_is_refused_naming_it():
    """nvcc.check_defines (Megakernel runs it against the build it launches, whatever environment built it): every
    needed define must be non-zero in the build's flags; a bare -DNAME is 1 and the last -D of a name wins."""
    needs = {"MPK_AR_LL": ("LL words' readers", "add -DMPK_AR_LL=1"), "MPK_PDL": ("PDL launches", "unset MPK_MK_PDL")}
    nvcc.check_defines(["-O3", "-DMPK_AR_LL=1", "-DMPK_PDL"], needs)
    nvcc.check_defines([], {})
    with pytest.raises(ValueError, match=r"PDL launches need a build with -DMPK_PDL=1 \(this one has none\): unset"):
        nvcc.check_defines(["-DMPK_AR_LL=1"], needs)
    with pytest.raises(ValueError, match=r"LL words' readers need .* \(this one has -DMPK_AR_LL=0\): add"):
        nvcc.check_defines(["-DMPK_AR_LL=1", "-DMPK_PDL=1", "-DMPK_AR_LL=0"], needs)
