#!/usr/bin/env python
"""Submit a batch generation job to a Ray cluster (Job API; needs `ray[default]` on the head node).

    RAY_AUTH_MODE=token python scripts/submit.py --address http://127.0.0.1:8265 -- \
        --model /models/Qwen3-8B --tp 2 --input prompts.jsonl --output /shared/out.jsonl

Everything after `--` goes to `python -m cluster.jobs.generate`. The working directory (this checkout) is
shipped as the job's runtime_env working_dir, so workers import this exact code; model weights are NOT
shipped - every worker reads them from --model, which must be a path visible on every node (shared disk).
Ray token auth stays on: the client reads the token from ~/.ray/auth_token (or RAY_AUTH_TOKEN).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXCLUDES = [".git", "bench/results", "**/__pycache__", "*.safetensors", ".gpubundle"]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "NVSHMEM_DISABLE_NVLS": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def build_job(job_args: list[str], pip: list[str] | None = None, env: dict | None = None) -> dict:
    """The entrypoint and runtime_env for `JobSubmissionClient.submit_job` (separate for tests)."""
    if not job_args:
        raise SystemExit("give the job's arguments after `--`, e.g. -- --model tiny-qwen3 --input in.jsonl --output out.jsonl")
    bad = {k: v for k, v in (env or {}).items() if k in NO_MULTICAST and str(v) != NO_MULTICAST[k]}
    if bad:
        raise SystemExit(f"{bad}: NVLink multicast stays off on these machines ({NO_MULTICAST}); leave them out")
    runtime_env: dict = {"working_dir": ROOT, "excludes": EXCLUDES, "env_vars": {**(env or {}), **NO_MULTICAST}}
    if pip:
        runtime_env["pip"] = pip
    return {"entrypoint": "python -m cluster.jobs.generate " + " ".join(shlex.quote(a) for a in job_args),
            "runtime_env": runtime_env}


def check_paths(job_args: list[str]) -> None:
    """--input / --output (and a --model that is a local directory) must be absolute: the job runs in a temporary
    copy of this checkout on the cluster (without its *.safetensors)."""
    for i, arg in enumerate(job_args):
        flag, _, val = arg.partition("=")
        if flag in ("--input", "--output", "--model"):
            path = val if val else (job_args[i + 1] if i + 1 < len(job_args) else "")
            if flag == "--model" and not os.path.exists(path):   # a preset name (or a path only the cluster has)
                continue
            if path and not os.path.isabs(path):
                raise SystemExit(f"{flag} {path}: give an absolute path on storage every node sees; the job runs in a "
                                 "temporary copy of this checkout on the cluster, where a relative path would be "
                                 "read from / written to (and deleted with) that copy")


def check_job_args(job_args: list[str]) -> None:
    """The job's arguments parsed here, with the job's own parser, before anything is shipped: a misspelt flag or
    a missing --input was an error in the job's log on the cluster, after the checkout's upload."""
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from cluster.jobs.generate import build_parser, check_args
    from mpk_runtime.engine import InvalidRequestError
    try:
        check_args(build_parser().parse_args(job_args))   # (argparse: usage and exit 2 on a bad flag)
    except InvalidRequestError as e:
        raise SystemExit(f"error: {e}") from None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    job_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", default=os.environ.get("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:8265"),
                    help="the head's dashboard address (Job API)")
    ap.add_argument("--pip", nargs="*", default=None, help="extra pip packages for the job's runtime_env")
    ap.add_argument("--no-wait", action="store_true", help="return after submitting")
    ap.add_argument("--timeout", type=float, default=3600.0)
    a, unknown = ap.parse_known_args(own)
    if unknown:
        raise SystemExit(f"unknown arguments {' '.join(unknown)}: the job's arguments go after `--`, e.g. "
                         "scripts/submit.py --address URL -- --model M --input /abs/in.jsonl --output /abs/out.jsonl")
    check_job_args(job_args)
    check_paths(job_args)
    job = build_job(job_args, a.pip)
    try:
        from ray.job_submission import JobStatus, JobSubmissionClient
    except ImportError as e:
        raise SystemExit(f"the Job API needs Ray with the dashboard client: pip install 'ray[default]' ({e})")
    os.environ.setdefault("RAY_AUTH_MODE", "token")  # auth stays on (Ray 2.60 default); never disable it
    try:
        client = JobSubmissionClient(a.address)
    except Exception as e:  # noqa: BLE001 - ConnectionError (an http:// address), RpcError (a GCS host:port, after 40 s)
        # (was Ray's traceback)
        raise SystemExit(f"cannot reach the Ray Job API at {a.address}: {type(e).__name__}: {e}\nIs the head up (`ray "
                         "status` on it)? Give its dashboard address: http://127.0.0.1:8265 through an SSH tunnel "
                         "(ssh -N -L 8265:127.0.0.1:8265 HEAD; launch_head.sh binds the dashboard to the head's "
                         "127.0.0.1)") from None
    deadline = time.monotonic() + 120
    while True:   # a head just started answers "No available agent to submit job" until its job agent is up
        try:
            job_id = client.submit_job(**job)
            break
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
            print("the head's job agent is not up yet; trying again", file=sys.stderr)
            time.sleep(3)
    print(f"submitted {job_id}: {job['entrypoint']}")
    if a.no_wait:
        return 0
    deadline = time.monotonic() + a.timeout
    status = None
    while time.monotonic() < deadline:
        status = client.get_job_status(job_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            break
        time.sleep(2)
    print(client.get_job_logs(job_id)[-4000:])
    print(f"job {job_id}: {status}")
    if status not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        print(f"still running on the cluster after --timeout {a.timeout:g} s: follow it with `ray job logs --follow "
              f"{job_id} --address {a.address}`, or end it with `ray job stop {job_id} --address {a.address}`")
    return 0 if status == JobStatus.SUCCEEDED else 1


if __name__ == "__main__":
    sys.exit(main())
