#!/usr/bin/env bash
# Join a worker node to the head:  scripts/launch_worker.sh HEAD_IP:6379 [--num-gpus N] [extra ray start args]
# Needs the head's auth token in ~/.ray/auth_token (or RAY_AUTH_TOKEN) - token auth stays on.
set -euo pipefail
HEAD="${1:-}"
if [[ -z "$HEAD" || "$HEAD" == -* ]]; then
  echo "usage: launch_worker.sh HEAD_IP:PORT [ray start args] (the head's address first)" >&2; exit 2
fi
shift
export RAY_AUTH_MODE=token
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [[ ! -f "$HOME/.ray/auth_token" && -z "${RAY_AUTH_TOKEN:-}" ]]; then
  echo "no Ray auth token: copy the head's ~/.ray/auth_token here or set RAY_AUTH_TOKEN" >&2; exit 1
fi
NODE_IP="${NODE_IP:-$( (hostname -I 2>/dev/null || true) | awk '{print $1}')}"
if [[ -z "$NODE_IP" ]]; then
  echo "cannot tell this node's IP (hostname -I gave none): set NODE_IP=<address the other nodes reach>" >&2; exit 1
fi
ray start --address="$HEAD" --node-ip-address="$NODE_IP" "$@"
