"""ModelRunner backend "megakernel": one rank (world size 1), decode through the GPU megakernel.

Mirrors `_CPURunner` (pyvm_runner.py). Prefill: the prompt's tokens run as single-token decode steps through
the same megakernel (one launch per token; correct, not fast) because the conventional executor's StepCtx
helpers build CPU index tensors. Batches are padded to the graph's batch with inactive rows (pos = -1).
torch.cuda / cuda-python are touched only when a runner is created.
"""
from __future__ import annotations

import torch

from ..ir.build import build_graph
from ..models.config import load_config
from ..models.reference import rope_inv_freq
from ..models.weights import get_weights, torch_dtype
from ..tasks.build import build_task_graphs
from ..tasks.tiling import Tiling
from .base import KVSpec, ModelRunner, SeqChunk, register_runner
from .memory import KVStore, RankMemory


@register_runner("megakernel")
class MegakernelRunner(ModelRunner):
    backend = "megakernel"

    def __init__(self, model: str = "tiny-llama", *, world_size: int | None = None, tp: int = 1, rank: int = 0,
                 seed: int = 0, dtype: str | None = "bfloat16", max_batch: int = 8, max_seq_len: int = 512,
                 page_size: int = 16, num_pages: int | None = None, num_sms: int | None = None,
                 attn_splits: int = 2, timeout_s: float = 2.0, device: str = "cuda", **_: object):
        from .megakernel import Megakernel
        if (world_size or tp) != 1:
            raise NotImplementedError("the megakernel backend runs world size 1 so far (TP needs NVSHMEM peers)")
        self.config = cfg = load_config(model)
        self.rank, self.world_size = 0, 1
        dtype = dtype or "bfloat16"
        dev = torch.device(device)
        w = {k: v.to(dev) for k, v in get_weights(model, cfg, seed=seed, dtype=dtype).items()}
        num_pages = num_pages or max_batch * (-(-max_seq_len // page_size)) + 1
        self._spec = KVSpec(page_size, num_pages, max_batch, max_seq_len)
        self.kv = KVStore(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, torch_dtype(dtype),
                          device=dev)
        num_sms = num_sms or torch.cuda.get_device_properties(dev).multi_processor_count
        g = build_graph(cfg, mode="decode", batch=max_batch, context_len=0, max_seq_len=max_seq_len,
                        attn_splits=attn_splits, dtype=dtype)
        self.tg = build_task_graphs([g], Tiling(num_sms=num_sms))[0]
        self.mem = RankMemory(g, w, self.kv, device=dev)
        self.width = -(-max_seq_len // page_size)
        self.tables = torch.zeros((max_batch, self.width), dtype=torch.int64, device=dev)
        self.pos = torch.full((max_batch,), -1, dtype=torch.int64, device=dev)
        self.mk = Megakernel(self.tg, self.mem, page_size=page_size, block_tables=self.tables, pos=self.pos,
                             inv_freq=rope_inv_freq(cfg), head_dim=cfg.head_dim, timeout_s=timeout_s)

    def kv_spec(self) -> KVSpec:
        return self._spec

    def _decode(self, toks: list[int], pos: list[int], tables: list[list[int]]) -> torch.Tensor:
        B = self._spec.max_batch
        n = len(toks)
        t = torch.zeros(B, dtype=torch.int64)
        p = torch.full((B,), -1, dtype=torch.int64)
        tab = torch.zeros((B, self.width), dtype=torch.int64)
        t[:n], p[:n] = torch.tensor(toks), torch.tensor(pos)
        for i, row in enumerate(tables):
            tab[i, :len(row)] = torch.tensor(row)
        self.mem.t("tokens").copy_(t)
        self.pos.copy_(p)
        self.tables.copy_(tab)
        self.mk.launch(1)
        torch.cuda.synchronize(self.pos.device)
        self.mk.check()
        return self.mem.t("logits")[:n].float().cpu()

    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        B = self._spec.max_batch
        out: list[torch.Tensor | None] = [None] * len(chunks)
        dec = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
        for i, c in enumerate(chunks):
            if len(c.token_ids) > 1:   # prefill as a run of single-token steps
                for j, tok in enumerate(c.token_ids):
                    lg = self._decode([tok], [c.start_pos + j], [c.block_table])
                out[i] = lg[0]
        for s in range(0, len(dec), B):
            part = dec[s:s + B]
            lg = self._decode([chunks[i].token_ids[0] for i in part], [chunks[i].start_pos for i in part],
                              [chunks[i].block_table for i in part])
            for j, i in enumerate(part):
                out[i] = lg[j]
        return torch.stack(out)  # type: ignore[arg-type]
