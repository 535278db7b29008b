"""Engine options shared by the serving entry points' command lines (cluster.server, cluster.jobs.generate)."""
from __future__ import annotations

import argparse


def add_engine_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--async-bursts", action="store_true",
                    help="submit the next burst of decode steps before reading the last one (needs decode steps > 1)")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="keep computed K/V pages cached by content: prompts that start alike (a system prompt, a "
                         "chat's earlier turns) skip the cached part of their prefill (backends pyvm, torch, "
                         "megakernel)")


def engine_kwargs(a: argparse.Namespace) -> dict:
    """LLM keywords of add_engine_flags' options."""
    return dict(async_bursts=a.async_bursts, enable_prefix_caching=a.enable_prefix_caching)
