#!/usr/bin/env bash
# Launch run_train.py on every node of a cluster with msrun (MindSpore's launcher). Run the same command on each
# node, changing only NODE_RANK. The recipe's parallel_config must multiply to NNODES * DEVICES_PER_NODE
# (`python run_train.py --recipe R --dry-run` shows the layout; `python -m telechat_moe.plan` proposes one).
#
#   NNODES=512 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/msrun_launch.sh recipes/1t.yaml [--set k=v ...] [--resume]
#
# On one CPU machine (data parallel only): NNODES=1 DEVICES_PER_NODE=2 scripts/msrun_launch.sh recipes/tiny.yaml \
#     --set parallel_config.data_parallel=2
set -euo pipefail
recipe=${1:?usage: scripts/msrun_launch.sh RECIPE [run_train.py options]}
shift
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
DEVICES_PER_NODE=${DEVICES_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-8118}
LOG_DIR=${LOG_DIR:-output/msrun_logs/node_${NODE_RANK}}
CLUSTER_TIME_OUT=${CLUSTER_TIME_OUT:-600}
cd "$(dirname "$0")/.."
exec msrun --worker_num=$((NNODES * DEVICES_PER_NODE)) --local_worker_num="$DEVICES_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" \
  --log_dir="$LOG_DIR" --join=True --cluster_time_out="$CLUSTER_TIME_OUT" --bind_core=True \
  run_train.py --recipe "$recipe" --set parallel_config.devices_per_node="$DEVICES_PER_NODE" "$@"
