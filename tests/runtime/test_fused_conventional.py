"""The conventional path's fused pieces for torch.compile (RMSNorm: MPK_CONV_FUSE_NORM, the q/k tail: MPK_CONV_FUSE_ROPE,
SiLU-and-mul: MPK_CONV_FUSE_SILU)
equal the eager task numerics; RMSNorm:
the same ops and rounding points, so on the CPU (where both run as torch ops in the same order) bit for bit."""
import pytest
import torch

from mpk_runtime.runtime import conventional_fused, conventional_ops
from mpk_runtime.tasks.ops.common import rms_norm


@pytest.mark.parametrize("shape,wshape", [((7, 64), (64,)), ((3, 5, 64), (64,)), ((1, 2048), (2048,)),
                                          ((4, 6, 128), None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_functional_norm_equals_the_task_norm(shape, wshape, dtype):
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = None if wshape is None else torch.randn(wshape, generator=g).to(dtype)
    assert torch.equal(conventional_fused._rms_norm_fn(x, w, 1e-6), rms_norm(x, w, 1e-6))


def test_fused_norm_is_gpu_only_and_checks_its_flag(monkeypatch):
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    monkeypatch.delenv("MPK_CONV_FUSE_NORM", raising=False)
    assert conventional_fused.fuse_norm()   # default on
    monkeypatch.setenv("MPK_CONV_FUSE_NORM", "0")
    assert not conventional_fused.fuse_norm()
    monkeypatch.setenv("MPK_CONV_FUSE_NORM", "1")
    assert torch.equal(conventional_fused.rms_norm(x, None, 1e-6), rms_norm(x, None, 1e-6))   # CPU: eager
    assert conventional_fused.fused_norm.cache_info().currsize == 0   # nothing compiled for a CPU tensor
    monkeypatch.setenv("MPK_CONV_FUSE_NORM", "yes")
    with pytest.raises(ValueError, match="MPK_CONV_FUSE_NORM"):
        conventional_fused.fuse_norm()


@pytest.mark.parametrize("qwen", [False, True])
@pytest.mark.parametrize("M", [1, 5])
def test_functional_qk_tail_equals_the_eager_one(qwen, M):
    """The q/k tail of qkv_rope for torch.compile (MPK_CONV_FUSE_ROPE=1 on a GPU): per-head norms (Qwen3), their
    weights, RoPE and the q write give, run eagerly on the CPU, the eager tail's q and k bit for bit."""
    g = torch.Generator().manual_seed(M + 10 * qwen)
    nq, nkv, D = 4, 2, 16
    bf = torch.bfloat16
    qr, kr = (torch.randn(M, nq, D, generator=g) * 2).to(bf), (torch.randn(M, nkv, D, generator=g) * 2).to(bf)
    qn, kn = ((torch.randn(D, generator=g).to(bf), torch.randn(D, generator=g).to(bf)) if qwen else (None, None))
    ang = torch.randn(M, D // 2, generator=g) * 3
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(bf)[:, None, :]
    sin = ang.sin().to(bf)
    sin_s = torch.cat((-sin, sin), -1)[:, None, :]
    q_eager, q_fn = torch.empty(M, nq * D, dtype=bf), torch.empty(M, nq, D, dtype=bf)
    k_eager = conventional_ops._qk_epilogue(torch.cat((qr, kr), 1), nq, qn, kn, cos, sin_s, 1e-6, q_eager)
    k_fn = conventional_fused._qk_epilogue_fn(qr, kr, qn, kn, cos, sin_s, 1e-6, q_fn)
    assert torch.equal(q_fn.view(M, -1), q_eager) and torch.equal(k_fn, k_eager)
    # the deferred append's tail (ir/defer.py): the same q, and k then v rows into kv_new, through the compiler too
    v = (torch.randn(M, nkv, D, generator=g) * 2).to(bf)
    for fn in (conventional_fused._qk_epilogue_kv_fn,
               conventional_fused.compile_rows_dynamic(conventional_fused._qk_epilogue_kv_fn, (0, 1, 4, 5, 7, 8, 9),
                                                       backend="eager")):
        q_kv, kv = torch.empty(M, nq, D, dtype=bf), torch.full((M, 2, nkv, D), float("nan"), dtype=bf)
        fn(qr, kr, qn, kn, cos, sin_s, 1e-6, q_kv, v, kv)
        assert torch.equal(q_kv, q_fn) and torch.equal(kv[:, 0], k_eager) and torch.equal(kv[:, 1], v)


def test_fused_rope_and_projections_are_on_by_default_and_can_be_turned_off(monkeypatch):
    for name, fn in (("MPK_CONV_FUSE_ROPE", conventional_fused.fuse_rope), ("MPK_CONV_FUSE_PROJ", conventional_fused.fuse_proj)):
        monkeypatch.delenv(name, raising=False)
        assert fn()
        monkeypatch.setenv(name, "0")
        assert not fn()


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-qwen2"])
@pytest.mark.parametrize("B", [1, 3])
def test_projections_stored_back_to_back_compute_the_same_step(model, B):
    """MPK_CONV_FUSE_PROJ: with each layer's q/k/v and gate/up weights packed back to back (pack_adjacent), the
    conventional step runs one matmul per group (3-4 kernels fewer per layer) and computes the same logits and K/V
    cache (on the CPU bit for bit; a GPU's matmul may pick another kernel for the wider output: bf16 tolerance)."""
    from mpk_runtime.models.weights import pack_adjacent
    from tests.runtime.test_conventional_op_count import _Record, build, is_kernel
    outs = []
    for pack in (False, True):
        cfg, g, mem, ex, ctx = build(model, B=B)
        if pack:
            pack_adjacent(mem.tensors, cfg)
        rec = _Record()
        with rec:
            ex.run([ctx])
        outs.append((mem.t("logits").clone(), [c.clone() for c in mem.kvstore.k + mem.kvstore.v],
                     sum(is_kernel(op) for _t, op in rec.ops)))
    (l0, kv0, n0), (l1, kv1, n1) = outs
    assert torch.equal(l1, l0) and all(torch.equal(a, b) for a, b in zip(kv0, kv1))
    assert n1 <= n0 - 3 * cfg.num_layers, (n0, n1)   # q/k/v: 3 matmuls -> 1 (and no q/k stack copy); gate/up: 2 -> 1


def test_compiled_pieces_are_dynamic_in_the_rows_only():
    """compile_rows_dynamic (the fused norm and q/k tail on a GPU): the row count is symbolic, the widths the
    reductions run over are not, so each hidden size gets its own kernel and new batch sizes compile nothing."""
    graphs = []

    def record(gm, example_inputs):   # per tensor input: which dims are plain ints (static) in the traced graph
        vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        graphs.append([tuple(isinstance(d, int) for d in v.shape) for v in vals if isinstance(v, torch.Tensor)])
        return gm.forward

    torch._dynamo.reset()
    f = conventional_fused.compile_rows_dynamic(conventional_fused._rms_norm_fn, (0,), backend=record)
    bf = torch.bfloat16
    for M, K in ((4, 64), (32, 64), (7, 64), (8, 128), (96, 128)):
        x, w = torch.randn(M, K, dtype=bf), torch.randn(K, dtype=bf)
        assert torch.equal(f(x, w, 1e-6), conventional_fused._rms_norm_fn(x, w, 1e-6))
    assert len(graphs) == 2                    # one per width, none for the new row counts
    for g in graphs:
        assert (False, True) in g and (True,) in g   # x: rows symbolic, width static; the weight static
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_functional_silu_mul_equals_the_eager_epilogue(dtype):
    """_silu_mul_fn (MPK_CONV_FUSE_SILU, on by default on a GPU) on gate/up column views of one matmul output: the eager
    epilogue's values bit for bit (silu rounded, then the product rounded), into a contiguous or wider out."""
    g0 = torch.Generator().manual_seed(3)
    gu = (torch.randn(5, 2 * 48, generator=g0) * 4).to(dtype)
    g, u = gu[:, :48], gu[:, 48:]
    ref = g.clone()
    torch.nn.functional.silu(ref, inplace=True)
    ref = ref * u
    for out_dtype in (dtype, torch.float32):
        out = torch.empty(5, 48, dtype=out_dtype)
        conventional_fused._silu_mul_fn(g, u, out)
        assert torch.equal(out, ref.to(out_dtype))
    # the compiled path as the GPU runs it (inductor, emulate_precision_casts), here generating CPU code: its
    # fp32 silu formula is not ATen's to the last ulp, which bf16's rounding hides (bit for bit on these rows)
    compiled = conventional_fused.compile_rows_dynamic(conventional_fused._silu_mul_fn, (0, 1, 2))
    for rows in (5, 3):
        out = torch.empty(rows, 48, dtype=dtype)
        compiled(g[:rows], u[:rows], out)
        if dtype == torch.bfloat16:
            assert torch.equal(out, ref[:rows])
        else:
            torch.testing.assert_close(out, ref[:rows], rtol=1e-6, atol=1e-7)


def test_many_widths_in_one_process_compile_past_dynamo_s_default_limit():
    """A process that tests or serves several models meets more widths than dynamo's default 8 graphs per function
    (a hard error with fullgraph=True): compile_rows_dynamic raises the limit for its own calls only."""
    torch._dynamo.reset()
    before = torch._dynamo.config.recompile_limit
    f = conventional_fused.compile_rows_dynamic(conventional_fused._rms_norm_fn, (0,), backend="eager")
    for K in range(16, 16 * 14, 16):        # 13 widths, one- and many-row graphs each: 26 graphs
        for M in (1, 6):
            x, w = torch.randn(M, K), torch.randn(K)
            assert torch.equal(f(x, w, 1e-6), conventional_fused._rms_norm_fn(x, w, 1e-6))
    assert torch._dynamo.config.recompile_limit == before
    torch._dynamo.reset()


def test_removed_fused_residual_add_and_norm_switch_raises(monkeypatch):
    """MPK_CONV_FUSE_ADD_NORM (the residual add fused with the next RMSNorm, measured no gain in session 19) was
    removed: set to 1 a conventional executor refuses to start; unset or 0 runs as always."""
    from tests.runtime.test_conventional_op_count import build
    for v in ("", "0"):
        monkeypatch.setenv("MPK_CONV_FUSE_ADD_NORM", v)
        build("tiny-llama", B=1)
    monkeypatch.setenv("MPK_CONV_FUSE_ADD_NORM", "1")
    with pytest.raises(ValueError, match="MPK_CONV_FUSE_ADD_NORM='1': this option was removed .*session 19"):
        build("tiny-llama", B=1)


def test_fixed_configs_switch_compiles_in_inductor_s_deterministic_mode(monkeypatch):
    """MPK_CONV_FIXED_CONFIGS=1 (opt-in): the conventional path's compiled pieces ask inductor for its deterministic
    mode (no first-call timing of reduction configs, which flipped a q / k norm kernel 2x between processes in
    session 37); the generated code (CPU here) still gives the eager norm bit for bit. Unset: the options as before."""
    monkeypatch.delenv("MPK_CONV_FIXED_CONFIGS", raising=False)
    assert conventional_fused.inductor_options() == {"emulate_precision_casts": True}
    monkeypatch.setenv("MPK_CONV_FIXED_CONFIGS", "1")
    assert conventional_fused.inductor_options() == {"emulate_precision_casts": True, "deterministic": True}
    torch._dynamo.reset()
    f = conventional_fused.compile_rows_dynamic(conventional_fused._rms_norm_fn, (0,))
    g = torch.Generator().manual_seed(7)
    for M in (3, 9):
        x, w = (torch.randn(M, 128, generator=g) * 3).to(torch.bfloat16), torch.randn(128, generator=g).to(torch.bfloat16)
        assert torch.equal(f(x, w, 1e-6), rms_norm(x, w, 1e-6))
    torch._dynamo.reset()
    monkeypatch.setenv("MPK_CONV_FIXED_CONFIGS", "maybe")
    with pytest.raises(ValueError, match="MPK_CONV_FIXED_CONFIGS"):
        conventional_fused.inductor_options()
