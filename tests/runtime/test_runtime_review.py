"""Runtime review: bad devices, thread ranks of the megakernel, and MPK_* switches each refused with an error naming
what to pass (a ValueError, so LLM reports InvalidRequestError), not a torch internals message or a silent default."""
import re
from pathlib import Path

import pytest
import torch

from mpk_runtime import LLM
from mpk_runtime.engine.errors import InvalidRequestError
from mpk_runtime.envflags import env_int, kernel_timeout_s
from mpk_runtime.runtime import megakernel_runner as mr
from mpk_runtime.runtime.base import make_runner


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _fake_gpus(monkeypatch, n):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))


def test_reference_on_a_cuda_device_without_gpu_says_pass_cpu(monkeypatch):
    """(was a WorkerError about ATen_cuda raised from the weights' random generator)"""
    _no_gpu(monkeypatch)
    with pytest.raises(InvalidRequestError, match=r"no GPU is visible here; pass device='cpu'"):
        LLM("tiny-llama", backend="reference", device="cuda", max_seq_len=32)


def test_reference_on_a_cuda_index_that_is_not_there(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(ValueError, match=r"device='cuda:3' is not one of the 1 visible GPUs"):
        make_runner("reference", model="tiny-llama", device="cuda:3", max_seq_len=32)


@pytest.mark.parametrize("device", ["cuda:-1", "gpu"])
def test_a_device_string_torch_cannot_parse(device):
    """(torch.device raised a bare RuntimeError: LLM reported WorkerError, not the caller's mistake)"""
    with pytest.raises(InvalidRequestError, match=r"is not a device .*pass 'cpu', 'cuda' or 'cuda:N'"):
        LLM("tiny-llama", backend="reference", device=device, max_seq_len=32)


def test_megakernel_device_string_torch_cannot_parse(monkeypatch):
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(mr.NoGPUError, match="is not a device"):
        mr.require_gpu("gpu")


@pytest.mark.parametrize("backend", ["pyvm", "torch"])
def test_cpu_runners_take_a_cpu_torch_device(backend):
    """device=torch.device("cpu") was refused: "the pyvm backend runs on the CPU" (a device is not equal to "cpu")."""
    r = make_runner(backend, model="tiny-llama", device=torch.device("cpu"), max_seq_len=32, max_batch=1)
    assert r.kv_spec().max_seq_len == 32


def test_megakernel_tp_as_threads_of_one_process_is_refused(monkeypatch):
    """The in-process executor's ranks are threads: NVSHMEM is one PE per process (rank 1's thread attached to rank
    0's heap), so tp > 1 on one (or more) GPUs must say which executor runs it, before any CUDA call."""
    _fake_gpus(monkeypatch, 1)
    with pytest.raises(InvalidRequestError, match=r"one process per rank.*executor='ray'"):
        LLM("tiny-llama", backend="megakernel", tp=2, plan=None, max_seq_len=32)


# --- environment switches --------------------------------------------------------------------------------------

@pytest.mark.parametrize("v", ["false", "off", "no", "2"])
def test_draw_graphs_switch_refuses_what_is_not_0_or_1(monkeypatch, v):
    """MPK_DRAW_GRAPHS=false (and =off) turned the graphs ON: anything but "0" was on."""
    from mpk_runtime.runtime import draw_graphs
    monkeypatch.setenv("MPK_DRAW_GRAPHS", v)
    with pytest.raises(ValueError, match=r"MPK_DRAW_GRAPHS=.*expected 1 \(on\) or 0 \(off\)"):
        draw_graphs.enabled()
    monkeypatch.setenv("MPK_DRAW_GRAPHS", "0")
    assert not draw_graphs.enabled()


def test_prefill_graphs_switch_refuses_what_is_not_0_or_1(monkeypatch):
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.weights import get_weights
    from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
    from mpk_runtime.runtime.memory import KVStore
    cfg = load_config("tiny-llama")
    w = get_weights("tiny-llama", cfg, seed=0, dtype="float32")
    kv = KVStore(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    monkeypatch.setenv("MPK_PREFILL_GRAPHS", "off")
    with pytest.raises(ValueError, match="MPK_PREFILL_GRAPHS='off'"):
        ConventionalPrefill(cfg, w, kv, max_seq_len=64, page_size=16, dtype="float32", device=torch.device("cpu"))


def test_stage_ops_that_is_not_a_regex_names_the_variable(monkeypatch):
    """(a bare re.error: "missing ), unterminated subpattern at position 0")"""
    from mpk_runtime.ir.build import build_graph
    from mpk_runtime.models.config import load_config
    from mpk_runtime.models.weights import get_weights
    from mpk_runtime.runtime.memory import KVStore, RankMemory
    from mpk_runtime.runtime.packer import TaskPacker
    from mpk_runtime.tasks.build import build_task_graphs
    from mpk_runtime.tasks.tiling import Tiling
    cfg = load_config("tiny-llama")
    g = build_graph(cfg, mode="decode", batch=1, context_len=0, max_seq_len=64, tp=1, rank=0, dtype="bfloat16")
    tg = build_task_graphs([g], Tiling(num_sms=8))[0]
    kv = KVStore(cfg.num_layers, 5, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    mem = RankMemory(g, get_weights("tiny-llama", cfg, seed=0, dtype="bfloat16"), kv)
    monkeypatch.setenv("MPK_STAGE_OPS", "(o_proj")
    with pytest.raises(ValueError, match=r"MPK_STAGE_OPS='\(o_proj': not a regular expression"):
        TaskPacker(tg, mem, 0x6000, cfg.head_dim, device="cpu")


@pytest.mark.parametrize("v", ["²", "١"])
def test_env_int_refuses_non_ascii_digits_by_name(monkeypatch, v):
    """"²".isdigit() is True and int("²") raised "invalid literal for int()" naming no variable."""
    monkeypatch.setenv("MPK_X", v)
    with pytest.raises(ValueError, match=r"MPK_X=.*expected an integer from 1 to 64"):
        env_int("MPK_X", 4)


def test_kernel_timeout_that_overflows_int64_nanoseconds_is_refused(monkeypatch):
    """timeout_s=inf was accepted and int(inf * 1e9) raised OverflowError in Megakernel; 1e12 s overflowed the
    int64 launch parameters (MPK_KERNEL_TIMEOUT_S=inf was already refused: the argument now agrees)."""
    for bad in (float("inf"), 1e12):
        with pytest.raises(ValueError, match="timeout_s="):
            kernel_timeout_s(bad)
    monkeypatch.setenv("MPK_KERNEL_TIMEOUT_S", "1e12")
    with pytest.raises(ValueError, match="MPK_KERNEL_TIMEOUT_S"):
        kernel_timeout_s()
    assert kernel_timeout_s(3600.0) == 3600.0


def test_runtime_reads_mpk_switches_through_envflags():
    """A switch read as `os.environ.get("MPK_...") != "0"` took "false" / "off" for on, and int(os.environ...) failed
    naming nothing (MPK_DECODE_WARMUP, MPK_SMEM_FLOOR_KB on the GPU path): runtime modules read MPK_* through
    envflags, except the two that parse and refuse their own values (MPK_STAGE_OPS a regex, MPK_PAGED_SHAPE)."""
    own_parsers = {"MPK_STAGE_OPS", "MPK_PAGED_SHAPE"}
    root = Path(__file__).resolve().parents[2] / "mpk_runtime" / "runtime"
    raw = {(p.name, m) for p in root.glob("*.py")
           for m in re.findall(r"os\.environ\.get\(\s*[\"'](MPK_\w+)", p.read_text())}
    assert {(f, v) for f, v in raw if v not in own_parsers} == set()


# --- the megakernel's shape limits ---------------------------------------------------------------------------------

def test_megakernel_shape_limits_are_named_before_packing(monkeypatch):
    """A model past the device code's limits (head_dim > MAX_HEAD_DIM, more than MAX_GS q heads a KV head, rows not
    in 16-byte vectors) met a bare AssertionError in the packer (qkv_rope packs before attention's own message); it is
    refused when the runner is made, naming each limit and the backend that runs it. Every preset passes."""
    import dataclasses
    from mpk_runtime.codegen import layout as L
    from mpk_runtime.models import PRESETS
    from mpk_runtime.runtime.packer import megakernel_shape_problems
    for name, cfg in PRESETS.items():
        assert megakernel_shape_problems(cfg) == [], name
    base = PRESETS["tiny-llama"]
    d = L.CONSTANTS["MAX_HEAD_DIM"]
    assert "head_dim" in megakernel_shape_problems(dataclasses.replace(base, head_dim=2 * d))[0]
    assert "head_dim" in megakernel_shape_problems(dataclasses.replace(base, head_dim=36))[0]
    gs = L.CONSTANTS["MAX_GS"] * 2
    p = megakernel_shape_problems(dataclasses.replace(base, num_heads=gs, num_kv_heads=1))
    assert len(p) == 1 and "q heads a KV head" in p[0]
    p = megakernel_shape_problems(dataclasses.replace(base, hidden_size=base.hidden_size + 4))
    assert len(p) == 1 and "hidden_size" in p[0]
    # through LLM: the runner's config has head_dim 2 x the limit
    _fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(mr, "load_config", lambda m: dataclasses.replace(base, head_dim=2 * d))
    with pytest.raises(InvalidRequestError, match=r"cannot run this model's shape: head_dim .*use backend 'torch'"):
        LLM("tiny-llama", backend="megakernel", plan=None, max_seq_len=32)
