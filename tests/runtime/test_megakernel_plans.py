"""The GPU runner's plan machinery (runtime/megakernel_plans.py, runtime/conventional_prefill.py), run on the CPU
twin: PlannedDecoder picks the bucket of each step's row count, writes the step's inputs in place (inactive padding
rows), and every plan family gives the reference model's logits; ConventionalPrefill gives the reference prefill
logits; the key-length cap of a captured step covers the longest sequence."""
import dataclasses

import pytest
import torch

from mpk_runtime.ir.shard import shard_for
from mpk_runtime.models import PRESETS, ReferenceModel, random_weights
from mpk_runtime.planner import plan_book
from mpk_runtime.runtime.conventional_prefill import ConventionalPrefill
from mpk_runtime.runtime.megakernel_plans import PlannedDecoder, kv_cap
from mpk_runtime.runtime.memory import KVStore

PS, MAXLEN = 4, 32


def _setup(name):
    cfg = PRESETS[name].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    kv = KVStore(cfg.num_layers, 40, PS, shard_for(cfg, 1, 0).n_kv, cfg.head_dim, torch.float32, poison=False)
    return cfg, w, kv


def test_kv_cap():
    assert kv_cap(1, 4096) == 256 and kv_cap(256, 4096) == 256 and kv_cap(257, 4096) == 512
    assert kv_cap(3000, 2048) == 2048


@pytest.mark.parametrize("family,share", [("mono", False), ("attn-conv", False), ("conventional", False),
                                          ("conventional", True)])
def test_planned_decoder_matches_reference(family, share):
    cfg, w, kv = _setup("tiny-qwen3")
    book = plan_book(cfg, 1, (2, 4), context=16, families=(family,))
    dec = PlannedDecoder(cfg, w, kv, book, max_seq_len=MAXLEN, page_size=PS, num_sms=4, dtype="float32",
                         device=torch.device("cpu"), backend="pyvm")
    pre = ConventionalPrefill(cfg, w, kv, max_seq_len=MAXLEN, page_size=PS, dtype="float32",
                              device=torch.device("cpu"), share_activations=share)
    ref = ReferenceModel(cfg, w)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]
    caches, toks, lens = [], [], []
    for i, p in enumerate(prompts):
        c = ref.new_cache(1, MAXLEN)
        want = ref.forward(torch.tensor([p]), torch.zeros(1, dtype=torch.long), c)[0, -1]
        got, tok = pre.run(p, 0, tables[i])
        assert ((got - want).abs().max() / want.abs().max()) < 1e-5
        assert tok == int(want.argmax())
        caches.append(c)
        toks.append(tok)
        lens.append(len(p))
    # steps of 4, 1 and 3 live rows (buckets 4, 2, 4): rows past n are padding
    for rows in ([0, 1, 2, 3], [2], [3, 0, 1]):
        lg, nxt = dec.decode([toks[i] for i in rows], [lens[i] for i in rows], [tables[i] for i in rows])
        assert lg.shape[0] == len(rows)
        for j, i in enumerate(rows):
            want = ref.forward(torch.tensor([[toks[i]]]), torch.tensor([lens[i]]), caches[i])[0, 0]
            assert ((lg[j] - want).abs().max() / want.abs().max()) < 1e-5, (family, rows, i)
            assert int(nxt[j]) == int(want.argmax())
            toks[i], lens[i] = int(nxt[j]), lens[i] + 1
    assert set(dec.used) == {2, 4} and set(dec.used.values()) == {family}
    with pytest.raises(ValueError, match="largest bucket"):
        dec.decode([1] * 5, [1] * 5, [tables[0]] * 5)


def _prefill_case(name):
    """A CPU ConventionalPrefill over a fresh KV store, the reference, and four prompts of 2-18 tokens with their
    block tables and reference caches: (kv, prefill, reference, prompts, tables, caches)."""
    cfg, w, kv = _setup(name)
    pre = ConventionalPrefill(cfg, w, kv, max_seq_len=MAXLEN, page_size=PS, dtype="float32",
                              device=torch.device("cpu"))
    ref = ReferenceModel(cfg, w)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [10, 11],
               [14, 15, 16, 17, 18]]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]
    return kv, pre, ref, prompts, tables, [ref.new_cache(1, MAXLEN) for _ in prompts]


