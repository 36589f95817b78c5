#!/usr/bin/env bash
# torchrun over NODES emulated nodes on this one host (issue 43's two-tier network, for measurement only).
#   NODES=2 NPROC=4 bash bench/torchrun_nodes.sh bench/a2a_probe.py --out probe.json
# NPROC processes in all, NPROC / NODES a node: each node is its own torchrun with its slice of the GPUs
# (CUDA_VISIBLE_DEVICES, or of the list it gives) and its own NCCL_HOSTID, so NCCL takes two nodes' ranks for
# different hosts: NVLink (P2P) inside a node, its network transport between them, sockets over loopback with
# NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo (bench/gpu_e2e.sh's two-tier phase sets them;
# ../shared/recipes/emulated-inter-node.md). Global ranks are numbered node by node, and each rank's
# LOCAL_WORLD_SIZE is its node's NPROC / NODES (what attnpool train's ranks_per_node defaults to). NODES=1: one plain
# torchrun. The arguments are what torchrun runs. If one node's torchrun fails, the others are stopped rather than
# left waiting for it. PYTHON (default python3) runs torchrun; MASTER_PORT (default a random one) the rendezvous.
set -uo pipefail
NODES=${NODES:-1} NPROC=${NPROC:-4} PYTHON=${PYTHON:-python3}
if [ "$NODES" -lt 1 ] || [ $((NPROC % NODES)) -ne 0 ]; then
  echo "torchrun_nodes: NPROC=$NPROC processes do not split into NODES=$NODES nodes" >&2
  exit 2
fi
if [ "$NODES" = 1 ]; then
  exec "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "$@"
fi
per=$((NPROC / NODES)) port=${MASTER_PORT:-$((29500 + RANDOM % 1000))}
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a gpus <<< "$CUDA_VISIBLE_DEVICES"; else gpus=($(seq 0 $((NPROC - 1)))); fi
pids=()
for ((node = 0; node < NODES; node++)); do
  slice=$(IFS=,; echo "${gpus[*]:$((node * per)):$per}")
  CUDA_VISIBLE_DEVICES=$slice NCCL_HOSTID="attnpool-emulated-node-$node" "$PYTHON" -m torch.distributed.run \
    --nnodes "$NODES" --node-rank "$node" --nproc-per-node "$per" --master-addr localhost --master-port "$port" "$@" &
  pids+=($!)
done
rc=0 live=("${pids[@]}")
while [ ${#live[@]} -gt 0 ]; do
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
