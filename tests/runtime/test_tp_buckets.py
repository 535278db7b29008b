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
    book = plan_book(cfg, 2, [1, 4, 8], families=("mono", "mono-w2"), cache=False)
    plans = tp_book_plans(book, cfg, 128)
    assert list(plans) == [1, 4, 8]
    assert all(p.name in TP_FAMILIES and p.tp == 2 for p in plans.values())


def test_split_tp_book_parts_and_refusals():
    from mpk_runtime.runtime.tp_buckets import split_tp_book
    cfg = PRESETS["tiny-llama"]
    mono = plan_book(cfg, 2, [1, 8], families=("mono",), cache=False)
    conv = plan_book(cfg, 2, [4, 16], families=("conventional",), cache=False)
    both = dict(mono, buckets={**mono["buckets"], **conv["buckets"]})
    mk, cv = split_tp_book(both, cfg, 128)
    assert sorted(mk["buckets"]) == [1, 8] and sorted(cv["buckets"]) == [4, 16]
    assert split_tp_book(mono, cfg, 128)[1] is None and split_tp_book(conv, cfg, 128)[0] is None
    with pytest.raises(ValueError, match="conventional plans: TPBuckets"):
        tp_book_plans(both, cfg, 128)
    mixed = plan_book(cfg, 2, [1, 8], families=("attn-conv",), cache=False)
    with pytest.raises(ValueError, match="neither one megakernel.*nor all conventional.*families=") as e:
        split_tp_book(mixed, cfg, 128)
    assert "plan=None" in str(e.value)


def test_mk_only_book_replans_the_conventional_buckets():
    from mpk_runtime.runtime.tp_buckets import MK_FAMILIES, mk_only_book, split_tp_book
    cfg = PRESETS["tiny-llama"]
    book = plan_book(cfg, 2, [1, 8], families=TP_FAMILIES, cache=False)
    book["buckets"][8] = plan_book(cfg, 2, [8], families=("conventional",), cache=False)["buckets"][8]
    got = mk_only_book(book, cfg, 8, 128, 512)
    assert split_tp_book(got, cfg, 128)[1] is None
    assert got["buckets"][1] == book["buckets"][1] and got["buckets"][8]["name"] in MK_FAMILIES


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_mono_book_at_tp2_decodes_the_reference_tokens(name):
    """Four requests of different lengths and max_tokens, so steps run 4, 3, 2 and 1 rows (buckets 4, 4, 2, 1):
    greedy tokens equal the fp32 reference model's, and every such step ran a plan of the book (the CPU twin keys
    them by the step's rows)."""
    cfg = PRESETS[name]
    book = plan_book(cfg, 2, [1, 2, 4], families=("mono", "mono-w2"), cache=False)
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


def _tp2_decoders(cfg, w, book, run) -> dict:
    """Two TP ranks as threads, each with its shard, a KV store, a ConventionalPrefill and a PlannedDecoder over one
    communicator (as Ray workers hold an NCCL group): {rank: run(prefill, decoder)}."""
    from mpk_runtime.ir.shard import shard_for
    from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
    from mpk_runtime.runtime.megakernel_plans import PlannedDecoder
    from mpk_runtime.runtime.memory import KVStore
    from mpk_runtime.runtime.pyvm_runner import shard_weights
    from tp_threads import run_ranks

    def rank(r, comm):
        ws = shard_weights(cfg, w, 2, r)
        kv = KVStore(cfg.num_layers, 40, 4, shard_for(cfg, 2, r).n_kv, cfg.head_dim, torch.float32, poison=False)
        kw = dict(max_seq_len=32, page_size=4, dtype="float32", device=torch.device("cpu"), tp=2, rank=r, comm=comm)
        return run(ConventionalPrefill(cfg, ws, kv, **kw), PlannedDecoder(cfg, ws, kv, book, num_sms=4, backend="pyvm",
                                                                        **kw))
    return run_ranks(rank)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_conventional_decode_at_tp2_over_a_communicator(name):
    """PlannedDecoder at tp=2 with the conventional plan (what the planner picks from B=8 at tp=2): each rank holds its
    shard; the all-reduces, the distributed argmax and the logits' vocab gather go through the communicator. Steps of
    4, 1 and 3 rows (buckets 4, 2, 4), then a burst of 3 steps: logits and tokens equal the fp32 reference on both
    ranks."""
    from mpk_runtime.models import random_weights
    cfg = PRESETS[name].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    book = plan_book(cfg, 2, (2, 4), context=16, families=("conventional",), cache=False)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]

    def run(pre, dec):
        toks, lens, steps = [], [], []
        for i, p in enumerate(prompts):
            _, tok = pre.run(p, 0, tables[i])
            toks.append(tok)
            lens.append(len(p))
        for rows in ([0, 1, 2, 3], [2], [3, 0, 1]):
            lg, nxt = dec.decode([toks[i] for i in rows], [lens[i] for i in rows], [tables[i] for i in rows])
            steps.append((rows, [toks[i] for i in rows], lg, nxt.tolist()))
            for j, i in enumerate(rows):
                toks[i], lens[i] = int(nxt[j]), lens[i] + 1
        burst = dec.decode_steps([toks[i] for i in (0, 1, 2)], [lens[i] for i in (0, 1, 2)],
                                 [tables[i] for i in (0, 1, 2)], None, 3)
        return steps, burst.tolist(), dict(dec.used)

    out = _tp2_decoders(cfg, w, book, run)
    ref = ReferenceModel(cfg, w)
    caches, lens, seqs = [], [], [list(p) for p in prompts]
    for p in prompts:
        c = ref.new_cache(1, 32)
        lg = ref.forward(torch.tensor([p]), torch.zeros(1, dtype=torch.long), c)[0, -1]
        seqs[len(caches)].append(int(lg.argmax()))
        caches.append(c)
        lens.append(len(p))
    for rows, fed, lg, nxt in out[0][0]:
        assert lg.shape == (len(rows), cfg.vocab_size)
        for j, i in enumerate(rows):
            assert fed[j] == seqs[i][-1]
            want = ref.forward(torch.tensor([[seqs[i][-1]]]), torch.tensor([lens[i]]), caches[i])[0, 0]
            assert ((lg[j] - want).abs().max() / want.abs().max()) < 1e-5, (rows, i)
            assert nxt[j] == int(want.argmax())
            seqs[i].append(nxt[j])
            lens[i] += 1
    for j, i in enumerate((0, 1, 2)):   # the burst: three more greedy steps of rows 0-2, tokens fed on the device
        for k in range(3):
            want = ref.forward(torch.tensor([[seqs[i][-1]]]), torch.tensor([lens[i]]), caches[i])[0, 0]
            assert out[0][1][j][k] == int(want.argmax()), (i, k)
            seqs[i].append(int(want.argmax()))
            lens[i] += 1
    assert out[0][0][0][3] == out[1][0][0][3] and out[0][1] == out[1][1]   # both ranks drew the same tokens
    assert set(out[0][2]) == {2, 4} and set(out[0][2].values()) == {"conventional"}


