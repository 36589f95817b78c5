#!/usr/bin/env bash
# torchrun over NODES emulated nodes on this one host (issue 43's two-tier network, for measurement only).
#   NODES=2 NPROC=4 bash bench/torchrun_nodes.sh bench/a2a_probe.py --out probe.json
# NPROC processes in all, NPROC / NODES a node: each node is its own torchrun with its slice of the GPUs
# (CUDA_VISIBLE_DEVICES, or of the list it gives) and its own NCCL_HOSTID, so NCCL takes two nodes' ranks for
# different hosts: NVLink (P2P) inside a node, its network transport between them: sockets over loopback
# (NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo, and NCCL_MNNVL_ENABLE=0 so that no multi-node NVLink is tried, unless
# given otherwise; ../shared/recipes/emulated-inter-node.md has their measured speed). Global ranks are numbered
# node by node, and each rank's
# LOCAL_WORLD_SIZE is its node's NPROC / NODES (what attnpool train's ranks_per_node defaults to). NODES=1: one plain
# torchrun. The arguments are what torchrun runs. If one node's torchrun fails, the others are stopped rather than
# left waiting for it, and a TERM or INT to this script goes on to every node. PYTHON (default python3) runs
# torchrun; MASTER_PORT (default a free one) is the rendezvous's. Needs bash 5.1+ (wait -p).
set -uo pipefail
if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501 )); then
  echo "torchrun_nodes: needs bash 5.1 or later (wait -n -p), this is $BASH_VERSION" >&2
  exit 2
fi
NODES=${NODES:-1} NPROC=${NPROC:-4} PYTHON=${PYTHON:-python3}
if [ "$NODES" -lt 1 ] || [ $((NPROC % NODES)) -ne 0 ]; then
  echo "torchrun_nodes: NPROC=$NPROC processes do not split into NODES=$NODES nodes" >&2
  exit 2
fi
if [ "$NODES" = 1 ]; then
  exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "$@"
fi
per=$((NPROC / NODES))
# (a port below the kernel's ephemeral range, which no other process's bind(0) takes while node 0's torchrun starts)
port=${MASTER_PORT:-$("$PYTHON" "$(dirname "${BASH_SOURCE[0]}")/../src/attnpool/comm/ports.py")}
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"; else gpus=($(seq 0 $((NPROC - 1)))); fi
if [ ${#gpus[@]} -lt "$NPROC" ]; then
  echo "torchrun_nodes: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES lists ${#gpus[@]} GPUs for NPROC=$NPROC" >&2
  exit 2
fi
export NCCL_IB_DISABLE=${NCCL_IB_DISABLE:-1} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo} \
  NCCL_MNNVL_ENABLE=${NCCL_MNNVL_ENABLE:-0}
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
for ((node = 0; node < NODES; node++)); do
  slice=$(IFS=,; echo "${gpus[*]:$((node * per)):$per}")
  CUDA_VISIBLE_DEVICES=$slice NCCL_HOSTID="attnpool-emulated-node-$node" "$PYTHON" -m torch.distributed.run \
    --nnodes "$NODES" --node-rank "$node" --nproc-per-node "$per" --master-addr localhost --master-port "$port" "$@" &
  pids+=($!)
done
rc=0 live=("${pids[@]}")
while [ ${#live[@]} -gt 0 ]; do
  finished=
  wait -n -p finished "${live[@]}"
  status=$?
  rest=()
  for pid in "${live[@]}"; do [ "$pid" != "$finished" ] && rest+=("$pid"); done
  live=("${rest[@]+"${rest[@]}"}")
  if [ "$status" -ne 0 ] && [ "$rc" -eq 0 ]; then
    rc=$status
    [ ${#live[@]} -gt 0 ] && kill -TERM "${live[@]}" 2>/dev/null  # (their collectives would wait for its ranks)
  fi
done
exit $rc
