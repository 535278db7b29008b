"""Engine options shared by the command lines (python -m mpk_runtime generate, cluster.server,
cluster.jobs.generate)."""
from __future__ import annotations

import argparse


def add_engine_flags(ap: argparse.ArgumentParser) -> None:
    from .llm import DEFAULT_DECODE_STEPS
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="decode steps per engine step while every running request is sampled on the device and no "
                         "waiting one could be admitted (the tokens stay on the GPU between them; default "
                         f"{DEFAULT_DECODE_STEPS} where the backend samples on the device, else 1; 1 streams every "
                         "token as it is drawn)")
    ap.add_argument("--plan", default=None, choices=["none", "auto"],
                    help="auto: the planner's plan per decode batch bucket, made once in the controller (backends pyvm "
                         "and megakernel; megakernel at tp > 1: one whole-step megakernel per bucket); none: one task "
                         "graph / megakernel for max-batch rows (default: auto for megakernel, else none)")
    ap.add_argument("--async-bursts", action=argparse.BooleanOptionalAction, default=None,
                    help="queue the next burst of decode steps on the device before reading the last one (needs "
                         "decode steps > 1; default: on; --no-async-bursts runs bursts synchronously)")
    ap.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                    help="keep computed K/V pages cached by content: prompts that start alike (a system prompt, a "
                         "chat's earlier turns) skip the cached part of their prefill (default: on for the backends "
                         "that can, pyvm, torch, megakernel)")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="KV cache pages per replica (default: enough for max-batch sequences of max-seq-len; on one GPU as many of those as fit its free memory beside the weights and a reserve)")
    ap.add_argument("--page-size", type=int, default=None, help="tokens per KV page (default 16)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="tokens one engine step computes at most: long prompts are prefilled in chunks of this "
                         "(default: 4096, at least max-batch)")
    ap.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                    help="sampling defaults of a request that leaves temperature / top-p / top-k / min-p / "
                         "repetition-penalty / max-tokens out: auto (default, as vLLM's) = the model directory's "
                         "generation_config.json, vllm = none, or a directory holding one")
    ap.add_argument("--kv-allocation", choices=("lazy", "reserve"), default="lazy",
                    help="lazy (default): KV pages taken as tokens need them, the newest request preempted (and "
                         "recomputed later) when they run out; reserve: a request's whole length at admission")


def engine_kwargs(a: argparse.Namespace) -> dict:
    """LLM keywords of add_engine_flags' options."""
    sizes = {k: getattr(a, k) for k in ("num_pages", "page_size", "max_num_batched_tokens")
             if getattr(a, k) is not None}
    sizes.update(plan_kw(a.plan, getattr(a, "backend", None)))
    return dict(async_bursts=a.async_bursts, enable_prefix_caching=a.enable_prefix_caching,
                kv_allocation=a.kv_allocation, decode_steps=a.decode_steps, generation_config=a.generation_config,
                **sizes)


def plan_kw(plan: str | None, backend: str | None) -> dict:
    """LLM's `plan` keyword for a command line's --plan (None: not given): "auto" as is, "none" as plan=None where
    the backend's default differs (megakernel: runtime/executor.default_plan), else nothing."""
    if plan == "auto":
        return {"plan": "auto"}
    if plan == "none" and backend == "megakernel":
        return {"plan": None}
    return {}
