"""The "reference" backend: `ReferenceModel` behind the `ModelRunner` seam.

It keeps one contiguous KV cache per sequence id instead of honouring the paged layout, so it is the oracle the
paged backends are compared against through the same engine. It still validates the block tables the engine
sends (a wrong page count there would be a bug that the paged backends would turn into wrong tokens).
"""
from __future__ import annotations

import math

import torch

from ..models import KVCache, ReferenceModel, get_weights, load_config
from ..models.weights import torch_dtype
from .base import KVSpec, ModelRunner, SeqChunk, check_sizes, register_runner, runner_device
from .memory import DEFAULT_PAGE_SIZE


class ReferenceRunner(ModelRunner):
    def __init__(self, model: str, rank: int = 0, world_size: int = 1, comm=None, seed: int = 0,
                 dtype: str | torch.dtype | None = None, device: str = "cpu", max_batch: int = 8,
                 max_seq_len: int | None = None, page_size: int = DEFAULT_PAGE_SIZE, num_pages: int | None = None, **_ignored):
        if world_size != 1 or rank != 0:
            raise ValueError(f"the 'reference' backend runs a whole model on one rank (got rank={rank}, "
                             f"world_size={world_size}); use tp=1, or a tensor-parallel backend such as 'torch' "
                             "or 'pyvm' for tp > 1")
        self.device = runner_device("reference", device)
        self.config = load_config(model)
        self.rank, self.world_size = 0, 1
        # dtype None: fp32 on the CPU, as the pyvm / torch backends (the oracle should agree with them by default)
        self.dtype = torch_dtype(dtype or ("float32" if self.device.type == "cpu" else self.config.dtype))
        self.model = ReferenceModel(self.config, get_weights(model, self.config, seed=seed, dtype=self.dtype,
                                                             device=self.device))
        max_seq_len = check_sizes(self.config, max_batch, min(self.config.max_position_embeddings, 2048)
                                  if max_seq_len is None else max_seq_len, page_size, num_pages)
        pages_per_seq = math.ceil(max_seq_len / page_size)
        self._spec = KVSpec(page_size=page_size, num_pages=int(num_pages or max_batch * pages_per_seq),
                            max_batch=max_batch, max_seq_len=max_seq_len)
        self._caches: dict[int, KVCache] = {}  # seq_id -> (1, n_kv, max_seq_len, head_dim) per layer

    def kv_spec(self) -> KVSpec:
        return self._spec

    def _check(self, c: SeqChunk) -> None:
        spec = self._spec
        end = c.start_pos + len(c.token_ids)
        if end > spec.max_seq_len:
            raise ValueError(f"sequence {c.seq_id} reaches position {end} > max_seq_len {spec.max_seq_len}")
        need = math.ceil(end / spec.page_size)
        bt = c.block_table
        if len(bt) < need or len(set(bt)) != len(bt) or any(not 0 <= p < spec.num_pages for p in bt):
            raise ValueError(f"bad block table for sequence {c.seq_id}: {bt} (needs >= {need} distinct pages in "
                             f"[0, {spec.num_pages}) for {end} tokens of {spec.page_size} per page)")
        if c.start_pos > 0 and c.seq_id not in self._caches:
            raise ValueError(f"sequence {c.seq_id} continues at position {c.start_pos} but this runner has no "
                             "cache for it (was it freed, or did the worker restart?)")

    @torch.no_grad()
    def step(self, chunks: list[SeqChunk]) -> torch.Tensor:
        if len(chunks) > self._spec.max_batch:
            raise ValueError(f"{len(chunks)} chunks in one step > max_batch {self._spec.max_batch}")
        out = []
        # One forward per sequence: caches are per sequence and differ in length; the oracle favours
        # plainness over speed.
        for c in chunks:
            self._check(c)
            if c.start_pos == 0:  # a new sequence (or a seq id reused after free): fresh cache
                self._caches[c.seq_id] = self.model.new_cache(1, self._spec.max_seq_len)
            toks = torch.tensor([c.token_ids], dtype=torch.long, device=self.device)  # (1, T)
            logits = self.model.forward(toks, torch.tensor([c.start_pos]), self._caches[c.seq_id])  # (1, T, V)
            out.append(logits[0, -1])
        if not out:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32)
        return torch.stack(out).float().cpu()

    def free(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)

    def num_cached(self) -> int:
        return len(self._caches)

    def shutdown(self) -> None:
        self._caches.clear()


register_runner("reference")(ReferenceRunner)
