"""mpk_runtime.envflags: on/off and integer switches checked by name; a removed switch that is still set is an
error; `switches()` lists the MPK_* switches a measurement ran under (set, non-empty, paths and timeouts left out)."""
import pytest

from mpk_runtime.envflags import env_choice, env_flag, env_int, env_removed, env_seconds, kernel_timeout_s, switches


def test_flags_and_ints_are_checked(monkeypatch):
    monkeypatch.setenv("MPK_X_FLAG", "")
    assert env_flag("MPK_X_FLAG", default=True) is True
    monkeypatch.setenv("MPK_X_FLAG", "0")
    assert env_flag("MPK_X_FLAG", default=True) is False
    monkeypatch.setenv("MPK_X_FLAG", "on")
    with pytest.raises(ValueError, match="MPK_X_FLAG='on'"):
        env_flag("MPK_X_FLAG")
    monkeypatch.setenv("MPK_X_INT", "9")
    with pytest.raises(ValueError, match="from 0 to 8"):
        env_int("MPK_X_INT", 1, lo=0, hi=8)


def test_choices_are_checked(monkeypatch):
    monkeypatch.delenv("MPK_X_CHOICE", raising=False)
    assert env_choice("MPK_X_CHOICE", ("a", "b"), "b") == "b"
    monkeypatch.setenv("MPK_X_CHOICE", " a ")
    assert env_choice("MPK_X_CHOICE", ("a", "b"), "b") == "a"
    monkeypatch.setenv("MPK_X_CHOICE", "c")
    with pytest.raises(ValueError, match=r"MPK_X_CHOICE='c': expected one of a, b \(unset: b\)"):
        env_choice("MPK_X_CHOICE", ("a", "b"), "b")


def test_removed_switches_raise_when_set(monkeypatch):
    monkeypatch.delenv("MPK_X_GONE", raising=False)
    env_removed("MPK_X_GONE", "no gain")
    monkeypatch.setenv("MPK_X_GONE", " ")
    env_removed("MPK_X_GONE", "no gain")
    monkeypatch.setenv("MPK_X_GONE", "0")
    env_removed("MPK_X_GONE", "no gain", allowed=("0",))
    with pytest.raises(ValueError, match=r"MPK_X_GONE='0': this option was removed \(no gain\); unset MPK_X_GONE"):
        env_removed("MPK_X_GONE", "no gain")
    monkeypatch.setenv("MPK_X_GONE", "1")
    with pytest.raises(ValueError, match="MPK_X_GONE='1': this option was removed"):
        env_removed("MPK_X_GONE", "no gain", allowed=("0",))


def test_switches_are_the_set_mpk_variables_but_paths_and_timeouts(monkeypatch):
    for k in [k for k in __import__("os").environ if k.startswith("MPK_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MPK_ATT_WIDE", "0")
    monkeypatch.setenv("MPK_ATT_GROUPS", "")
    monkeypatch.setenv("MPK_CACHE_DIR", "/tmp/c")
    monkeypatch.setenv("MPK_KERNEL_TIMEOUT_S", "60")
    monkeypatch.setenv("MPK_NVCC_DEFINES", "-DMPK_ATT_STAGES=3")
    assert switches() == {"MPK_ATT_WIDE": "0", "MPK_NVCC_DEFINES": "-DMPK_ATT_STAGES=3"}


def test_seconds_and_the_kernel_timeout(monkeypatch):
    monkeypatch.delenv("MPK_KERNEL_TIMEOUT_S", raising=False)
    assert kernel_timeout_s() == 2.0
    monkeypatch.setenv("MPK_KERNEL_TIMEOUT_S", " 60 ")
    assert kernel_timeout_s() == 60.0
    assert kernel_timeout_s(0.5) == 0.5          # an explicit value wins over the variable
    for bad in ("0", "-1", "abc", "inf", "nan"):
        monkeypatch.setenv("MPK_KERNEL_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=rf"MPK_KERNEL_TIMEOUT_S='{bad}': expected a positive number of seconds"):
            kernel_timeout_s()
    with pytest.raises(ValueError, match="timeout_s=0: expected a positive"):
        kernel_timeout_s(0)
    monkeypatch.setenv("MPK_X_S", "")
    assert env_seconds("MPK_X_S", 1.5) == 1.5
