#!/usr/bin/env bash
# Multi-node launch of the same entry point with torchrun's c10d rendezvous. Run it once on every
# node with the same MASTER_ADDR/MASTER_PORT/NNODES and that node's NODE_RANK, e.g. on 2 nodes of
# 8 GPUs with tp=8 inside each node and data parallel across nodes:
#   node 0: MASTER_ADDR=node0 NNODES=2 NODE_RANK=0 NPROC_PER_NODE=8 bash launch/multinode.sh --device cuda --tp 8
#   node 1: MASTER_ADDR=node0 NNODES=2 NODE_RANK=1 NPROC_PER_NODE=8 bash launch/multinode.sh --device cuda --tp 8
# Global rank = NODE_RANK * NPROC_PER_NODE + local rank, and TP groups are consecutive ranks, so a
# --tp that divides NPROC_PER_NODE keeps every TP group inside one node (only the DP gradient
# all-reduce crosses nodes). Arguments after the script go to launch.train.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MASTER_ADDR:?set MASTER_ADDR to the host name or IP of node 0}"
MASTER_PORT="${MASTER_PORT:-29500}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
NPROC_PER_NODE="${NPROC_PER_NODE:-1}"
RDZV_ID="${RDZV_ID:-cce_dist_train}"
exec python -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" \
    -m launch.train "$@"