@pytest.mark.parametrize("exact", ["", "16"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_batched_prefill_of_unequal_chunks_matches_reference(name, exact, monkeypatch):
    """The chunks of a step, of different lengths and start positions (a continued chunk too), run left-padded
    in few graphs; each chunk's last-token logits, its KV (checked by decoding after) and its drawn token equal
    the reference."""
    monkeypatch.setenv("MPK_PREFILL_EXACT_KEYS", exact)   # "16": every group over its exact keys (attention_rows)
    kv, pre, ref, prompts, tables, caches = _prefill_case(name)
    # sequence 3 already holds its first 2 tokens (a continued chunk starting at position 2)
    pre.run_many([(prompts[3][:2], 0, tables[3], None)])
    ref.forward(torch.tensor([prompts[3][:2]]), torch.zeros(1, dtype=torch.long), caches[3])
    runs = pre.graph_runs
    chunks = [(p, 0, tables[i], None) for i, p in enumerate(prompts[:3])] + [(prompts[3][2:], 2, tables[3], None)]
    lg, drawn = pre.run_many(chunks)
    # the three fresh prompts packed (one graph), the continued chunk padded (one 16-token graph)
    assert pre.graph_runs - runs == 2 and pre.packed_runs == 2
    for i, (toks, start, _, _) in enumerate(chunks):
        want = ref.forward(torch.tensor([toks]), torch.tensor([start]), caches[i])[0, -1]
        assert ((lg[i] - want).abs().max() / want.abs().max()) < 1e-5, i
        assert drawn[i] == int(want.argmax())
    # the KV written by the padded graphs is the reference's: one decode step per sequence through the prefill path
    for i, p in enumerate(prompts):
        got, _ = pre.run([drawn[i], 1], len(p), tables[i])
        want = ref.forward(torch.tensor([[drawn[i], 1]]), torch.tensor([len(p)]), caches[i])[0, -1]
        assert ((got - want).abs().max() / want.abs().max()) < 1e-5, i
    assert (pre.exact_runs > 0) == bool(exact)


@pytest.mark.parametrize("packed", ["2048", "0"])
def test_batched_prefill_samples_like_a_lone_chunk(packed, monkeypatch):
    """Device sampling in a packed step or a padded group draws what the chunk draws alone (the RNG counter is the
    chunk's last position, not the padded or packed row's)."""
    from mpk_runtime.runtime.device_sampling import DeviceSampling
    monkeypatch.setenv("MPK_PREFILL_PACKED_ROWS", packed)
    cfg, w, kv = _setup("tiny-llama")
    pre = ConventionalPrefill(cfg, w, kv, max_seq_len=MAXLEN, page_size=PS, dtype="float32",
                              device=torch.device("cpu"))
    sp = [DeviceSampling(1.0, 0, 1.0, 1000 + i) for i in range(3)]
    chunks = [([5, 6, 7], 0, list(range(1, 9)), sp[0]), ([8, 9], 0, list(range(9, 17)), sp[1]),
              ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], 0, list(range(17, 25)), sp[2])]
    _, together = pre.run_many(chunks, want_logits=False)
    assert pre.packed_runs == (packed != "0")
    from mpk_runtime.runtime.pyvm_runner import TPGroup     # the unpadded prefill (one graph of exactly T rows)
    grp = TPGroup(cfg, [w], num_pages=40, page_size=PS, max_seq_len=MAXLEN, dtype="float32")
    alone = []
    for toks, start, table, s in chunks:
        grp.prefill(toks, start, table, s)
        alone.append(int(grp.last_next_tokens[0]))
    assert together == alone


def _tp2_prefill(cfg, w, run) -> dict:
    """Two TP ranks as threads, each with its shard, a KV store and a ConventionalPrefill over one communicator (as
    Ray workers hold an NCCL group): {rank: run(prefill)}."""
    from mpk_runtime.runtime.pyvm_runner import shard_weights
    from tp_threads import run_ranks

    def rank(r, comm):
        kv = KVStore(cfg.num_layers, 40, PS, shard_for(cfg, 2, r).n_kv, cfg.head_dim, torch.float32, poison=False)
        return run(ConventionalPrefill(cfg, shard_weights(cfg, w, 2, r), kv, max_seq_len=MAXLEN, page_size=PS,
                                       dtype="float32", device=torch.device("cpu"), tp=2, rank=r, comm=comm))
    return run_ranks(rank)


