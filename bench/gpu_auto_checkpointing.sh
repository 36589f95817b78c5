#!/usr/bin/env bash
# activation_checkpointing auto against full (issue 47): the full 32-layer Llama-3-8B, cad+pingpong, prolong, the same
# batches, on NPROC GPUs of one host; each run's step times, losses, chosen layer modes, and predicted against
# measured peak memory. FA4 where its unpacked wheels (bench/fa4_wheels.sh) are on PYTHONPATH (KERNEL=fa4), else flash.
#   NPROC=2 TOKENS=128K bash bench/gpu_auto_checkpointing.sh full auto+compile     (results under $OUT)
# A run is a checkpointing mode, with "@H" for auto's headroom H (auto_headroom), "+compile" for compiled linear
# parts and "+float8" for float8 linear layers (torchao from TORCHAO_WHEEL, a carried wheel): auto@0.15+compile+float8.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# RUN_TIMEOUT_S bounds each run (0: none), so that a call's last runs cannot take the table with them.
OUT=${OUT:-bench-out} NPROC=${NPROC:-2} TOKENS=${TOKENS:-128K} KERNEL=${KERNEL:-flash} STEPS=${STEPS:-5}
mkdir -p "$OUT" /tmp/torchao-site
[ -n "${TORCHAO_WHEEL:-}" ] && python3 -m zipfile -e "$TORCHAO_WHEEL" /tmp/torchao-site && export PYTHONPATH=$PYTHONPATH:/tmp/torchao-site
for run in "$@"; do
  mode=${run%%+*} flags=()
  [[ "$run" == *+compile* ]] && flags+=(--compile)
  [[ "$run" == *+float8* ]] && flags+=(--float8)
  [[ "$mode" == *@* ]] && flags+=(--auto-headroom "${mode#*@}") && mode=${mode%@*}
  name="$TOKENS-$(echo "$run" | tr '+@' '-h')"  # ("+" and "@" do not survive the device's file transfer)
  timeout "${RUN_TIMEOUT_S:-0}" python3 -m attnpool.cli.main train --model llama3-8b --nproc "$NPROC" --attention cad --pingpong \
    --attention-backend "$KERNEL" --data synthetic --data-args dist=prolong --tokens-per-rank "$TOKENS" \
    --steps "$STEPS" --warmup-steps 1 --activation-checkpointing "$mode" --no-progress --checkpoint-every -1 \
    --out "$OUT/$name" "${flags[@]}" 2>&1 | grep -v "^\[rank\|Warning\|warn(" | tail -14 > "$OUT/$name.log"
done
python3 - "$OUT" "$TOKENS" "$@" <<'PY'
import json, statistics, sys
out, tokens, runs = sys.argv[1], sys.argv[2], sys.argv[3:]
loaded = {}
for run in runs:
    name = f"{tokens}-{run.replace('+', '-').replace('@', 'h')}"
    try:
        loaded[run] = ([json.loads(line) for line in open(f"{out}/{name}/metrics.jsonl")],
                       json.load(open(f"{out}/{name}/summary.json")))
    except OSError as exc:
        loaded[run] = f"no result ({exc.strerror}); see {name}.log"
# The steps after the first two; a step that compiled in any run (a new range of token counts recompiles the
# compiled parts: attnpool.parallel.compile) is left out of every run, so that all compare the same batches
measured = [r for v in loaded.values() if not isinstance(v, str) for r in v[0][2:]]
after = sorted({r["step"] for r in measured})
compiled = {r["step"] for r in measured if r.get("compile_s")}
steps = [s for s in after if s not in compiled] or after
print(f"steps {steps}" + (f" (steps {sorted(compiled)} compiled in some run: left out)" if steps != after else ""))
print(f"{'run':22s} {'step s':>7s} {'tok/s':>8s} {'MFU':>6s} {'vs first':>8s} {'peak GiB':>8s} {'pred GiB':>8s} "
      f"{'error':>6s} {'max loss diff':>13s}  layers")
base = None
for run in runs:
    if isinstance(loaded[run], str):
        print(f"{run:22s} {loaded[run]}")
        continue
    rows, summary = loaded[run]
    chosen_rows = [r for r in rows if r["step"] in steps] or rows[2:] or rows
    step = statistics.median(r["step_time_s"] for r in chosen_rows)
    mfu = statistics.median(r["mfu"] for r in chosen_rows) if chosen_rows[0].get("mfu") is not None else 0.0
    base = base or (step, [r["loss"] for r in rows])
    peak = max(r["peak_memory_bytes"] for r in rows) / 2**30
    predicted = (summary["predicted_peak_memory_bytes"] or 0) / 2**30
    loss = max(abs(r["loss"] - b) / b for r, b in zip(rows, base[1]))
    modes = summary.get("layer_checkpointing")
    chosen = ",".join(f"{modes.count(m)} {m}" for m in ("full", "keep_attention", "none") if m in modes) if modes \
        else summary["activation_checkpointing"]
    print(f"{run:22s} {step:7.2f} {rows[0]['tokens'] / step:8.0f} {mfu:6.3f} {base[0] / step:8.3f} "
          f"{peak:8.1f} {predicted:8.1f} {(predicted - peak) / peak:+6.1%} {loss:13.4f}  {chosen}"
          + (" +offload" if summary.get("activation_offload") else ""))
PY
