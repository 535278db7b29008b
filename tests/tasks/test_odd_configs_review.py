"""Configs a user may bring that are not presets (tiny random weights, fp32): pyvm's logits and greedy tokens equal
the pure-torch reference's (relative error <= 1e-5, as tests/runtime/test_pyvm.py) at batch 1 and 3, a few decode
steps, sequences of different lengths whose contexts are not multiples of the page size, pages scrambled; or the
config is refused with an error that names the limit."""
import pytest
import torch

from mpk_runtime.models import PRESETS, ReferenceModel, random_weights
from mpk_runtime.models.config import RopeScaling
from mpk_runtime.runtime.pyvm_runner import TPGroup, shard_weights
from mpk_runtime.tasks import Tiling
from tests.runtime.test_pyvm import ref_greedy

STEPS, PAGE, MAXLEN = 3, 4, 24
LLAMA, QWEN2, QWEN3 = PRESETS["tiny-llama"], PRESETS["tiny-qwen2"], PRESETS["tiny-qwen3"]


def run_vs_reference(cfg, batch, num_sms=7, tp=1, splits=2, **tiling):
    cfg = cfg.replace(dtype="float32")
    w = random_weights(cfg, seed=5)
    ref = ReferenceModel(cfg, w)
    lens = [5, 9, 3][:batch]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lens]
    npp = -(-MAXLEN // PAGE)
    grp = TPGroup(cfg, [shard_weights(cfg, w, tp, r) for r in range(tp)], num_pages=batch * npp + 1,
                  page_size=PAGE, max_seq_len=MAXLEN, tiling=Tiling(num_sms=num_sms, **tiling), mode="random",
                  seed=0, attn_splits=splits)
    perm = torch.randperm(batch * npp, generator=g) + 1
    tables = [perm[b * npp:(b + 1) * npp].tolist() for b in range(batch)]
    ref_logits, toks = [], []
    for b, p in enumerate(prompts):
        _, seq_l, seq_t = ref_greedy(ref, p, MAXLEN, STEPS)
        grp.prefill(p.tolist(), 0, tables[b])
        ref_logits.append(seq_l)
        toks.append(seq_t)
    ref_logits, toks = torch.stack(ref_logits, 1), torch.tensor(toks).T
    for s in range(STEPS):
        got = grp.decode(toks[s].tolist(), [n + s for n in lens], tables, backend="pyvm")
        err = ((got - ref_logits[s]).abs().max() / ref_logits[s].abs().max()).item()
        assert err <= 1e-5, f"step {s}: relative error {err}"
        assert torch.equal(grp.next_tokens(batch), toks[s + 1]), f"step {s}: greedy tokens differ"
    return grp


# --- bugs found in review -----------------------------------------------------------------------------------------

def test_attn_groups_keeps_one_group_when_a_group_exceeds_the_task_q_area():
    """A KV group of more q heads than an attention task's q area (ATT_MAX_QH) still gets one group per task:
    attn_g's candidates were empty there and the graph build died in min() ("min() arg is an empty sequence")."""
    from mpk_runtime.codegen import layout
    gs = layout.CONSTANTS["ATT_MAX_QH"] + 8
    assert Tiling(num_sms=132).attn_g(1, gs, 1, 64, 3, keys=512) == 1
    assert Tiling(num_sms=132, attn_groups=4).attn_g(1, gs, 2, 64, 3, keys=512) == 1


@pytest.mark.parametrize("base", [LLAMA, QWEN3], ids=lambda c: c.name)
@pytest.mark.parametrize("batch", [1, 3])
def test_mqa_with_many_q_heads_unsplit_attention(base, batch):
    """MQA with 40 q heads on one KV head, keys not split (attn_splits 1, what large batches get): it used to fail
    building the task graph with "min() arg is an empty sequence"."""
    run_vs_reference(base.replace(num_heads=40, num_kv_heads=1, head_dim=8), batch, splits=1)


def test_flat_qkv_with_too_few_sms_falls_back_to_head_parts():
    """Tiling(qkv_parts=2) on 2 SMs for a Qwen3 model at batch 1: the flat q / k tiles do not fit beside the v heads
    (one SM per v head part and two for q / k). The build raised "a flat qkv_rope needs more than 2 SMs"; now it
    takes the head parts (into qk_raw, normed heads finished after), as at batch >= TC_MIN_M."""
    grp = run_vs_reference(QWEN3, 1, num_sms=2, qkv_parts=2)
    kinds = {t.kind for t in grp.decode_vm(1)[2].graphs[0].tasks if t.op == "L0.qkv_rope"}
    assert "linear" not in kinds and "qkv_rope" in kinds


# --- guard: odd shapes that work (a compact sample of a wider probe, all of which matched) -------------------------

ODD = [
    ("llama-mqa", LLAMA.replace(num_kv_heads=1), {}),
    ("qwen2-mha", QWEN2.replace(num_kv_heads=6), {}),
    ("qwen3-hd80-H200-I344-V1001", QWEN3.replace(head_dim=80, hidden_size=200, intermediate_size=344,
                                                 vocab_size=1001), {}),
    ("llama-hd96-H328-untied-1layer", LLAMA.replace(head_dim=96, hidden_size=328, tie_word_embeddings=False,
                                                    num_layers=1), {}),
    ("qwen2-hd256-V50257", QWEN2.replace(head_dim=256, vocab_size=50257, num_layers=1), {}),
    ("llama-yarn", LLAMA.replace(rope_scaling=RopeScaling(factor=4.0, rope_type="yarn",
                                                          original_max_position_embeddings=16)), {}),
    ("qwen3-linear-rope-tied", QWEN3.replace(rope_scaling=RopeScaling(factor=4.0, rope_type="linear"),
                                             tie_word_embeddings=True), {}),
    ("qwen3-V40960-argmax-slices", QWEN3.replace(vocab_size=40960, num_layers=1), {"argmax_tasks": 3}),
    ("llama-V8201-tp2", LLAMA.replace(vocab_size=8201), {"tp": 2}),
    ("qwen3-mqa-tp2", QWEN3.replace(num_kv_heads=1), {"tp": 2}),
    ("qwen2-splits3-nofold", QWEN2, {"splits": 3, "attn_fold_merge": False}),
    ("llama-1sm", LLAMA, {"num_sms": 1}),
    ("qwen3-132sms-splits5", QWEN3, {"num_sms": 132, "splits": 5}),
]


@pytest.mark.parametrize("cfg,kw", [(c, kw) for _, c, kw in ODD], ids=[n for n, _, _ in ODD])
def test_odd_configs_match_reference(cfg, kw):
    for batch in (1, 3):
        run_vs_reference(cfg, batch, **kw)
