"""Reference forward vs Hugging Face transformers on the GPU, bf16 and fp32, same seeded weights.

    PYTHONPATH=. python3 scripts/gpu_hf_check.py [--models llama-3.2-1b,qwen3-8b,...] [--out DIR]

Builds the HF model from our config (no download), loads our weights into it by name, runs a 64-token
prompt through both, and reports max |logit diff| relative to max |logit| for the whole prompt, plus
greedy-token agreement over 32 decode steps (teacher-forced on the reference's tokens).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mpk_runtime.models import ModelConfig, PRESETS, ReferenceModel, random_weights  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def hf_model(cfg: ModelConfig, weights, dtype):
    import transformers
    hc = cfg.to_hf_config()
    arch = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[cfg.family]
    cls, conf_cls = getattr(transformers, f"{arch}ForCausalLM"), getattr(transformers, f"{arch}Config")
    hc = {k: v for k, v in hc.items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        m = cls(conf_cls(**hc))
    sd = dict(weights)
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    m.load_state_dict(sd, strict=True, assign=True)
    with torch.device(DEV):  # its buffers were made on meta
        m.model.rotary_emb = type(m.model.rotary_emb)(m.config)
    return m.to(dtype=dtype).eval()


def check(name: str, dtype: torch.dtype, steps: int = 32, T: int = 64) -> dict:
    cfg = PRESETS[name].replace(dtype=str(dtype).replace("torch.", ""))
    w = random_weights(cfg, seed=0, dtype=dtype, device=DEV)
    ref = ReferenceModel(cfg, w)
    hf = hf_model(cfg, w, dtype)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, cfg.vocab_size, (2, T), generator=g).to(DEV)
    with torch.no_grad():
        want = hf(toks).logits.float()
    cache = ref.new_cache(2, T + steps + 1)
    got = ref.forward(toks, torch.zeros(2, dtype=torch.long), cache)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    # decode: teacher-force the reference's greedy tokens through both and count agreeing argmaxes
    agree, seq = 0, toks
    tok = got[:, -1].argmax(-1)
    for s in range(steps):
        seq = torch.cat([seq, tok[:, None]], 1)
        with torch.no_grad():
            hl = hf(seq).logits[:, -1].float()
        rl = ref.forward(tok[:, None], torch.full((2,), T + s), cache)[:, 0]
        agree += int((hl.argmax(-1) == rl.argmax(-1)).sum())
        tok = rl.argmax(-1)
    del hf, w, ref
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return {"model": name, "dtype": str(dtype), "prefill_max_rel_err": rel, "decode_argmax_agree": agree,
            "decode_argmax_total": 2 * steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-llama,tiny-qwen3,llama-3.2-1b,qwen3-8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    import transformers
    rows = []
    for name in a.models.split(","):
        for dt in (torch.float32, torch.bfloat16):
            t0 = time.time()
            r = check(name, dt)
            r["seconds"] = round(time.time() - t0, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
    meta = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "torch": torch.__version__, "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(os.path.join(a.out, "hf_check.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{'model':14s} {'dtype':15s} {'max rel err':>12s} {'argmax agree':>13s}")
    for r in rows:
        print(f"{r['model']:14s} {r['dtype']:15s} {r['prefill_max_rel_err']:12.2e} "
              f"{r['decode_argmax_agree']:>6d}/{r['decode_argmax_total']}")


if __name__ == "__main__":
    main()
