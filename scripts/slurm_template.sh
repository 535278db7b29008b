#!/usr/bin/env bash
# Ray on Slurm: one Ray node per Slurm node, head on the first, then the job on the head.
#   sbatch scripts/slurm_template.sh --model /shared/models/Qwen3-8B --tp 2 --replicas 2 --input in.jsonl --output out.jsonl
# (--replicas: copies of the model, each a TP group of --tp GPUs on one node; nodes x GPUs a node / tp of them use
# every GPU the job holds: 2 here. Without it one TP group runs and the other node idles.)
# The arguments go to `python -m cluster.jobs.generate` (its --help lists them). From Slurm: SLURM_JOB_NODELIST,
# SLURM_CPUS_PER_TASK, SLURM_GPUS_PER_NODE (a count or TYPE:COUNT, as --gpus-per-node). NVLink multicast stays off:
# NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 reach every step (srun --export=ALL).
#SBATCH --job-name=mpk-runtime
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=2
#SBATCH --cpus-per-task=16
#SBATCH --time=01:00:00
set -euo pipefail
# (no arguments: the nodes' Ray was started, and the time waited, before the job said --model is required)
if [[ $# -eq 0 ]]; then
  echo "usage: sbatch scripts/slurm_template.sh --model M --input /shared/in.jsonl --output /shared/out.jsonl [...]" \
       "(python -m cluster.jobs.generate --help lists the arguments)" >&2; exit 2
fi
export RAY_AUTH_MODE=token
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# The token must be the same on all nodes: keep it on the shared home directory (~/.ray/auth_token).
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD="${NODES[0]}"
HEAD_IP=$(srun --export=ALL --nodes=1 --ntasks=1 -w "$HEAD" hostname -I | awk '{print $1}')
if [[ -z "$HEAD_IP" ]]; then echo "cannot tell $HEAD's IP (hostname -I there gave none)" >&2; exit 1; fi
PORT=6379
GPUS="${SLURM_GPUS_PER_NODE:-2}"
GPUS="${GPUS##*:}"   # --gpus-per-node=h100:2 sets SLURM_GPUS_PER_NODE=h100:2; ray start --num-gpus takes the count
# --export=ALL: the steps get this script's exports (the NVLS switches above) even under sbatch --export=NONE
srun --export=ALL --nodes=1 --ntasks=1 -w "$HEAD" ray start --head --node-ip-address="$HEAD_IP" --port=$PORT \
  --dashboard-host=127.0.0.1 --num-gpus="$GPUS" --num-cpus="$SLURM_CPUS_PER_TASK" --block &
sleep 15
for node in "${NODES[@]:1}"; do
  srun --export=ALL --nodes=1 --ntasks=1 -w "$node" ray start --address="$HEAD_IP:$PORT" --num-gpus="$GPUS" \
    --num-cpus="$SLURM_CPUS_PER_TASK" --block &
done
sleep 15
# The driver runs here, in the batch script (Slurm runs it on the first node: the head), not as a step of its own:
# the head's `ray start --block` step holds that node's CPUs and GPUs and steps do not overlap by default, so a
# second srun step there would wait until the job's time limit.
RAY_ADDRESS="$HEAD_IP:$PORT" python -m cluster.jobs.generate --executor ray "$@"
