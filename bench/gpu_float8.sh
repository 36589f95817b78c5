#!/usr/bin/env bash
# float8 linear layers (issue 47) on one GPU of compute capability 8.9+: training quality against bf16 over 200 steps of
# real text, and the step time with compile. torchao from a carried wheel:
#   TORCHAO_WHEEL=.wheels/float8/torchao-0.18.0-....whl bash bench/gpu_float8.sh
# Every run's per-step metrics and log's end in $OUT/float8.json; the runs' own directories under $RUNS.
# Settings (environment):
#   QUALITY="bf16:0 tensorwise:0 rowwise:0"   the quality runs, MODE:SEED each; a pair named twice runs twice.
#                                             Runs differing only in rounding end ~2% apart over 600 steps
#                                             (bench/results/2026-11-29-h200-float8-noise-floor.md): name each
#                                             pair several times and read the means the summary prints
#   DETERMINISTIC=1                           the quality runs with --deterministic (a run repeats bit for bit)
#   PARALLEL=1                                quality runs at once on the GPU (each holds about 16 GiB)
#   SPEED=1                                   0 leaves out the speed runs
#   LR=3e-4 STEPS=200                         the quality runs' peak learning rate and steps
#   DEADLINE_S=                               seconds after which the quality runs are stopped by SIGTERM (each
#                                             checkpoints) and no more start; run the script again with the same
#                                             RUNS to resume them (a run already at STEPS is skipped)
set -uo pipefail
OUT=${OUT:-bench-out}
RUNS=${RUNS:-/tmp/float8-runs}
QUALITY=${QUALITY:-"bf16:0 tensorwise:0 rowwise:0"}
DETERMINISTIC=${DETERMINISTIC:-0}
PARALLEL=${PARALLEL:-1}
SPEED=${SPEED:-1}
LR=${LR:-3e-4}
export STEPS=${STEPS:-200}  # (the summary reads it)
DEADLINE_S=${DEADLINE_S:-}
mkdir -p "$OUT" "$RUNS" /tmp/torchao-site
[ -n "${TORCHAO_WHEEL:-}" ] && python3 -m zipfile -e "$TORCHAO_WHEEL" /tmp/torchao-site
export PYTHONPATH=src:/tmp/torchao-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
train() {  # train NAME ARGS...: one single-GPU run of attnpool train into $RUNS/NAME, its output in $RUNS/NAME.log
  local name=$1; shift
  python3 -m attnpool.cli.main train --model llama3-8b --nproc 1 --attention local --no-progress \
    --checkpoint-every -1 --out "$RUNS/$name" "$@" 2>&1 | grep -v "Failed to load\|KernelPreference" > "$RUNS/$name.log"
}
recipe_flags() {  # the flags of linear-layer mode $1: bf16, tensorwise or rowwise
  [ "$1" != bf16 ] && echo --float8 --float8-recipe "$1"
}
# quality: Llama-3-8B's layers, 4 of them, on the standard library's text (byte tokens), 200 steps of 16K tokens
done_steps() {  # the steps run $1 has logged
  if [ -f "$RUNS/$1/metrics.jsonl" ]; then grep -c '"step"' "$RUNS/$1/metrics.jsonl"; else echo 0; fi
}
running() {  # how many of the processes $@ are still running
  local n=0 pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && n=$((n + 1)); done
  echo "$n"
}
rm -f "$RUNS/.deadline"
watcher=
if [ -n "$DEADLINE_S" ]; then  # at the deadline: no new run, and SIGTERM to those running (they checkpoint)
  ( sleep "$DEADLINE_S"; touch "$RUNS/.deadline"; pkill -TERM -f "[a]ttnpool.cli.main train .*--out $RUNS/" ) &
  watcher=$!
