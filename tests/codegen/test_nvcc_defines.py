"""Build switches that travel as environment variables (codegen/nvcc.py _defines) and the programmatic dependent
launch's configuration (runtime/megakernel.py launch_config); both run without a GPU."""
import pytest

from mpk_runtime.codegen import nvcc


@pytest.fixture(autouse=True)
def _no_qknorm_define(monkeypatch):
    """The exact define lists below leave out the attention q / k norm switch's own define (its test sets it)."""
    monkeypatch.setenv("MPK_ATTN_QKNORM", "0")


def test_pdl_switch_adds_the_kernel_define_once(monkeypatch):
    monkeypatch.delenv("MPK_NVCC_DEFINES", raising=False)
    monkeypatch.delenv("MPK_AR_LL", raising=False)
    monkeypatch.delenv("MPK_MK_PDL", raising=False)
    assert "-DMPK_PDL=1" not in nvcc._defines()
    monkeypatch.setenv("MPK_MK_PDL", "1")
    assert nvcc._defines().count("-DMPK_PDL=1") == 1
    assert nvcc.define_int("MPK_PDL", 0) == 1
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_PDL=1 -DMPK_ATT_STAGES=3")
    assert nvcc._defines() == ["-DMPK_PDL=1", "-DMPK_ATT_STAGES=3"]
    monkeypatch.setenv("MPK_MK_PDL", "yes")
    with pytest.raises(ValueError, match="MPK_MK_PDL"):
        nvcc._defines()


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


@pytest.mark.parametrize("env,defines,want", [(None, "", ["-DMPK_ATT_QKNORM=1"]), ("1", "", ["-DMPK_ATT_QKNORM=1"]),
                                              ("0", "", []), (None, "-DMPK_ATT_QKNORM=0", ["-DMPK_ATT_QKNORM=0"])])
def test_attention_qk_norm_switch_sets_the_build_define(monkeypatch, env, defines, want):
    """MPK_ATTN_QKNORM (on unless =0, as Tiling.attn_qk_norm) adds -DMPK_ATT_QKNORM=1 to every build, unless
    MPK_NVCC_DEFINES names the define itself (then its value stands)."""
    if env is None:
        monkeypatch.delenv("MPK_ATTN_QKNORM", raising=False)
    else:
        monkeypatch.setenv("MPK_ATTN_QKNORM", env)
    monkeypatch.setenv("MPK_NVCC_DEFINES", defines)
    assert [f for f in nvcc.build_flags() if f.startswith("-D")] == want


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
