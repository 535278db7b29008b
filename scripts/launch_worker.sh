#!/usr/bin/env bash
# Join a worker node to the head:  scripts/launch_worker.sh HEAD_IP:6379 [--num-gpus N] [extra ray start args]
# Needs the head's auth token in ~/.ray/auth_token (or RAY_AUTH_TOKEN) - token auth stays on.
# Environment: NODE_IP (this node's address the others reach; default: the first of `hostname -I`), RAY_AUTH_TOKEN.
# NVLink multicast stays off: NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are
# exported to the node's Ray processes whatever the caller's environment says.
set -euo pipefail
usage() { sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; }
HEAD="${1:-}"
if [[ "$HEAD" == "-h" || "$HEAD" == "--help" ]]; then usage; exit 0; fi
# (a flag first - the address forgotten - or an address without its port, or the dashboard's URL
# (http://HEAD:8265, as submit.py takes), which ray start refused with a traceback)
if [[ -z "$HEAD" || "$HEAD" == -* || "$HEAD" == *://* || ! "$HEAD" =~ :[0-9]+$ ]]; then
  echo "usage: launch_worker.sh HEAD_IP:PORT [ray start args] (the head's address first, with its GCS port: 6379" \
       "unless the head set RAY_PORT; launch_head.sh prints it. Not the dashboard's http:// URL)" >&2; exit 2
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
