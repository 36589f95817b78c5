#!/usr/bin/env bash
# End-to-end benchmark runs on 2-4 GPUs (4 x H200 unless NPROC says otherwise), one phase per device call:
#   bash bench/gpu_e2e.sh PHASE [BENCH ARGS...]   (results under $OUT, or ./bench-out without it)
# Each phase stays under the 10-minute command limit through --budget-s or --end-by-s. NPROC=2 runs a phase on
# two GPUs, and NODES=N splits the GPUs into N emulated nodes (bench/torchrun_nodes.sh); extra arguments go to
# `attnpool bench` after the phase's own (the last one wins). A PYTHONPATH
# given is kept after src: FA4's unpacked wheels there (bench/fa4_wheels.sh) and `--attention-backend fa4` run the
# phase with FA4.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
bench() {  # bench NAME ARGS...: one torchrun of `attnpool bench`, its log and results kept under $OUT/NAME
  local name=$1; shift
  mkdir -p "$OUT/$name"
  bash bench/torchrun_nodes.sh -m attnpool.cli.main bench --model llama3-8b \
    --layers 4 --out "$OUT/$name" "$@" ${EXTRA[@]+"${EXTRA[@]}"} 2>&1 | grep --line-buffered -v "^\[rank" | tee "$OUT/$name/log"
}
pooled_runs() {  # pooled_runs NAME ARGS...: `attnpool bench` once per schedule of SCHEDULES (default "1f1b pooled"),
  # the pooled run with --ablation (its exchanges cut to one element: what they cost) unless ABLATION=0
  local name=$1; shift
  for schedule in ${SCHEDULES:-1f1b pooled}; do
    local ablation=()
    [ "$schedule" = pooled ] && [ "${ABLATION:-1}" = 1 ] && ablation=(--ablation)
    bench "$name-$schedule" --pp-schedule "$schedule" --strategies cad --configs pretrain:64K,prolong:64K \
      --layers 16 --microbatches 4 --warmup 1 --budget-s 300 "$@" ${ablation[@]+"${ablation[@]}"}
  done
}
probe() {  # probe NAME: the all-to-all bandwidth of the network the phase runs on, as $OUT/probe-NAME.json (a hung
  # NCCL set-up stopped after 2 minutes rather than the call's limit)
  # (--foreground: the TERM goes to the script alone, whose trap passes it on to each torchrun once; a second one
  # could stop a torchrun before it stops its workers, which would keep their GPUs)
  timeout --foreground 120 bash bench/torchrun_nodes.sh bench/a2a_probe.py --out "$OUT/probe-$1.json" || exit 3
}
probe_after() {  # probe_after NAME: the same network measured again after the phase's runs, as
  # $OUT/probe-NAME-after.json: the loopback link's rate moved between calls (2.1-6.3 GiB/s) and within them (Ulysses'
  # exchanges ran at 4.30 GiB/s in a call probed at 2.14), so a figure at the start alone does not fix a run's rate;
  # not fatal, the runs being done
  timeout --foreground 120 bash bench/torchrun_nodes.sh bench/a2a_probe.py --out "$OUT/probe-$1-after.json" ||
    echo "the probe after the runs failed (exit $?)"
}
emulated_or_stop() {  # emulated_or_stop NAME KEY: stop unless the probe's KEY (GiB/s out per rank) is a socket's, so
  # that a run NCCL kept on NVLink (its P2P, or its hosts not told apart) is never recorded as the emulated network
  "${PYTHON:-python3}" - "$OUT/probe-$1.json" "$2" <<'PY' || exit 3
import json, sys
path, key = sys.argv[1:]
value = json.load(open(path)).get(key)
if value is None or not value < 50:
    sys.exit(f"{path}: {key} {value} GiB/s: not an emulated network's (NCCL's sockets on loopback give about 5); "
             "stopped before the runs")
print(f"emulated network: {key} {value:.2f} GiB/s")
PY
}
PHASE=${1:-}
EXTRA=("${@:2}")
# (--end-by-s counts from the bench's start: 540 s less what the script has spent, the probe's included, leaves a
# 600 s call a minute for the bench's start-up and end.)
# Issue 43's rows, cad's first (what the phase is for, kept if the budget cuts the rest) and Ulysses last (the
# slowest at full depth in the simulator's predictions, 2026-11-29-cpu-sim-predictions-two-tier.md)
BASELINES=cad+pingpong,cad,local,wlb,percp,ulysses
case "$PHASE" in
  smoke)  # the sparse path once on GPUs, a few seconds of steps
    bench smoke --configs prolong:32K --strategies local+sparse,cad+sparse --warmup 1 --steps 1 --budget-s 60 \
      --sparse-args min_doc_len=4096,slash_cap=192,vertical_cap=1024 ;;
  baselines)  # issue 43: every baseline beside cad, the network's all-to-all bandwidth measured first
    probe nvlink
    bench baselines --configs prolong:128K --strategies $BASELINES --warmup 2 --steps 4 --end-by-s $((540 - SECONDS)) ;;
  baselines-emulated)  # the same over NCCL's socket transport on loopback (../shared/recipes/emulated-inter-node.md)
    export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_NSOCKS_PERTHREAD=4 \
      NCCL_SOCKET_NTHREADS=4
    probe emulated
    emulated_or_stop emulated GiBps_out_per_rank
    bench baselines-emulated --configs prolong:128K --strategies $BASELINES --warmup 2 --steps 4 --end-by-s $((540 - SECONDS))
    probe_after emulated ;;
  copies)  # where cad's and Ulysses' core attention spend their time: one traced step each (4 layers, prolong 128K,
    # full checkpointing), broken down by phase on the device (bench/trace_breakdown.py) and the traces dropped, so that
    # the call's few returned files hold the tables (2026-11-29-h200x2-cad-copies.md)
    bench copies --configs prolong:128K --strategies ulysses,cad --trace ulysses,cad --activation-checkpointing full \
      --warmup 1 --steps 2 --budget-s 300
    for trace in "$OUT"/copies/trace-*.json.gz; do
      echo "$trace"
      "${PYTHON:-python3}" bench/trace_breakdown.py "$trace" --json "${trace%.json.gz}-breakdown.json" && rm "$trace"
    done ;;
  emulated-trace)  # core attention's exchanges beside FSDP's collectives on the emulated network: one traced step
    # each of local, local over the balanced layout, wlb and cad (4 layers, prolong 128K, full checkpointing); it found
    # the exchanges queued behind FSDP's on a shared communicator (2026-11-30-h200x2-attention-communicator.md)
    # (KEEP_TRACES=1 keeps the traces beside their breakdowns)
    export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_NSOCKS_PERTHREAD=4 \
      NCCL_SOCKET_NTHREADS=4
    probe emulated
    emulated_or_stop emulated GiBps_out_per_rank
    bench emulated-trace --configs prolong:128K --strategies local,local+balanced,wlb,cad \
      --trace local,local+balanced,wlb,cad --activation-checkpointing full --warmup 1 --steps 2 --budget-s 360
    for trace in "$OUT"/emulated-trace/trace-*.json.gz; do
      echo "$trace"
      "${PYTHON:-python3}" bench/trace_breakdown.py "$trace" --json "${trace%.json.gz}-breakdown.json" &&
        [ "${KEEP_TRACES:-0}" = 0 ] && rm "$trace"
    done ;;
  pretrain-trace|pretrain-trace-nvlink)  # why cad+pingpong trails the best baseline at pretrain 256K on 2 GPUs (runs
    # 43, 46 and 54 of 2026-11-29-h200x2-full-depth-baselines.md): on the emulated network wlb (107.6 GiB a step a GPU
    # against 39.2, the simulator 9% low for cad+pingpong), on NVLink Ulysses (0.975x, the simulator a tie). One
    # traced step each on the stream's batch 3, 4 layers, four groups of heads on the emulated network, full
    # checkpointing and offload as those runs, broken down by phase (each exchange's time and the time it ran beside
    # another collective); KEEP_TRACES=1 keeps them. (--trace profiles the two steps after the measured ones, the
    # second recorded: with one measured step and no warm-up, batch 1 is measured, batch 2, one 524,288-token
    # document, warms the profiler up, and batch 3 is traced.)
    if [ "$PHASE" = pretrain-trace ]; then
      export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo NCCL_NSOCKS_PERTHREAD=4 \
        NCCL_SOCKET_NTHREADS=4
      network=emulated traced=cad+pingpong,wlb chunks=4
      probe emulated
      emulated_or_stop emulated GiBps_out_per_rank
    else
      network=nvlink traced=cad+pingpong,ulysses chunks=1
      probe nvlink
    fi
    bench "$PHASE" --configs pretrain:256K --strategies $traced --trace $traced --trace-ranks all --activation-checkpointing full \
      --activation-offload --head-chunks $chunks --warmup 0 --steps 1 --end-by-s $((480 - SECONDS))
    for trace in "$OUT/$PHASE"/trace-*.json.gz; do
      [ -e "$trace" ] || continue
      echo "$trace"
      "${PYTHON:-python3}" bench/trace_breakdown.py "$trace" --json "${trace%.json.gz}-breakdown.json" &&
        [ "${KEEP_TRACES:-0}" = 0 ] && rm "$trace"
    done
    if [ "$network" = emulated ]; then probe_after emulated; fi ;;
  two-tier|two-tier-hierarchical)  # issue 43: NODES (default 2) emulated nodes on this host (bench/torchrun_nodes.sh):
    # NVLink inside a node, NCCL's socket transport over loopback between them; every baseline, or cad with the
    # hierarchical exchange (a phase each: each fits a call), the network's tiers measured first
    export NODES=${NODES:-2} NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=4
    probe "$PHASE"
    emulated_or_stop "$PHASE" inter_node_GiBps_out_per_rank
    if [ "$PHASE" = two-tier ]; then
      bench two-tier --configs prolong:128K --strategies $BASELINES --warmup 2 --steps 4 --end-by-s $((540 - SECONDS))
    else
      bench two-tier-hierarchical --configs prolong:128K --strategies cad,cad+pingpong --hierarchical-exchange \
        --warmup 2 --steps 4 --end-by-s $((540 - SECONDS))
    fi
    probe_after "$PHASE" ;;
  windows)  # issue 42: a Gemma-3-like model (five layers of a 1K-key sliding window to one global), cad against
    # local, and the same depth with every layer causal
    bench windows --layers 6 --sliding-window 1024 --layer-types 5/1 --configs prolong:128K \
      --strategies local,cad,cad+pingpong --warmup 2 --steps 4 --budget-s 330
    bench windows-causal --layers 6 --configs prolong:128K --strategies local,cad --warmup 2 --steps 4 --budget-s 200 ;;
  prolong128)  # issue 6's headline configuration, every strategy, the overlap ablation, one profiled step
    bench prolong128 --configs prolong:128K --warmup 3 --steps 10 --ablation --trace cad+pingpong --budget-s 450 ;;
  prolong256)  # issue 8's end-to-end sparse run, next to dense cad and local
    bench prolong256 --configs prolong:256K --strategies cad+sparse,local+sparse,cad+pingpong,local \
      --sparse-args slash_cap=192,vertical_cap=1024 \
      --warmup 2 --steps 5 --trace cad+sparse --budget-s 420 ;;
  pretrain64)
    bench pretrain64 --configs pretrain:64K --warmup 3 --steps 10 --trace cad+pingpong --budget-s 430 ;;
  pretrain64-memory)  # peak memory of cad against local (+4.4%; add --memory-breakdown for what is live at the peak)
    bench pretrain64-memory --configs pretrain:64K --strategies local,cad,cad+pingpong --warmup 3 --steps 10 \
      --budget-s 300 ;;
  # The rest of issue 6's matrix, each phase sized to fit one 10-minute call.
  prolong64)
    bench prolong64 --configs prolong:64K --warmup 3 --steps 10 --budget-s 450 ;;
  pretrain128)  # local alone takes 5 minutes here (21 s steps): the baselines need a call of their own
    bench pretrain128 --configs pretrain:128K --strategies local,cad+pingpong --warmup 3 --steps 10 --budget-s 330 ;;
  pretrain128-baselines)
    bench pretrain128-baselines --configs pretrain:128K --strategies cad+pingpong,percp,wlb --warmup 3 --steps 10 \
      --budget-s 330 ;;
  pretrain256)  # local alone: 397 s of one call (its two steps with the 857K-token document take 50 and 140 s)
    bench pretrain256 --configs pretrain:256K --strategies local --warmup 3 --steps 10 ;;
  pretrain256-baselines)
    bench pretrain256-baselines --configs pretrain:256K --strategies cad+pingpong,percp --warmup 3 --steps 10 \
      --budget-s 300 ;;
  prolong256-baselines)  # 256K at the full 3 + 10 steps, with the baselines the first 256K run lacked
    bench prolong256-baselines --configs prolong:256K --strategies local,wlb,percp,cad+pingpong --warmup 3 \
      --steps 10 --budget-s 520 ;;
  prolong256-sparse-pingpong)  # sparse exchanges on their own communicator under ping-pong, and kv_transfer=read
    bench prolong256-sparse-pingpong --configs prolong:256K --strategies cad+sparse,cad+pingpong+sparse,cad+sparse+readkv \
      --sparse-args slash_cap=192,vertical_cap=1024 --warmup 2 --steps 5 --budget-s 420 ;;
  # Issue 27: the full 32-layer model, with the memory setting `attnpool memory` picks for every strategy
  # (at 128K, keep_attention fits local only with activation offload of ~115 GiB host memory per rank; full
  # recompute fits all of them on the GPUs alone).
  full-depth128)
    bench full-depth128 --layers 32 --configs prolong:128K --strategies local,cad+pingpong --warmup 1 --steps 3 \
      --activation-checkpointing full --budget-s 300 ;;
  full-depth256)
    bench full-depth256 --layers 32 --configs prolong:256K --strategies cad+pingpong,local --warmup 1 --steps 2 \
      --activation-checkpointing full --activation-offload --budget-s 200 ;;
  # Left from issue 27's second session: pretrain 128K at full depth ran past a 540 s call with both strategies
  # (its documents span the whole step), so one strategy per call; WLB and per-document CP at 256K.
  full-depth128-pretrain-cad)
    bench full-depth128-pretrain-cad --layers 32 --configs pretrain:128K --strategies cad+pingpong --warmup 1 \
      --steps 2 --activation-checkpointing full ;;
  full-depth128-pretrain-local)
    bench full-depth128-pretrain-local --layers 32 --configs pretrain:128K --strategies local --warmup 1 --steps 2 \
      --activation-checkpointing full ;;
  full-depth256-baselines)
    bench full-depth256-baselines --layers 32 --configs prolong:256K --strategies wlb,percp --warmup 1 --steps 2 \
      --activation-checkpointing full --activation-offload --budget-s 280 ;;
  # Issue 45: sparse against dense cad at full depth, 256K tokens per GPU (512K does not fit: with full checkpointing
  # and offload `attnpool memory` gives 481K at most, sparse or not).
  full-depth256-sparse)
    bench full-depth256-sparse --layers 32 --configs prolong:256K --strategies cad+pingpong,cad+sparse \
      --sparse-args slash_cap=192,vertical_cap=1024 --activation-checkpointing full --activation-offload \
      --warmup 1 --steps 2 --budget-s 520 ;;
  # Issue 28's speed runs: llama-34b with 8 of its 48 layers, tokens per dp rank, tp=4 against
  # pp=2 x tp=2 (both dp=1, so local only) and dp=4 (cad against local); then the full 8B, tp=2 x dp=2
  # against dp=4 at 256K tokens per GPU. --configs tokens are per GPU: a dp rank holds tp x them (64K and
  # 128K per dp rank throughout). tp=4 at 64K ran 3.5x the simulator's step (2026-11-26-h200x4-parallel):
  # its phase keeps a profiled step to show where the time goes.
  parallel34b-tp4)
    bench parallel34b-tp4 --model llama-34b --layers 8 --tp 4 --configs prolong:16K,prolong:32K --strategies local --trace local \
      --warmup 2 --steps 5 --budget-s 300 ;;
  parallel34b-pp2tp2)
    bench parallel34b-pp2tp2 --model llama-34b --layers 8 --pp 2 --tp 2 --microbatches 2 \
      --configs prolong:32K,prolong:64K --strategies local --warmup 2 --steps 5 --budget-s 300 ;;
  parallel34b-dp4)
    bench parallel34b-dp4 --model llama-34b --layers 8 --configs prolong:64K,prolong:128K \
      --strategies local,cad+pingpong --warmup 2 --steps 5 --budget-s 300 ;;
  parallel8b-tp2)
    bench parallel8b-tp2 --layers 32 --tp 2 --configs prolong:256K --strategies local,cad+pingpong --warmup 1 \
      --steps 3 --activation-checkpointing full --activation-offload --budget-s 300 ;;
  # Issue 22's bubble reuse against torch's 1F1B: pp=2 x dp=2, 8 layers, 4 micro-batches, cad; the same batches.
  pooled-pp2)
    for schedule in 1f1b pooled; do
      bench "pooled-pp2-$schedule" --layers 8 --pp 2 --microbatches 4 --pp-schedule "$schedule" \
        --configs prolong:64K,pretrain:64K --strategies cad,local --warmup 2 --steps 5 --budget-s 240
    done ;;
  # Issue 44: pooled against 1F1B, 16 layers, 64K tokens per dp rank, cad, the same batches; pretrain's long documents
  # (the simulator predicts pooled faster) and prolong's (slower). pp_schedule auto's choice for each is the
  # simulator's on these batches: bench/sim_pooled_validation.py gives it beside the measured steps.
  # SCHEDULES and ABLATION: pooled_runs above.
  pooled-pp4) pooled_runs pooled-pp4 --pp 4 --steps 3 ;;
  pooled-pp2dp2) pooled_runs pooled-pp2dp2 --pp 2 --configs prolong:64K,pretrain:64K --steps 2 ;;
  *) phases="smoke|baselines|baselines-emulated|copies|emulated-trace|pretrain-trace|pretrain-trace-nvlink|two-tier|two-tier-hierarchical|windows|prolong128|prolong256|pretrain64"
     phases="$phases|pretrain64-memory|prolong64|pretrain128|pretrain128-baselines|pretrain256|pretrain256-baselines"
     echo "usage: bash bench/gpu_e2e.sh $phases|prolong256-baselines|prolong256-sparse-pingpong|full-depth128|full-depth256|full-depth128-pretrain-cad|full-depth128-pretrain-local|full-depth256-baselines|full-depth256-sparse|parallel34b-tp4|parallel34b-pp2tp2|parallel34b-dp4|parallel8b-tp2|pooled-pp2|pooled-pp4|pooled-pp2dp2 [BENCH ARGS...]" >&2
     exit 2 ;;
esac