fi
names=() pids=()
for run in $QUALITY; do
  mode=${run%%:*} seed=${run##*:} name="quality-${run%%:*}-s${run##*:}"
  while [[ " ${names[*]} " == *" $name "* ]]; do name="$name-again"; done  # a repeat of the same run
  names+=("$name")
  extra=(); [ "$DETERMINISTIC" = 1 ] && extra=(--deterministic)
  if [ -n "$DEADLINE_S" ]; then
    [ -f "$RUNS/.deadline" ] && continue
    [ "$(done_steps "$name")" -ge "$STEPS" ] && continue
    extra+=(--checkpoint-every 0 --keep-checkpoints 1)  # (replaces -1: a checkpoint at the end or on SIGTERM)
    if compgen -G "$RUNS/$name/checkpoints/step-*" > /dev/null; then
      extra+=(--resume)
    elif [ -e "$RUNS/$name/metrics.jsonl" ]; then  # stopped before its first checkpoint: from the start again
      extra+=(--overwrite)
    fi
  fi
  train "$name" --model-args n_layers=4 vocab_size=256 --data stdlib --tokens-per-rank 16K --steps "$STEPS" \
    --lr "$LR" --warmup-steps 20 --seed "$seed" $(recipe_flags "$mode") "${extra[@]}" &
  pids+=($!)
  while [ "$(running "${pids[@]}")" -ge "$PARALLEL" ]; do wait -n; done
done
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"  # every run, one stopped at the deadline until it has checkpointed
[ -n "$watcher" ] && kill "$watcher" 2>/dev/null
[ -f "$RUNS/.deadline" ] && SPEED=0  # (no time left for them)
# speed: 32K tokens, 4 layers, compiled linear parts (fusing float8's casts), 8 steps
if [ "$SPEED" = 1 ]; then
  for mode in bf16 tensorwise rowwise; do
    train "speed-$mode" --model-args n_layers=4 --data synthetic --tokens-per-rank 32K --steps 8 --compile \
      $(recipe_flags "$mode")
  done
fi
python3 - "$OUT" "$RUNS" "${names[@]}" <<'PY'
import json, os, statistics, sys
out, runs, names = sys.argv[1], sys.argv[2], sys.argv[3:]
KEPT = ("step", "loss", "grad_norm", "step_time_s", "tokens_per_s", "peak_memory_bytes")
def rows(name):
    path = f"{runs}/{name}/metrics.jsonl"
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []
everything = {}
for name in names + [f"speed-{mode}" for mode in ("bf16", "tensorwise", "rowwise")]:
    if os.path.exists(f"{runs}/{name}.log"):
        everything[name] = {"rows": [{k: r.get(k) for k in KEPT} for r in rows(name)],
                            "log_tail": open(f"{runs}/{name}.log").read().splitlines()[-12:]}
json.dump(everything, open(f"{out}/float8.json", "w"), indent=1)
print("quality: mean loss of the last 50 steps, against the first bf16 run of the same seed")
first = {}
for name in names:
    mode, seed = name.split("-")[1], name.split("-")[2]
    q = rows(name)
    if len(q) < 50 or len(q) < int(os.environ.get("STEPS", "200")):
        print(f"  {name:24s} {len(q)} steps: {everything.get(name, {}).get('log_tail', ['not started'])[-1:]}")
        continue
    base = first.setdefault((seed, "bf16"), q) if mode == "bf16" else first.get((seed, "bf16"))
    same = first.setdefault((seed, mode), q)
    last = statistics.mean(r["loss"] for r in q[-50:])
    line = f"  {name:24s} loss {last:.4f}"
    if base is not None and base is not q:
        mean_base = statistics.mean(r["loss"] for r in base[-50:])
        worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(q[-50:], base[-50:]))
        line += f"  vs bf16 {last / mean_base - 1:+.4f}  worst step {worst:.4f}"
    if same is not q:
        line += f"  bitwise as its first run: {[r['loss'] for r in q] == [r['loss'] for r in same]}"
    steps = sorted(r["step_time_s"] for r in q[10:])
    print(line + f"  step {steps[len(steps) // 2]:.3f} s  peak {max(r['peak_memory_bytes'] for r in q) / 2**30:.1f} GiB")
by_mode = {}  # (seed, mode) -> the last 50 steps' mean loss of each complete run
for name in names:
    q = rows(name)
    if len(q) >= max(50, int(os.environ.get("STEPS", "200"))):
        by_mode.setdefault((name.split("-")[2], name.split("-")[1]), []).append(statistics.mean(r["loss"] for r in q[-50:]))
for (seed, mode), losses in by_mode.items():
    base = by_mode.get((seed, "bf16"))
    if len(losses) > 1 or (base and len(base) > 1):
        line = f"  mean of {len(losses)} {mode}-{seed} runs: {statistics.mean(losses):.4f} (runs {min(losses):.4f} to {max(losses):.4f})"
        if base and mode != "bf16":
            line += f"  vs the mean of {len(base)} bf16 runs {statistics.mean(losses) / statistics.mean(base) - 1:+.4f}"
        print(line)
if rows("speed-bf16"):
    print("speed (median tokens/s of steps 4-8):")
    for mode in ("bf16", "tensorwise", "rowwise"):
        s = rows(f"speed-{mode}")
        tps = statistics.median(r["tokens_per_s"] for r in s[3:8])
        peak = max(r["peak_memory_bytes"] for r in s) / 2**30
        print(f"  {mode:10s} {tps / 1e3:.1f}K tokens/s  peak {peak:.1f} GiB")
PY