@pytest.mark.parametrize("exact,packed", [("", "2048"), ("", "0"), ("16", "0")])
def test_batched_prefill_tp2_over_a_communicator(exact, packed, monkeypatch):
    """TP=2 ranks in separate "processes" (threads, each holding one shard and a communicator, as Ray workers hold
    an NCCL group): the prefill, packed or padded, gathers partial sums and vocab shards through it and gives the
    reference (exact "16": each rank's heads over the sequences' exact keys, attention_rows)."""
    monkeypatch.setenv("MPK_PREFILL_EXACT_KEYS", exact)
    monkeypatch.setenv("MPK_PREFILL_PACKED_ROWS", packed)
    cfg = PRESETS["tiny-qwen3"].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    ref = ReferenceModel(cfg, w)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    tables = [list(range(1, 9)), list(range(9, 17))]
    out = _tp2_prefill(cfg, w, lambda pre: pre.run_many([(p, 0, tables[i], None) for i, p in enumerate(prompts)]))
    for r in range(2):
        lg, drawn = out[r]
        for i, p in enumerate(prompts):
            want = ref.forward(torch.tensor([p]), torch.zeros(1, dtype=torch.long), ref.new_cache(1, MAXLEN))[0, -1]
            assert ((lg[i] - want).abs().max() / want.abs().max()) < 1e-5, (r, i)
            assert drawn[i] == int(want.argmax())
    with pytest.raises(ValueError, match="communicator"):
        ConventionalPrefill(cfg, w, KVStore(1, 2, PS, 1, cfg.head_dim, torch.float32), max_seq_len=MAXLEN,
                            page_size=PS, dtype="float32", device=torch.device("cpu"), tp=2)


def test_batched_prefill_tp2_draws_full_rows_from_the_gathered_shards():
    """TP=2 prefill with full-vocabulary rows (DeviceSampling.full): every rank gathers the vocab shards on its device
    and draws the same tokens, the full draw of the gathered logits (FullRows' torch ops), not the graph's argmax."""
    from mpk_runtime.runtime.device_sampling import DeviceSampling
    from mpk_runtime.runtime.full_sampling import FullRows
    cfg = PRESETS["tiny-qwen3"].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14], [15]]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(4)]
    rows = [DeviceSampling(2.0, 0, 1.0, 7, full=True), None, DeviceSampling(1.5, 0, 0.9, 8, full=True),
            DeviceSampling(3.0, 300, 1.0, 9, full=True)]
    out = _tp2_prefill(cfg, w, lambda pre: [pre.run_many([(p, 0, tables[i], rows[i]) for i, p in enumerate(prompts)],
                                                         want_logits=wl) for wl in (True, False)])
    lg, drawn = out[0][0]
    assert lg.shape[-1] == cfg.vocab_size
    want = torch.tensor([int(lg[i].argmax()) for i in range(len(prompts))])
    FullRows(rows, "cpu", cfg.vocab_size).draw(lg, torch.tensor([len(p) - 1 for p in prompts]), want, "torch")
    for r in range(2):
        for wl in range(2):
            assert out[r][wl][1] == want.tolist(), (r, wl)
    assert out[1][1][0] is None   # (want_logits=False: no logits copied)
    assert any(int(want[i]) != int(lg[i].argmax()) for i in (0, 2, 3))   # the rows were drawn, not argmax'd


