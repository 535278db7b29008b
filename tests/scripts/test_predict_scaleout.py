"""scripts/predict_scaleout.py's per-GPU floor: what one rank streams (a tied LM head: only its vocabulary rows)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import predict_scaleout  # noqa: E402

from mpk_runtime.ir import build_graph  # noqa: E402
from mpk_runtime.models.config import load_config  # noqa: E402


@pytest.mark.parametrize("model", ["llama-3.2-1b", "qwen3-8b"])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_floor_counts_the_ranks_lm_head_rows_once(model, tp):
    cfg = load_config(model)
    g = build_graph(cfg, batch=1, tp=tp)
    emb = cfg.vocab_size * cfg.hidden_size * 2
    head = (cfg.vocab_size // tp) * cfg.hidden_size * 2
    # the graph holds the whole (replicated) embedding table; a rank streams only its LM head rows (tied) or its
    # lm_head slice (untied, already in the graph), never the gathered embedding table
    want = g.weight_bytes() - emb + (head if cfg.tie_word_embeddings else 0)
    assert predict_scaleout.stream_bytes_per_gpu(cfg, tp) == want
