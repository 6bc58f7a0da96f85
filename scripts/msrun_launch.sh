#!/usr/bin/env bash
# Launch run_train.py on every node of a cluster with msrun (MindSpore's launcher). Run the same command on each
# node, changing only NODE_RANK. Before msrun starts anything the recipe is read (with the same --set options) and
# the launch stops with one line (exit 2) if its parallel_config does not multiply to NNODES * DEVICES_PER_NODE, or
# if training cannot run its layout (`python run_train.py --recipe R --dry-run` shows the layout;
# `python -m telechat_moe.plan` proposes one).
#
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/msrun_launch.sh recipes/105b.yaml \
#       --set parallel_config.pipeline_stage=1 --set parallel_config.expert_parallel_over_tp=true [--resume]
#
# Environment (defaults in brackets):
#   NNODES [1]             nodes in the job
#   NODE_RANK [0]          this node, 0 .. NNODES-1; its workers are ranks NODE_RANK*DEVICES_PER_NODE onwards
#   DEVICES_PER_NODE [8]   workers (one per NPU) on each node; also the recipe's parallel_config.devices_per_node
#   MASTER_ADDR            address of node 0, where msrun's scheduler listens [127.0.0.1; required when NNODES > 1]
#   MASTER_PORT [8118]     the scheduler's port on MASTER_ADDR
#   LOG_DIR [output/msrun_logs/node_<NODE_RANK>]  msrun's scheduler and worker logs (relative to the repository)
#   CLUSTER_TIME_OUT [600] seconds the processes wait for the whole cluster to join before they give up
#   BIND_CORE [True]       msrun --bind_core: True binds each rank to CPU cores near its NPU, False does not, or a
#                          JSON map '{"device0":["0-23"],"device1":["24-47"],...}' gives each rank its cores
#   BIND_NUMA []           msrun --bind_numa (True, or a JSON map of NUMA nodes per device); not passed when empty
#   PYTHON [python]        the interpreter for the check (msrun starts its workers with the first python on PATH)
#   HCCL_CONNECT_TIMEOUT [600], HCCL_EXEC_TIMEOUT [1836]: exported for HCCL (a recipe's context.hccl_* overrides
#                          them inside each worker); HCCL's own defaults are 120 and 1836 s; compiling a large
#                          graph on many ranks can skew their link setup past 120 s
#
# On one CPU machine (data parallel only): NNODES=1 DEVICES_PER_NODE=2 scripts/msrun_launch.sh recipes/tiny.yaml \
#     --set parallel_config.data_parallel=2
set -euo pipefail
fail() { echo "error: $*" >&2; exit 2; }
[ $# -ge 1 ] || fail "usage: scripts/msrun_launch.sh RECIPE [run_train.py options]"
recipe=$1
shift
# a recipe file named relative to where the command runs (the launch runs from the repository root)
if [ -f "$recipe" ]; then
  recipe="$(cd "$(dirname "$recipe")" && pwd)/$(basename "$recipe")"
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
DEVICES_PER_NODE=${DEVICES_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-8118}
CLUSTER_TIME_OUT=${CLUSTER_TIME_OUT:-600}
BIND_CORE=${BIND_CORE:-True}
BIND_NUMA=${BIND_NUMA:-}
PYTHON=${PYTHON:-python}
for var in NNODES NODE_RANK DEVICES_PER_NODE MASTER_PORT; do
  [[ ${!var} =~ ^[0-9]+$ ]] || fail "$var: expected a non-negative integer, got '${!var}'"
done
[[ $CLUSTER_TIME_OUT =~ ^-?[0-9]+$ ]] ||
  fail "CLUSTER_TIME_OUT: expected seconds (negative: wait forever), got '$CLUSTER_TIME_OUT'"
[ "$NNODES" -ge 1 ] || fail "NNODES: expected at least 1 node, got $NNODES"
[ "$DEVICES_PER_NODE" -ge 1 ] || fail "DEVICES_PER_NODE: expected at least 1 worker per node, got $DEVICES_PER_NODE"
[ "$NODE_RANK" -lt "$NNODES" ] || fail "NODE_RANK: expected 0 to $((NNODES - 1)) for NNODES=$NNODES, got $NODE_RANK"
[ "$MASTER_PORT" -ge 1024 ] && [ "$MASTER_PORT" -le 65535 ] ||
  fail "MASTER_PORT: expected 1024 to 65535, got $MASTER_PORT"
if [ -z "${MASTER_ADDR:-}" ]; then
  [ "$NNODES" -eq 1 ] || fail "MASTER_ADDR: set it to node 0's address (the msrun scheduler) for NNODES=$NNODES"
  MASTER_ADDR=127.0.0.1
fi
LOG_DIR=${LOG_DIR:-output/msrun_logs/node_${NODE_RANK}}
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-600}
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1836}
cd "$(dirname "$0")/.."
world=$((NNODES * DEVICES_PER_NODE))
sets=(--set parallel_config.devices_per_node="$DEVICES_PER_NODE")

# The recipe as each worker will read it: its layout must fill NNODES x DEVICES_PER_NODE, training must run it and
# it must fit the devices (run_train.py's checks, here before msrun starts a process on any node).
NNODES=$NNODES DEVICES_PER_NODE=$DEVICES_PER_NODE "$PYTHON" - "$recipe" "${sets[@]}" "$@" <<'EOF' || exit 2
import argparse, os, sys
from oneline import InputError
from parallel.planner.machine import total_memory_bytes
from telechat_moe.dry_run import fit_problem
from telechat_moe.launch import has_ascend
from telechat_moe.recipe import load_recipe
from telechat_moe.recipe_checks import check_trainable
ap = argparse.ArgumentParser(add_help=False)
ap.add_argument("recipe")
ap.add_argument("--set", action="append", default=[])
args, _ = ap.parse_known_args()
nodes, per_node = int(os.environ["NNODES"]), int(os.environ["DEVICES_PER_NODE"])
try:
    r = load_recipe(args.recipe, args.set)
    p, world = r.parallel_config, r.layout.world_size
    if world != nodes * per_node:
        sys.exit(f"error: parallel_config: data_parallel*model_parallel*context_parallel*pipeline_stage = "
                 f"{p.data_parallel}*{p.model_parallel}*{p.context_parallel}*{p.pipeline_stage} = {world} devices, "
                 f"but NNODES*DEVICES_PER_NODE = {nodes}*{per_node} = {nodes * per_node} ("
                 + (f"launch NNODES={world // per_node}" if world % per_node == 0 else
                    f"{world} devices do not fill nodes of {per_node}") + ", or change parallel_config with --set)")
    check_trainable(r, world)
    problem = fit_problem(r, total_memory_bytes(), has_ascend())   # this node's kind of machine, as every node's
    if problem:
        sys.exit(f"error: {problem}")
except InputError as e:
    sys.exit(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
EOF

bind=(--bind_core="$BIND_CORE")
[ -z "$BIND_NUMA" ] || bind+=(--bind_numa="$BIND_NUMA")
exec msrun --worker_num="$world" --local_worker_num="$DEVICES_PER_NODE" \
  --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" --node_rank="$NODE_RANK" \
  --log_dir="$LOG_DIR" --join=True --cluster_time_out="$CLUSTER_TIME_OUT" "${bind[@]}" \
  run_train.py --recipe "$recipe" "${sets[@]}" "$@"