def test_planned_bursts_resume_from_the_device():
    """decode_steps(resume=True) (LLMEngine's async_bursts): the rows of the last burst continue from the tokens it
    drew, read on the device, whatever token ids the call carries; two bursts of 3 + 2 steps give the reference's
    greedy continuation, and a resume without a previous burst is refused."""
    cfg, w, kv = _setup("tiny-llama")
    book = plan_book(cfg, 1, (2, 4), context=16, families=("mono",))
    dec = PlannedDecoder(cfg, w, kv, book, max_seq_len=MAXLEN, page_size=PS, num_sms=4, dtype="float32",
                         device=torch.device("cpu"), backend="pyvm")
    with pytest.raises(ValueError, match="previous burst"):
        dec.decode_steps([1, 2, 3], [3, 3, 3], [[1]] * 3, None, 2, resume=True)
    pre = ConventionalPrefill(cfg, w, kv, max_seq_len=MAXLEN, page_size=PS, dtype="float32",
                              device=torch.device("cpu"))
    ref = ReferenceModel(cfg, w)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    toks, lens, want = [], [], []
    for i, p in enumerate(prompts):
        _, tok = pre.run(p, 0, tables[i])
        toks.append(tok)
        lens.append(len(p))
        seq, c = list(p) + [tok], ref.new_cache(1, MAXLEN)
        lg = ref.forward(torch.tensor([seq]), torch.zeros(1, dtype=torch.long), c)[0, -1]
        for _ in range(5):
            seq.append(int(lg.argmax()))
            lg = ref.forward(torch.tensor([[seq[-1]]]), torch.tensor([len(seq) - 1]), c)[0, -1]
        want.append(seq[len(p) + 1:])
    first = dec.decode_steps(toks, lens, tables, None, 3)
    second = dec.decode_steps([0, 0, 0], [n + 3 for n in lens], tables, None, 2, resume=True)
    assert torch.cat([first, second], 1).tolist() == want


