"""scripts/bench_kv_pressure.py: both runners it drives. The modelled one (the policy's measurement) must give reserve
and lazy the same outputs and more rows a step to lazy under page pressure; the length oracle around a real runner
must stop every request exactly at its drawn length, whatever the model drew, so both modes do the same work."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_kv_pressure as bkp  # noqa: E402


def _rows(tmp_path, monkeypatch, argv):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bkp.main(argv) == 0
    return json.loads((tmp_path / "bench_kv_pressure.json").read_text())


def test_modelled_runner_lazy_runs_more_rows(tmp_path, monkeypatch):
    d = _rows(tmp_path, monkeypatch, ["--requests", "48", "--kv-seqs", "4", "--max-batch", "32", "--max-tokens", "256",
                                      "--max-seq-len", "512", "--mean-out", "40", "--prompt-len", "32,64",
                                      "--step-ms", "1:0.01,128:0.02"])
    reserve, lazy = d["rows"]
    assert reserve["mode"] == "reserve" and lazy["mode"] == "lazy" and reserve["tokens"] == lazy["tokens"]
    assert lazy["mean_rows"] > 2 * reserve["mean_rows"] and reserve["preemptions"] == 0


@pytest.mark.parametrize("backend", [["torch"], ["pyvm", "--plan", "auto"],
                                     ["torch", "--max-num-batched-tokens", "14"]], ids=["torch", "pyvm-plan", "split"])
def test_length_oracle_stops_each_request_at_its_length(tmp_path, monkeypatch, backend):
    """(pyvm with plan auto: the inner runner's plan resolved by the oracle, as the GPU run's megakernel needs; split:
    a step's token budget of 14 cuts prompt starts into chunks shorter than the oracle's 12-token head.)"""
    argv = ["--backend", *backend, "--model", "tiny-llama", "--requests", "16", "--max-tokens", "40", "--mean-out", "10",
            "--max-seq-len", "96", "--max-batch", "8", "--kv-seqs", "2", "--prompt-len", "12,24"]
    d = _rows(tmp_path, monkeypatch, argv)
    g = torch.Generator().manual_seed(1)
    want = sum(min(40, 1 + int(-torch.log(torch.rand((), generator=g)).item() * 10)) for _ in range(16))
    assert [r["tokens"] for r in d["rows"]] == [want, want]
    assert d["rows"][1]["mean_rows"] > d["rows"][0]["mean_rows"]
