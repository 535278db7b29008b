"""MPK_MLP_FUSE=1 (ir/build.py mlp_fuse, tasks/ops/mlp.py): at batch < TC_MIN_M and tp == 1 each layer's down
projection runs inside its gate_up tiles (fp32 partials into an accumulator; the tile that takes the step's last
ticket writes the output row). pyvm matches the reference in random interleavings (fp32 models, so the
partials' order shows only at 1e-5), the static checker accepts the graphs (every read covered, no deadlock), the
down op decomposes into no tasks, and graphs where the fusion does not apply (batch >= TC_MIN_M, tp > 1, a plan
segment holding gate_up without down, the switch off) keep their linear tiles."""
import pytest

from mpk_runtime.codegen import layout as L
from mpk_runtime.ir.build import build_graph
from mpk_runtime.models.config import PRESETS
from mpk_runtime.tasks.build import build_task_graphs
from mpk_runtime.tasks.check import check_task_graphs
from mpk_runtime.tasks.tiling import Tiling
from tests.runtime.test_pyvm import ODD, SEEDS, run_steps, setup


def _kinds(cfg, batch, tp=1, ops=None):
    gs = [build_graph(cfg, batch=batch, context_len=8, max_seq_len=32, tp=tp, rank=r) for r in range(tp)]
    if ops is not None:
        gs = [g.subgraph([o.name for o in g.ops if ops(o)]) for g in gs]
    tgs = build_task_graphs(gs, Tiling(num_sms=7))
    check_task_graphs(tgs, steps=3)
    return tgs, [[t.kind for t in tg.tasks] for tg in tgs]


@pytest.mark.parametrize("cfg", [PRESETS["tiny-llama"], PRESETS["tiny-qwen3"], ODD], ids=lambda c: c.name)
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_mlp_matches_reference(monkeypatch, cfg, batch):
    monkeypatch.setenv("MPK_MLP_FUSE", "1")
    grp, lens, tables, ref_logits, toks = setup(cfg, 1, batch)
    _, mems, vm = grp.decode_vm(batch)
    kinds = [t.kind for t in grp.decode_vm(batch)[2].graphs[0].tasks]
    assert kinds.count("mlp") > 0 and not any(t.op.endswith(".down") for t in grp.decode_vm(batch)[2].graphs[0].tasks)
    for seed in range(SEEDS // 4):
        vm.rng.seed(seed)
        run_steps(grp, lens, tables, ref_logits, toks)
    # every accumulator is left zero for the next step
    for name, spec in grp.decode_vm(batch)[1][0].graph.tensors.items():
        if spec.attrs.get("accum"):
            assert grp.decode_vm(batch)[1][0].t(name).abs().max().item() == 0.0, name


def test_graphs_check_and_down_has_no_tasks(monkeypatch):
    monkeypatch.setenv("MPK_MLP_FUSE", "1")
    cfg = PRESETS["tiny-qwen3"]
    tgs, kinds = _kinds(cfg, 1)
    tg = tgs[0]
    mlp = [t for t in tg.tasks if t.kind == "mlp"]
    layers = cfg.num_layers
    assert len({t.op for t in mlp}) == layers and not any(t.op.endswith(".down") for t in tg.tasks)
    per_layer = len(mlp) // layers
    assert {t.params["tiles"] for t in mlp} == {per_layer}
    # a reader of the down output waits on one event that every fused tile of that layer signals
    reader = next(t for t in tg.tasks if t.op == "L1.qkv_rope")
    l0 = {t.id for t in mlp if t.op == "L0.gate_up"}
    assert any(set(p for _, p in tg.events[e].producers) == l0 for e, _ in reader.waits)


def test_fusion_applies_only_where_it_can(monkeypatch):
    cfg = PRESETS["tiny-llama"]
    monkeypatch.setenv("MPK_MLP_FUSE", "1")
    assert "mlp" not in _kinds(cfg, L.CONSTANTS["TC_MIN_M"])[1][0]              # Tensor Core batches
    assert all("mlp" not in k for k in _kinds(cfg, 1, tp=2)[1])                 # tp > 1: push + all-reduce
    _, k = _kinds(cfg, 1, ops=lambda o: not o.name.endswith(".down"))           # a segment without down
    assert "mlp" not in k[0]
    monkeypatch.setenv("MPK_MLP_FUSE", "0")
    g = build_graph(cfg, batch=1, context_len=8, max_seq_len=32)
    assert not any(s.attrs.get("accum") for s in g.tensors.values())
    assert "mlp" not in _kinds(cfg, 1)[1][0]