@pytest.mark.parametrize("B,width", [(4, 12), (64, 600)], ids=["small", "wide"])
def test_write_tables_leaves_what_a_full_rewrite_leaves(B, width):
    """fill_step's page tables (decode_io.write_tables: the cells that changed since the last write) equal a
    full-width rewrite after every write: rows growing, a row replaced by a shorter one, by a longer one sharing its
    first pages, fewer rows, none (a capture's warm-up), a tensor holding garbage first (the first write covers every
    column); a row longer than the tensor is an error, not a device-side fault."""
    import random
    from mpk_runtime.runtime.decode_io import write_tables
    rnd = random.Random(B)
    t = torch.full((B, width), 7777, dtype=torch.int64)
    seqs = [[rnd.randrange(1, 999) for _ in range(rnd.randrange(0, width // 2))] for _ in range(B)]
    for step in range(12):
        if step == 5:
            seqs = seqs[:B // 2]                       # fewer rows
        if step == 7:
            seqs = []                                  # a warm-up step: no rows
        if step == 8:
            seqs = [[rnd.randrange(1, 999)] for _ in range(B)]   # every row replaced by a short one
        for r in seqs:
            if r and rnd.random() < 0.5:
                r.extend(rnd.randrange(1, 999) for _ in range(rnd.randrange(1, 4)))   # growing
        if seqs and step in (3, 9):
            seqs[0] = seqs[0][:1]                      # one row replaced by a shorter one
        if len(seqs) > 1 and step in (4, 10):         # one replaced by a longer one sharing its first pages (a
            seqs[1] = seqs[1][:2] + [rnd.randrange(1, 999) for _ in range(5)]   # cached prefix), one by its copy
            seqs[-1] = list(seqs[-1])
        write_tables(t, seqs)
        want = torch.zeros((B, width), dtype=torch.int64)
        for i, r in enumerate(seqs):
            want[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
        assert torch.equal(t, want), step
    with pytest.raises(ValueError, match="pages for a table"):
        write_tables(t, [[1] * (width + 1)])


def test_attention_splits_follow_the_key_cap_past_the_plans_context():
    """The engine's book is made at 512 keys (8 key splits at batch 1 over 8 KV heads); from a key cap of 1024 the
    bucket is rebuilt with the plan rule's 16 (PlannedDecoder.splits_at), within a resumed burst too, and the
    tokens stay the reference's. Never fewer splits than the plan's at short caps."""
    cfg = PRESETS["tiny-llama-g8"].replace(dtype="float32")
    w = random_weights(cfg, seed=3)
    ps, maxlen = 16, 1024 + 64
    kv = KVStore(cfg.num_layers, maxlen // ps + 2, ps, cfg.num_kv_heads, cfg.head_dim, torch.float32, poison=False)
    book = plan_book(cfg, 1, (1,), context=512, families=("mono",))
    assert book["buckets"][1]["attn_splits"] == 8
    dec = PlannedDecoder(cfg, w, kv, book, max_seq_len=maxlen, page_size=ps, num_sms=132, dtype="float32",
                         device=torch.device("cpu"), backend="pyvm")
    plan = dec._bucket(1, 256).plan
    assert [dec.splits_at(plan, 1, c) for c in (256, 512, 1024, 2048)] == [8, 8, 16, 16]
    p8 = dataclasses.replace(plan, batch=8, attn_splits=2)   # a batch-8 plan's 2 (rows x heads fill the SMs): kept
    assert [dec.splits_at(p8, 8, c) for c in (256, 4096)] == [2, 2]
    pre = ConventionalPrefill(cfg, w, kv, max_seq_len=maxlen, page_size=ps, dtype="float32",
                              device=torch.device("cpu"))
    ref = ReferenceModel(cfg, w)
    prompt = torch.randint(0, cfg.vocab_size, (500,), generator=torch.Generator().manual_seed(0)).tolist()
    table = list(range(1, maxlen // ps + 1))
    cache = ref.new_cache(1, maxlen)
    lr = ref.forward(torch.tensor([prompt]), torch.zeros(1, dtype=torch.long), cache)[0, -1]
    _, tok = pre.run(prompt, 0, table)
    assert tok == int(lr.argmax())
    want = []
    t = tok
    for p in range(500, 516):
        lr = ref.forward(torch.tensor([[t]]), torch.tensor([p]), cache)[0, 0]
        t = int(lr.argmax())
        want.append(t)
    got = dec.decode_steps([tok], [500], [table], None, 8)[0].tolist()      # keys up to 508: cap 512, 8 splits
    b8 = dec._buckets[1]
    assert b8.splits == 8
    got += dec.decode_steps([0], [508], [table], None, 8, resume=True)[0].tolist()   # cap 1024: rebuilt, 16
    b16 = dec._buckets[1]
    assert b16.splits == 16 and b16 is not b8
    assert got == want
    # a short request after the long one runs the plan's 8 splits again, on the build kept aside (session 56: 16 at
    # 512 keys was ~2% slower a token), and back to the 16-split build past 1024 keys
    again = dec.decode_steps([tok], [500], [table], None, 8)[0].tolist()
    assert dec._buckets[1] is b8 and again == want[:8]
    again += dec.decode_steps([0], [508], [table], None, 8, resume=True)[0].tolist()
    assert dec._buckets[1] is b16 and again == want


@pytest.mark.parametrize("packed_rows", ["1024", "0"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_packed_prefill_of_fresh_prompts_matches_reference(name, packed_rows, monkeypatch):
    """A step of fresh prompts of unequal lengths runs packed (one graph, rows back to back, block-diagonal causal
    attention): each chunk's last-token logits, its drawn token and its KV (checked by a decode step after) equal
    the reference, as on the grouped path (packed_rows 0) it replaces; padding rows write only the scratch page."""
    monkeypatch.setenv("MPK_PREFILL_PACKED_ROWS", packed_rows)
    kv, pre, ref, prompts, tables, caches = _prefill_case(name)
    before = kv.k[0].clone()
    lg, drawn = pre.run_many([(p, 0, tables[i], None) for i, p in enumerate(prompts)])
    assert pre.graph_runs == (1 if packed_rows != "0" else 2) and pre.packed_runs == (packed_rows != "0")
    for i, p in enumerate(prompts):
        want = ref.forward(torch.tensor([p]), torch.zeros(1, dtype=torch.long), caches[i])[0, -1]
        assert ((lg[i] - want).abs().max() / want.abs().max()) < 1e-5, i
        assert drawn[i] == int(want.argmax())
    for i, p in enumerate(prompts):   # the page after each prompt's pages is untouched
        nxt = tables[i][-(-len(p) // PS)]
        assert torch.equal(kv.k[0][nxt], before[nxt]), i
    for i, p in enumerate(prompts):   # the KV the packed step wrote is the reference's
        got, _ = pre.run([drawn[i]], len(p), tables[i])
        want = ref.forward(torch.tensor([[drawn[i]]]), torch.tensor([len(p)]), caches[i])[0, -1]
        assert ((got - want).abs().max() / want.abs().max()) < 1e-5, i


def test_run_many_times_its_phases():
    """run_many's laps (ConventionalPrefill.timing, reported by the runner's graph_counts as prefill_*_s): each step
    adds to them, the host laps add up to no more than the wall, this thread's CPU seconds are counted, and off the
    GPU no device time is claimed."""
    kv, pre, ref, prompts, tables, caches = _prefill_case("tiny-llama")
    assert set(pre.timing) == {"build_s", "inputs_s", "launch_s", "wait_s", "read_s", "device_s", "cpu_s", "wall_s"}
    pre.run_many([(p, 0, tables[i], None) for i, p in enumerate(prompts)])
    one = dict(pre.timing)
    laps = sum(one[k] for k in ("build_s", "inputs_s", "launch_s", "wait_s", "read_s"))
    assert 0 < laps <= one["wall_s"] and one["cpu_s"] > 0 and one["launch_s"] > 0 and one["device_s"] == 0
    pre.run_many([(p, 0, tables[i], None) for i, p in enumerate(prompts)])
    assert pre.timing["wall_s"] > one["wall_s"] and pre.timing["launch_s"] > one["launch_s"]


def test_packed_group_layout():
    """packed_group: rows back to back, B a power of two >= the chunks, B * T >= the rows (T >= 16); each chunk's
    last row, positions and sequence; the sampler's counter (pos + T - 1 - pad) is the chunk's last position; a
    continued chunk or too many rows: None (the grouped path)."""
    from mpk_runtime.runtime.torch_exec import packed_group
    lens = [3, 20, 5]
    chunks = [(list(range(1, n + 1)), 0, [1, 2], None) for n in lens]
    g = packed_group(chunks, 64, 4, 1024)
    assert (g.B, g.T) == (4, 16) and g.tokens.numel() == 64
    row_pos, row_seq, last = g.packed
    assert last.tolist() == [2, 22, 27, 63]
    assert row_seq[:28].tolist() == [0] * 3 + [1] * 20 + [2] * 5 and (row_seq[28:] == -1).all()
    assert row_pos[3:23].tolist() == list(range(20)) and (row_pos[28:] == -1).all()
    assert (g.pos + g.T - 1 - g.pad)[:3].tolist() == [n - 1 for n in lens] and g.pos[3] == -1
    assert g.tokens[23:28].tolist() == [1, 2, 3, 4, 5] and g.tables[:3, :2].tolist() == [[1, 2]] * 3
    assert packed_group(chunks + [([1, 2], 4, [1, 2], None)], 64, 4, 1024) is None   # a continued chunk
    assert packed_group(chunks, 64, 4, 27) is None                                      # 28 rows > 27
    assert packed_group([([1] * 40, 0, [1], None)] * 3, 64, 4, 1024).T == 32           # 120 rows in 4 x 32


def test_step_groups_pack_the_fresh_chunks_and_group_the_rest():
    """step_groups: the chunks starting their sequences packed, the continued ones grouped by length, each group's
    idx pointing into the step's chunks; nothing fresh, or packed_rows 0: all grouped."""
    from mpk_runtime.runtime.torch_exec import step_groups
    chunks = [([1, 2, 3], 0, [1], None), ([4] * 20, 16, [2, 3], None), ([5, 6], 0, [4], None), ([7] * 3, 5, [5], None)]
    gs = step_groups(chunks, 64, 4, 2048)
    assert [g.packed is not None for g in gs] == [True, False, False]
    assert [g.idx for g in gs] == [[0, 2], [3], [1]]          # packed; length 16 (3 tokens); length 32 (20 tokens)
    assert gs[0].packed[2][:2].tolist() == [2, 4] and gs[2].kv_cap == 64
    assert [g.idx for g in step_groups(chunks, 64, 4, 0)] == [[0, 2, 3], [1]]
    assert all(g.packed is None for g in step_groups([chunks[1], chunks[3]], 64, 4, 2048))
