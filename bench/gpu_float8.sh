#!/usr/bin/env bash
# float8 linear layers (issue 47) on one GPU of compute capability 8.9+: training quality against bf16 over 200 steps of
# real text, and the step time with compile. torchao from a carried wheel:
#   TORCHAO_WHEEL=.wheels/float8/torchao-0.18.0-....whl bash bench/gpu_float8.sh     (results under $OUT)
set -uo pipefail
OUT=${OUT:-bench-out}
mkdir -p "$OUT" /tmp/torchao-site
[ -n "${TORCHAO_WHEEL:-}" ] && python3 -m zipfile -e "$TORCHAO_WHEEL" /tmp/torchao-site
export PYTHONPATH=src:/tmp/torchao-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
train() {  # train NAME ARGS...: one single-GPU run of attnpool train into $OUT/NAME
  local name=$1; shift
  python3 -m attnpool.cli.main train --model llama3-8b --nproc 1 --attention local --no-progress \
    --checkpoint-every -1 --out "$OUT/$name" "$@" 2>&1 | grep -v "Failed to load\|KernelPreference" | tail -4
}
# quality: Llama-3-8B's layers, 4 of them, on the standard library's text (byte tokens), 200 steps of 16K tokens
for mode in bf16 tensorwise rowwise; do
  flags=(); [ "$mode" != bf16 ] && flags=(--float8 --float8-recipe "$mode")
  train "quality-$mode" --model-args n_layers=4 vocab_size=256 --data stdlib --tokens-per-rank 16K --steps 200 \
    --lr 3e-4 --warmup-steps 20 "${flags[@]}"
done
# speed: 32K tokens, 4 layers, compiled linear parts (fusing float8's casts), 8 steps
for mode in bf16 tensorwise rowwise; do
  flags=(); [ "$mode" != bf16 ] && flags=(--float8 --float8-recipe "$mode")
  train "speed-$mode" --model-args n_layers=4 --data synthetic --tokens-per-rank 32K --steps 8 --compile "${flags[@]}"
done
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
def rows(name):
    return [json.loads(line) for line in open(f"{out}/{name}/metrics.jsonl")]
base = rows("quality-bf16")
print("quality (mean loss of steps 151-200) and speed (median tokens/s of steps 4-8):")
for mode in ("bf16", "tensorwise", "rowwise"):
    q, s = rows(f"quality-{mode}"), rows(f"speed-{mode}")
    last = statistics.mean(r["loss"] for r in q[150:200])
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(q[150:200], base[150:200]))
    tps = statistics.median(r["tokens_per_s"] for r in s[3:8])
    peak = max(r["peak_memory_bytes"] for r in s) / 2**30
    print(f"  {mode:10s} loss {last:.4f}  worst step vs bf16 {worst:.4f}  {tps / 1e3:.1f}K tokens/s  peak {peak:.1f} GiB")
PY
