#!/usr/bin/env bash
# float8 beside FSDP2's float8 all-gather and tensor parallelism (issue 47) on 2 GPUs of compute capability 8.9+:
# that each runs on NCCL, and its per-step losses. 4 layers of Llama-3-8B, cad, 16K synthetic tokens per GPU,
# 4 steps, --deterministic. torchao from a carried wheel:
#   TORCHAO_WHEEL=.wheels/float8/torchao-0.18.0-....whl bash bench/gpu_float8_parallel.sh
set -uo pipefail
RUNS=${RUNS:-/tmp/float8-parallel}
mkdir -p "$RUNS" /tmp/torchao-site
[ -n "${TORCHAO_WHEEL:-}" ] && python3 -m zipfile -e "$TORCHAO_WHEEL" /tmp/torchao-site
export PYTHONPATH=src:/tmp/torchao-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
  TORCH_SYMM_MEM_DISABLE_MULTICAST=1
run() {  # run NAME ARGS...: one 2-GPU run, its exit status and per-step losses and times
  local name=$1; shift
  timeout 65 python3 -m attnpool.cli.main train --model llama3-8b --model-args n_layers=4 --nproc 2 --attention cad \
    --data synthetic --tokens-per-rank 16K --steps 4 --warmup-steps 1 --no-progress --checkpoint-every -1 \
    --deterministic --out "$RUNS/$name" "$@" > "$RUNS/$name.log" 2>&1
  echo "$name rc=$?"
  python3 - "$RUNS/$name/metrics.jsonl" <<'PY'
import json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
    print("  losses", [round(r["loss"], 5) for r in rows], "step s", [round(r["step_time_s"], 2) for r in rows])
except OSError as error:
    print("  no metrics:", error)
PY
  grep -v "Failed to load\|KernelPreference\|pytree" "$RUNS/$name.log" | grep -i "error\|Traceback" | head -3
}
run f8-dp2 --float8
run f8-allgather-dp2 --float8 --float8-all-gather
run f8-tp2 --float8 --tp 2
