#!/usr/bin/env bash
# Start the Ray head node. Token auth stays on (Ray 2.60 default; the token is written to ~/.ray/auth_token and
# must be copied to every worker node and client). The dashboard / Job API binds to 127.0.0.1: reach it with an
# SSH tunnel (ssh -L 8265:127.0.0.1:8265 head) - never expose it (unauthenticated job submission = remote code
# execution, CVE-2023-48022).
#   scripts/launch_head.sh [--num-gpus N] [extra ray start args]
# Environment: NODE_IP (the address other nodes reach; default: the first of `hostname -I`), RAY_PORT (GCS port,
# 6379), DASHBOARD_PORT (8265). NVLink multicast stays off: NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1 and
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are exported to the node's Ray processes whatever the caller's environment says.
set -euo pipefail
usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; }
# (before anything else: `--help` went on to `ray start --head ... --help` and then printed "head at ..." as if a
# head had started)
for arg in "$@"; do case "$arg" in -h|--help) usage; exit 0;; esac; done
# (a --port or --node-ip-address among the extra args is the one ray start uses - it takes the last - but the
# address printed below for the workers was RAY_PORT's and NODE_IP's)
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --port=*) RAY_PORT="${args[i]#*=}";;
    --port) RAY_PORT="${args[i+1]:-}";;
    --node-ip-address=*) NODE_IP="${args[i]#*=}";;
    --node-ip-address) NODE_IP="${args[i+1]:-}";;
  esac
done
PORT="${RAY_PORT:-6379}"
export RAY_AUTH_MODE=token
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NODE_IP="${NODE_IP:-$( (hostname -I 2>/dev/null || true) | awk '{print $1}')}"
if [[ -z "$NODE_IP" ]]; then
  echo "cannot tell this node's IP (hostname -I gave none): set NODE_IP=<address the other nodes reach>" >&2; exit 1
fi
ray start --head --node-ip-address="$NODE_IP" --port="$PORT" \
  --dashboard-host=127.0.0.1 --dashboard-port="${DASHBOARD_PORT:-8265}" "$@"
echo "head at $NODE_IP:$PORT; workers: scripts/launch_worker.sh $NODE_IP:$PORT (copy ~/.ray/auth_token first)"
