"""The default profile follows the card: PROFILE_BY_CARD by the CUDA device's name, MPK_PLANNER_PROFILE over it,
DEFAULT_PROFILE for a card without its own profile and for a machine without a GPU."""
import json

import pytest

from mpk_runtime.planner import profile as P
from mpk_runtime.planner.profile import HardwareProfile


def test_every_card_profile_loads_and_names_its_card():
    for card, name in P.PROFILE_BY_CARD.items():
        prof = HardwareProfile.load(name)
        assert prof.name == name
        assert P.card_mismatch(name, f"NVIDIA {card} 80GB HBM3") is None   # no warning on its own card


def test_profile_for_card_by_device_name(monkeypatch):
    monkeypatch.setattr(P, "PROFILE_BY_CARD", {"H200": "h200_v56", "H100": "h100_x", "GH200": "gh200_x"})
    assert P.profile_for_card("NVIDIA H100 80GB HBM3") == "h100_x"
    assert P.profile_for_card("NVIDIA H200") == "h200_v56"
    assert P.profile_for_card("NVIDIA GH200 480GB") == "gh200_x"   # the longest key, not "H200" inside it
    assert P.profile_for_card("NVIDIA A100-SXM4-80GB") == P.DEFAULT_PROFILE


def test_default_profile_name_env_then_card_then_default(monkeypatch):
    import torch
    monkeypatch.setattr(P, "PROFILE_BY_CARD", {"H200": "h200_v56", "H100": "h100_x"})
    monkeypatch.delenv("MPK_PLANNER_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert P.default_profile_name() == P.DEFAULT_PROFILE
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert P.default_profile_name() == "h100_x"
    monkeypatch.setenv("MPK_PLANNER_PROFILE", "h200_v52")
    assert P.default_profile_name() == "h200_v52"


def test_load_without_a_name_takes_the_cards_profile(monkeypatch, tmp_path):
    import torch
    d = json.loads(HardwareProfile.load(P.DEFAULT_PROFILE).to_json())
    d["name"] = "h100_test"
    path = tmp_path / "h100_test.json"
    path.write_text(json.dumps(d))
    monkeypatch.delenv("MPK_PLANNER_PROFILE", raising=False)
    monkeypatch.setattr(P, "PROFILE_BY_CARD", {"H100": str(path)})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H100 80GB HBM3")
    assert HardwareProfile.load().name == "h100_test"
    with pytest.raises(FileNotFoundError, match="no hardware profile"):
        monkeypatch.setattr(P, "PROFILE_BY_CARD", {"H100": "h100_missing"})
        HardwareProfile.load()


SYNC_LOG = """intra-GPU flag one-way latency: 0.452 us (events), 810 cycles
grid counter barrier, 132 CTAs: 1.010 us per barrier
intra-GPU flag one-way latency: 0.440 us (events), 800 cycles
grid counter barrier, 132 CTAs: 0.990 us per barrier
read-only stream 1 CTA/SM x  256 thr: 2.10 TB/s
read-only stream on  16 SMs: 1.40 TB/s
read-only stream on  32 SMs: 2.30 TB/s
read-only stream on 132 SMs: 3.05 TB/s
"""


def test_card_base_takes_sync_bw_numbers(tmp_path):
    """scripts/card_base.py: sync_bw.cu's log (the shared/gpu tool's own lines) into a copy of the base profile; a
    truncated log is an error naming what is missing, not the base's numbers kept silently."""
    import subprocess
    import sys
    log = tmp_path / "sync.log"
    log.write_text(SYNC_LOG)
    out = tmp_path / "h100_base.json"
    r = subprocess.run([sys.executable, "scripts/card_base.py", "--sync-log", str(log), "--base", P.DEFAULT_PROFILE,
                        "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    prof = HardwareProfile.load(str(out))
    base = HardwareProfile.load(P.DEFAULT_PROFILE)
    assert prof.name == "h100_base" and prof.sync_us == 0.44 and prof.barrier_us == 0.99
    assert prof.bw(132) == pytest.approx(3.05e12) and prof.bw(16) == pytest.approx(1.40e12)
    assert prof.bw(1) == pytest.approx(base.bw(1) * 1.40e12 / base.bw(16))
    assert prof.regimes == base.regimes and prof.conv_attn_us_by_shape == base.conv_attn_us_by_shape
    log.write_text(SYNC_LOG.split("read-only")[0])
    r = subprocess.run([sys.executable, "scripts/card_base.py", "--sync-log", str(log), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "lacks stream by SMs" in r.stderr


def test_card_profile_takes_only_this_cards_curves(tmp_path):
    """scripts/card_profile.py: the measured profile with the card's conventional attention curves; a shape the
    base had a curve for and this card did not measure is dropped (named in the source), later files win."""
    import subprocess
    import sys
    base = json.loads(HardwareProfile.load(P.DEFAULT_PROFILE).to_json())
    (tmp_path / "m.json").write_text(json.dumps(base))
    a = {"meta": {"machine": "NVIDIA H100"}, "conv_attn_us_by_shape": {"8x64x4@paged": [[1, 513, 10.0], [2, 513, 11.0]]},
         "conv_attn_step_us_by_shape": {"8x64x4@paged": [[1, 513, 1.0]]}, "conv_attn_shape_by_shape": {}}
    b = {"meta": {"machine": "NVIDIA H100"}, "conv_attn_us_by_shape": {"8x64x4@paged": [[1, 513, 12.0]]},
         "conv_attn_step_us_by_shape": {}, "conv_attn_shape_by_shape": {}}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    r = subprocess.run([sys.executable, "scripts/card_profile.py", "--measured", str(tmp_path / "m.json"), "--curves",
                        f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}", "--name", "h100_t"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["name"] == "h100_t"
    assert d["conv_attn_us_by_shape"] == {"8x64x4@paged": [[1, 513, 12.0], [2, 513, 11.0]]}
    assert "8x128x4@paged" in d["source"] and "dropped" in d["source"]
    HardwareProfile(**{k: v for k, v in d.items() if k in HardwareProfile.__dataclass_fields__})


def test_an_unknown_profile_names_the_cards_profiles():
    with pytest.raises(FileNotFoundError, match="by card: .*H100: h100_v4"):
        HardwareProfile.load("a100")
