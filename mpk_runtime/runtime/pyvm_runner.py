"""ModelRunner backends on the CPU: "pyvm" (decode through the task graphs under the event protocol) and
"torch" (decode through the conventional executor). Both prefill through the conventional executor and
hold all ranks of a TP group in one process (ranks as threads / interleaved), sharing "symmetric" buffers.
"""
from __future__ import annotations

import threading

import torch

from ..ir.build import build_graph, check_tp_invariant
from ..ir.graph import Graph
from ..ir.shard import shard_for, weight_slice
from ..models.config import ModelConfig, load_config
from ..models.reference import rope_inv_freq
from ..models.weights import get_weights, torch_dtype
from ..tasks.build import build_task_graphs
from ..tasks.check import check_task_graphs
from ..tasks.tiling import Tiling
from .base import KVSpec, ModelRunner, SeqChunk, check_sizes, register_runner, runner_device
from .comm import ThreadComm
from .device_sampling import draw_full, fill_sampling, step_output
from .memory import DEFAULT_PAGE_SIZE, KVStore, RankMemory, StepCtx, connect
from .plan_exec import PlanExecutor
from .pyvm import PyVM
from .torch_exec import ConventionalExecutor, prefill_groups


def shard_weights(cfg: ModelConfig, full: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    sh = shard_for(cfg, tp, rank)
    out = {}
    for n, t in full.items():
        idx = weight_slice(cfg, sh, n, tuple(t.shape))
        out[n] = t[idx].contiguous() if idx is not None else t
    return out


class TPGroup:
    """All ranks of one TP group in one process: weights, KV stores, and per-shape graphs/memories/executors."""

    def __init__(self, cfg: ModelConfig, rank_weights: list[dict[str, torch.Tensor]], *, num_pages: int,
                 page_size: int, max_seq_len: int, num_sms: int = 8, tiling: Tiling | None = None,
                 mode: str = "random", seed: int = 0, check: bool = True, attn_splits: int = 2,
                 dtype: str | None = None, comm=None, tp: int | None = None, tp_invariant: int = 1,
                 plans: dict | None = None):
        """tp_invariant: see ir.build.build_graph (row-parallel reductions in the order of a TP=R group).
        plans: a planner PlanBook (planner.book.plan_book): "pyvm" decode then runs each batch as the plan of its
        bucket (megakernel segments on pyvm, conventional segments as torch ops) instead of one task graph.
        rank_weights: one dict per rank held here. Normally all ranks (tp = len(rank_weights)); with a
        `comm` (ranks in separate processes) just this process's rank, comm.rank, of a group of `tp`."""
        self.cfg = cfg
        self.comm = comm if comm is not None and comm.world_size > 1 else None
        self.tp = tp or len(rank_weights)
        self.local = [self.comm.rank] if self.comm else list(range(self.tp))
        if len(rank_weights) != len(self.local):
            raise ValueError(f"{len(rank_weights)} weight shards for local ranks {self.local}")
        self.dtype = dtype or cfg.dtype
        self.rank_weights = rank_weights
        self.page_size, self.max_seq_len, self.num_pages = page_size, max_seq_len, num_pages
        self.tiling = tiling or Tiling(num_sms=num_sms)
        self.mode, self.seed, self.check, self.attn_splits = mode, seed, check, attn_splits
        self.tp_invariant = tp_invariant
        check_tp_invariant(cfg, self.tp, tp_invariant)   # (else every step of every request failed on it)
        n_kv = shard_for(cfg, self.tp, 0).n_kv
        self.kv = [KVStore(cfg.num_layers, num_pages, page_size, n_kv, cfg.head_dim, torch_dtype(self.dtype))
                   for _ in self.local]
        self.inv_freq = rope_inv_freq(cfg)
        self._decode: dict[int, tuple[list[Graph], list[RankMemory], PyVM]] = {}
        self.plans = plans
        self._planned: dict[int, tuple] = {}
        self._conv: dict[tuple[str, int, int], tuple[list[Graph], list[RankMemory], ConventionalExecutor]] = {}

    def graphs(self, mode: str, batch: int, T: int, attn_splits: int | None = None) -> list[Graph]:
        splits = (attn_splits or self.attn_splits) if mode == "decode" else 1
        return [build_graph(self.cfg, mode=mode, batch=batch, tokens_per_seq=T if mode == "prefill" else None,
                            context_len=0, max_seq_len=self.max_seq_len, tp=self.tp, rank=r, dtype=self.dtype,
                            attn_splits=splits, tp_invariant=self.tp_invariant) for r in self.local]

    def _mems(self, graphs: list[Graph], share: bool = False) -> list[RankMemory]:
        mems = [RankMemory(g, self.rank_weights[i], self.kv[i], share_activations=share)
                for i, g in enumerate(graphs)]
        connect(mems)
        return mems

    def decode_vm(self, batch: int) -> tuple[list[Graph], list[RankMemory], PyVM]:
        if self.comm is not None:
            raise ValueError("pyvm needs every rank of the group in one process (ranks as threads); "
                             "use the 'torch' backend for ranks in separate processes")
        if batch not in self._decode:
            gs = self.graphs("decode", batch, 1)
            tgs = build_task_graphs(gs, self.tiling)
            if self.check:
                check_task_graphs(tgs)
            mems = self._mems(gs)
            self._decode[batch] = (gs, mems, PyVM(tgs, mems, mode=self.mode, seed=self.seed))
        return self._decode[batch]

    def plan_exec(self, batch: int):
        """(graphs, memories, PlanExecutor, plan) for a decode batch under the plan book (cached per batch)."""
        if self.comm is not None:
            raise ValueError("plans run their megakernel segments on pyvm, which needs every rank in one process")
        if batch not in self._planned:
            from ..planner.book import pick_plan
            plan = pick_plan(self.plans, batch)
            if plan.tp != self.tp:
                raise ValueError(f"the plan book was made for tp={plan.tp}, this group has tp={self.tp}")
            gs = self.graphs("decode", batch, 1, attn_splits=plan.attn_splits)
            mems = self._mems(gs)
            ex = PlanExecutor(plan, gs, mems, backend="pyvm", num_sms=self.tiling.num_sms, mode=self.mode,
                              seed=self.seed, check=self.check)
            self._planned[batch] = (gs, mems, ex, plan)
        return self._planned[batch]

    def conventional(self, mode: str, batch: int, T: int):
        key = (mode, batch, T)
        if key not in self._conv:
            gs = self.graphs(mode, batch, T)
            mems = self._mems(gs, share=True)   # ops run one after another: activations share storage
            self._conv[key] = (gs, mems, ConventionalExecutor(gs, mems, comm=self.comm))
        return self._conv[key]

    def ctx(self, pos, tables, T: int, step: int = 0) -> StepCtx:
        return StepCtx(self.cfg, step, torch.as_tensor(pos, dtype=torch.long), torch.as_tensor(tables, dtype=torch.long),
                       self.page_size, T, self.inv_freq)

    def _gather_logits(self, mems: list[RankMemory]) -> torch.Tensor:
        if self.comm is not None:
            return self.comm.all_gather(mems[0].t("logits").contiguous(), dim=-1)
        return torch.cat([m.t("logits") for m in mems], dim=-1).clone()

    def decode(self, tokens, pos, tables, backend: str = "pyvm", nsteps: int = 1, sampling=None) -> torch.Tensor:
        """One (or nsteps) decode step(s) for a batch; returns logits (B, V) of the last step. sampling: one
        DeviceSampling or None (greedy) per row; the tokens drawn are in `last_next_tokens` afterwards."""
        B = len(tokens)
        if backend == "pyvm" and self.plans is not None:
            gs, mems, ex, _ = self.plan_exec(B)
            for m in mems:
                m.t("tokens").copy_(torch.as_tensor(tokens, dtype=torch.long))
                fill_sampling(m, sampling or [])
            pos = torch.as_tensor(pos, dtype=torch.long)
            for k in range(nsteps):   # a plan runs one step per call; later steps feed back the drawn tokens
                if k:
                    for m in mems:
                        m.t("tokens").copy_(mems[0].t("next_tokens"))
                ex.run(lambda r, k=k: self.ctx(torch.where(pos >= 0, pos + k, pos), tables, 1))
                full = getattr(mems[0], "_full_rows", None) is not None
                lg = self._gather_logits(mems) if full or k == nsteps - 1 else None   # (gathered once a step at most)
                if full:
                    draw_full(mems[0], lg, pos + k)
            self.last_next_tokens = mems[0].t("next_tokens").clone()
            return lg
        if backend == "pyvm":
            gs, mems, vm = self.decode_vm(B)
            for m in mems:
                m.t("tokens").copy_(torch.as_tensor(tokens, dtype=torch.long))
                fill_sampling(m, sampling or [])
            pos = torch.as_tensor(pos, dtype=torch.long)
            if nsteps > 1 and getattr(mems[0], "_full_rows", None) is not None:
                raise ValueError("one VM launch of several steps feeds the graph's own draws back: full-vocabulary "
                                 "rows (DeviceSampling.full) need one step per launch")
            vm.launch(lambda r, k: self.ctx(torch.where(pos >= 0, pos + k, pos), tables, 1), nsteps)
            lg = self._gather_logits(mems)
            draw_full(mems[0], lg, pos)
            self.last_next_tokens = mems[0].t("next_tokens").clone()
            return lg
        if nsteps != 1:
            raise ValueError("the conventional path runs one step per call")
        gs, mems, ex = self.conventional("decode", B, 1)
        for m in mems:
            m.t("tokens").copy_(torch.as_tensor(tokens, dtype=torch.long))
            fill_sampling(m, sampling or [])
        ex.run([self.ctx(pos, tables, 1) for _ in mems])
        lg = self._gather_logits(mems)
        draw_full(mems[0], lg, pos)
        self.last_next_tokens = mems[0].t("next_tokens").clone()
        return lg

    def next_tokens(self, batch: int) -> torch.Tensor:
        return self.decode_vm(batch)[1][0].t("next_tokens").clone()

    def prefill_many(self, chunks: list[tuple[list[int], int, list[int], object]]) -> tuple[torch.Tensor, list[int]]:
        """Prompt chunks (tokens, start_pos, padded block table, sampling) of one step, left-padded into a few
        prefill graphs grouped by power-of-two length (StepCtx.pad; as the GPU runner's ConventionalPrefill).
        Returns the logits (n, V) of each chunk's last token and the tokens drawn for them."""
        logits: list = [None] * len(chunks)
        drawn = [0] * len(chunks)
        for g in prefill_groups(chunks, self.max_seq_len, len(chunks[0][2])):
            gs, mems, ex = self.conventional("prefill", g.B, g.T)
            for m in mems:
                m.t("tokens").copy_(g.tokens)
                fill_sampling(m, g.sampling)
            ctx = StepCtx(self.cfg, 0, g.pos, g.tables, self.page_size, g.T, self.inv_freq, pad=g.pad)
            ex.run([ctx for _ in mems])
            lg = self._gather_logits(mems)
            draw_full(mems[0], lg, [chunks[i][1] + len(chunks[i][0]) - 1 for i in g.idx])
            nxt = mems[0].t("next_tokens")
            for j, i in enumerate(g.idx):
                logits[i], drawn[i] = lg[j], int(nxt[j])
        return torch.stack(logits), drawn

    def prefill(self, tokens: list[int], start_pos: int, table, sampling=None) -> torch.Tensor:
        """One sequence's chunk through the conventional path; returns logits (V,) of its last token (the token
        drawn with `sampling`, or greedy, is in `last_next_tokens[0]` afterwards)."""
        T = len(tokens)
        gs, mems, ex = self.conventional("prefill", 1, T)
        for m in mems:
            m.t("tokens").copy_(torch.as_tensor(tokens, dtype=torch.long))
            fill_sampling(m, [sampling])
        ex.run([self.ctx([start_pos], [table], T) for _ in mems])
        lg = self._gather_logits(mems)
        draw_full(mems[0], lg, [start_pos + T - 1])
        self.last_next_tokens = mems[0].t("next_tokens").clone()
        return lg[0]


class _CPURunner(ModelRunner):
    """One ModelRunner per rank, as the executor/worker split expects.

    Ranks that are threads of one process (comm is a ThreadComm) share one TPGroup: rank 0 runs the whole
    group (pyvm interleaves all ranks' SMs, as the GPUs run concurrently) and the others wait at the barrier.
    Ranks in separate processes (torch.distributed comm) each hold their own shard ("torch" backend only).
    """

    backend = "pyvm"
    samples_on_device = True
    samples_full_on_device = True   # every rank's step has the gathered logits of the whole vocabulary
    shares_kv_pages = True

    def __init__(self, model: str = "tiny-llama", *, world_size: int = 1, rank: int = 0, comm=None,
                 seed: int = 0, dtype: str | None = None, max_batch: int = 8, max_seq_len: int | None = None,
                 page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None, num_sms: int = 8, mode: str = "ordered",
                 device: str = "cpu", tp: int | None = None, tp_invariant: int = 1, plan=None,
                 plan_buckets=None, plan_context: int = 512, **_: object):
        self.config = cfg = load_config(model)
        self.rank, self.world_size = rank, world_size
        tp = tp or world_size
        if world_size > 1 and tp != world_size:
            raise ValueError(f"tp={tp} but the executor has {world_size} ranks")
        runner_device(self.backend, device, cpu_only=True)
        dtype = dtype or "float32"  # CPU: bf16 matmuls are slow and far from the fp32 reference
        max_seq_len = check_sizes(cfg, max_batch, default_max_seq_len(cfg, max_seq_len), page_size, num_pages)
        num_pages = num_pages or max_batch * (-(-max_seq_len // page_size)) + 1
        self._spec = KVSpec(page_size, num_pages, max_batch, max_seq_len)
        self._comm = comm
        threads = isinstance(comm, ThreadComm) and world_size > 1
        dist = comm is not None and not threads and world_size > 1
        if dist and self.backend == "pyvm":
            raise ValueError("the pyvm backend holds all ranks in one process; with ranks in separate processes "
                             "(Ray actors) use backend='torch'")

        def load(r: int) -> dict[str, torch.Tensor]:
            sh = shard_for(cfg, tp, r)
            return get_weights(model, cfg, seed=seed, dtype=dtype,
                               slicer=lambda n, shape: weight_slice(cfg, sh, n, shape))

        plans = resolve_plan(plan, cfg, tp, max_batch, max_seq_len, plan_buckets, plan_context)
        if plans is not None and self.backend != "pyvm":
            raise ValueError(f"plan=... is run by the 'pyvm' backend (and on GPUs by scripts/validate_planner.py); "
                             f"the {self.backend!r} backend is conventional already")
        kw = dict(num_pages=num_pages, page_size=page_size, max_seq_len=max_seq_len, num_sms=num_sms, mode=mode,
                  seed=seed, dtype=dtype, tp_invariant=tp_invariant, plans=plans)
        if threads:
            shared = comm.group.shared
            with _LOCK:
                if "tpgroup" not in shared:
                    shared["tpgroup"] = TPGroup(cfg, [load(r) for r in range(tp)], **kw)
            self.group = shared["tpgroup"]
            self._result: dict = shared.setdefault("result", {})
        elif dist:
            self.group = TPGroup(cfg, [load(rank)], comm=comm, tp=tp, **kw)
        else:
            self.group = TPGroup(cfg, [load(r) for r in range(tp)], **kw)
        self._threads = threads

    def kv_spec(self) -> KVSpec:
        return self._spec

    def plans_used(self) -> dict:
        """Decode batches run through a plan (batch -> plan family), when the runner was given a plan book."""
        return {b: v[-1].name for b, v in list(self.group._planned.items())}

    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        if not self._threads:
            return self._step(chunks)
        if self.rank == 0:
            try:
                self._result["out"] = self._step(chunks)
            except BaseException as e:  # noqa: BLE001 - every rank reports the failure
                self._result["out"] = e
        self._comm.barrier()
        out = self._result["out"]
        self._comm.barrier()  # nobody starts the next step before all have read this one
        if isinstance(out, BaseException):
            raise out
        return out

    def _step(self, chunks: list[SeqChunk]):
        out: list[torch.Tensor | None] = [None] * len(chunks)
        toks: list[int | None] = [None] * len(chunks)
        width = -(-self._spec.max_seq_len // self._spec.page_size)
        dec = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        pre = [i for i, c in enumerate(chunks) if len(c.token_ids) > 1]
        if pre:   # the step's prompt chunks in a few left-padded prefill graphs
            lg, drawn = self.group.prefill_many([(chunks[i].token_ids, chunks[i].start_pos,
                                                  _pad(chunks[i].block_table, width), chunks[i].sampling)
                                                 for i in pre])
            for j, i in enumerate(pre):
                out[i], toks[i] = lg[j], drawn[j]
        if dec:
            logits = self.group.decode([chunks[i].token_ids[0] for i in dec], [chunks[i].start_pos for i in dec],
                                       [_pad(chunks[i].block_table, width) for i in dec], backend=self.backend,
                                       sampling=[chunks[i].sampling for i in dec])
            for j, i in enumerate(dec):
                out[i] = logits[j]
                toks[i] = int(self.group.last_next_tokens[j])
        return step_output(chunks, torch.stack(out), toks)  # type: ignore[arg-type]


_LOCK = threading.Lock()


def default_max_seq_len(cfg: ModelConfig, max_seq_len: int | None) -> int:
    return min(cfg.max_position_embeddings, 2048) if max_seq_len is None else max_seq_len


def resolve_plan(plan, cfg, tp: int, max_batch: int, max_seq_len: int | None, buckets=None, context: int = 512,
                 families: tuple[str, ...] | None = None):
    """plan=None: no planner (one task graph per batch). "auto": plan here (one process holds the whole group,
    so this is still planning once), among `families` (None: every family; tp_buckets.plan_families says which
    the runner can run). A dict: a PlanBook made by the controller (cluster/plan.py)."""
    if plan is None:
        return None
    if isinstance(plan, dict):
        from ..planner.book import check_book_for
        return check_book_for(plan, cfg, tp)   # made for this tp and this model's shapes
    if plan != "auto":
        raise ValueError(f"plan must be None, 'auto' or a plan book dict, got {plan!r}")
    from ..planner.book import DEFAULT_BUCKETS, plan_book
    buckets = buckets or sorted({b for b in DEFAULT_BUCKETS if b < max_batch} | {max_batch})
    return plan_book(cfg, tp, buckets, context=min(context, default_max_seq_len(cfg, max_seq_len)), families=families)


def _pad(table: list[int], width: int) -> list[int]:
    return list(table) + [0] * (width - len(table))


@register_runner("pyvm")
class PyVMRunner(_CPURunner):
    backend = "pyvm"


@register_runner("torch")
class TorchRunner(_CPURunner):
    backend = "torch"