def test_planned_decoder_at_tp2_refuses_megakernel_plans_and_a_missing_communicator():
    from mpk_runtime.runtime.megakernel_plans import PlannedDecoder
    from mpk_runtime.runtime.memory import KVStore
    cfg = PRESETS["tiny-llama"].replace(dtype="float32")
    kv = KVStore(cfg.num_layers, 8, 4, 1, cfg.head_dim, torch.float32)
    book = plan_book(cfg, 2, (1,), context=16, families=("mono",), cache=False)
    kw = dict(max_seq_len=32, page_size=4, num_sms=4, dtype="float32", device=torch.device("cpu"), backend="pyvm")
    with pytest.raises(ValueError, match="communicator"):
        PlannedDecoder(cfg, {}, kv, book, tp=2, **kw)
    from mpk_runtime.runtime.comm import ThreadGroup
    dec = PlannedDecoder(cfg, {}, kv, book, tp=2, comm=ThreadGroup(2).comm(0), **kw)
    with pytest.raises(ValueError, match="megakernel segments"):
        dec.decode([1], [3], [[1]])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_conventional_decode_at_tp2_samples_as_tp1(name):
    """Sampled rows through the conventional plan at tp=2 (the distributed top-k draw inside the step; a full-vocabulary
    row drawn from the logits gathered through the communicator) draw the tokens the same plan draws at tp=1: the
    sampling contract (ir/sampling.py) is the same on every executor and degree. Four rows (greedy, top-k 20, top-k
    64 with top-p 0.8, full top-p 0.9), four steps one at a time and a burst of three."""
    from mpk_runtime.models import random_weights
    from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
    from mpk_runtime.runtime.device_sampling import DeviceSampling
    from mpk_runtime.runtime.megakernel_plans import PlannedDecoder
    from mpk_runtime.runtime.memory import KVStore
    cfg = PRESETS[name].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    rows = [None, DeviceSampling(1.0, 20, 1.0, 11), DeviceSampling(0.7, 64, 0.8, 12),
            DeviceSampling(1.3, 0, 0.9, 13, full=True)]
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]

    def run(pre, dec):
        toks = [pre.run(p, 0, tables[i], rows[i])[1] for i, p in enumerate(prompts)]
        lens = [len(p) for p in prompts]
        out = [list(toks)]
        for _ in range(4):
            _, nxt = dec.decode(toks, lens, tables, rows, want_logits=False)
            toks, lens = nxt.tolist(), [n + 1 for n in lens]
            out.append(list(toks))
        out += dec.decode_steps(toks, lens, tables, rows, 3).t().tolist()
        return out

    def tp1():
        kv = KVStore(cfg.num_layers, 40, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, poison=False)
        kw = dict(max_seq_len=32, page_size=4, dtype="float32", device=torch.device("cpu"))
        book1 = plan_book(cfg, 1, (4,), context=16, families=("conventional",), cache=False)
        return run(ConventionalPrefill(cfg, w, kv, **kw), PlannedDecoder(cfg, w, kv, book1, num_sms=4, backend="pyvm",
                                                                         **kw))

    one = tp1()
    two = _tp2_decoders(cfg, w, plan_book(cfg, 2, (4,), context=16, families=("conventional",), cache=False), run)
    assert two[0] == two[1] == one, (one, two[0])
    rows[1:] = [DeviceSampling(r.temperature, r.top_k, r.top_p, r.seed + 100, r.full) for r in rows[1:]]
    other = tp1()   # (other seeds draw other tokens: the comparison above is about the draws, not only argmaxes)
    assert [t[0] for t in other] == [t[0] for t in one] and other != one
