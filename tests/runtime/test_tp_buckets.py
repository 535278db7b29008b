"""runtime/tp_buckets.py on the CPU: the book a TP group's GPU runner gets (one whole-step megakernel per bucket),
what it refuses, and that such a book decodes the reference's tokens on the CPU twin at tp=2 (the same plans, task
graphs and tilings the GPU kernels are built from; the GPU side: scripts/gpu_check_ray.py --compare-plan-none)."""
import pytest
import torch

from mpk_runtime import LLM, SamplingParams
from mpk_runtime.models import PRESETS, ReferenceModel
from mpk_runtime.models.weights import get_weights
from mpk_runtime.planner import plan_book
from mpk_runtime.runtime.tp_buckets import TP_FAMILIES, plan_families, tp_book_plans


def test_plan_families():
    assert plan_families("megakernel", 2) == TP_FAMILIES
    assert plan_families("megakernel", 1) is None and plan_families("pyvm", 2) is None


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_tp_book_plans_takes_the_mono_book(name):
    cfg = PRESETS[name]
    book = plan_book(cfg, 2, [1, 4, 8], families=TP_FAMILIES, cache=False)
    plans = tp_book_plans(book, cfg, 128)
    assert list(plans) == [1, 4, 8]
    assert all(p.name in TP_FAMILIES and p.tp == 2 for p in plans.values())


def test_tp_book_plans_refuses_segmented_plans():
    cfg = PRESETS["tiny-llama"]
    book = plan_book(cfg, 2, [1, 8], families=("conventional",), cache=False)
    with pytest.raises(ValueError, match="not one megakernel for the whole step.*families=") as e:
        tp_book_plans(book, cfg, 128)
    assert "plan=None" in str(e.value)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_mono_book_at_tp2_decodes_the_reference_tokens(name):
    """Four requests of different lengths and max_tokens, so steps run 4, 3, 2 and 1 rows (buckets 4, 4, 2, 1):
    greedy tokens equal the fp32 reference model's, and every such step ran a plan of the book (the CPU twin keys
    them by the step's rows)."""
    cfg = PRESETS[name]
    book = plan_book(cfg, 2, [1, 2, 4], families=TP_FAMILIES, cache=False)
    llm = LLM(name, backend="pyvm", tp=2, dtype="float32", max_batch=4, max_seq_len=64, plan=book)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2]]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in (3, 6, 9, 12)],
                        use_tqdm=False)
    ref = ReferenceModel(cfg, get_weights(name, cfg, seed=0, dtype="float32"))
    for p, o, n in zip(prompts, outs, (3, 6, 9, 12)):
        assert list(o.token_ids) == ref.generate_greedy(torch.tensor([p]), n)[0].tolist(), (p, o.token_ids)
    used = llm.executor.collective_rpc("health")[0]["plans_used"]
    assert set(used) == {1, 2, 3, 4} and set(used.values()) <= set(TP_FAMILIES)
    llm.shutdown()


def test_heap_bytes_counts_every_bucket_and_the_heap_is_sized(monkeypatch):
    from mpk_runtime.runtime.nvshmem import heap_size_env
    from mpk_runtime.runtime.tp_buckets import heap_bytes
    cfg = PRESETS["llama-3.1-70b"]
    one = heap_bytes(cfg, 2, [128], 4096, 128)
    every = heap_bytes(cfg, 2, [1, 8, 32, 128], 4096, 128)
    # 80 layers x 2 partial-sum buffers of 128 rows x 8192 fp32, parity-doubled: ~2.5 GiB, past the 1 GiB default
    assert 2.4 * 2**30 < one < 2.7 * 2**30 and one < every < one * 1.35
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "1g")   # (recorded, so what heap_size_env sets is undone)
    monkeypatch.delenv("NVSHMEM_SYMMETRIC_SIZE")
    assert heap_size_env(10 << 20) is None and "NVSHMEM_SYMMETRIC_SIZE" not in __import__("os").environ
    got = heap_size_env(every)
    assert int(got) >= every * 1.25 and int(got) % (256 << 20) == 0
    monkeypatch.setenv("NVSHMEM_SYMMETRIC_SIZE", "2g")   # the caller's value is kept
    assert heap_size_env(every) == "2g"
