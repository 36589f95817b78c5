"""End-to-end benchmark: full training steps of every strategy on the same batches, on the GPUs at hand.

Run under torchrun, one process per GPU::

    torchrun --nproc-per-node 4 -m attnpool.cli.main bench --out DIR

For each configuration (length distribution x tokens per GPU) and each strategy
(`local`, `wlb`, `percp`, `cad` without overlap, `cad` with ping-pong) it trains
the same model from the same seed on the same batches (forward, backward,
optimizer) and reports, over the measured steps: median step time, tokens/s,
model FLOPs utilisation, attention imbalance, bytes sent per GPU, peak memory per
GPU, and efficiency = ideal / measured, where the ideal is the step's FLOPs at
the measured single-GPU rates of the shipped profile (linear layers and
whole-document attention), evenly shared; efficiency with recompute counts in the
ideal the forward work the checkpointing mode repeats (with ``full``, a quarter
of the step: efficiency alone cannot pass ~0.75 there). The overlap ablation runs `cad` with
ping-pong (without it where the run is pipelined: ping-pong does not run there) and one-element messages, so
that the step it saves is what the core attention exchange's bytes cost. The bf16 losses of every strategy are
checked against `local` over the first steps (those of the ``+sparse``
strategies, which train with vertical-slash sparse attention, against
``local+sparse``). ``--trace`` profiles two extra steps of each strategy it names.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time
from importlib import resources

import torch
import torch.distributed as dist

from attnpool.bench.e2e_options import BALANCED, DEFAULT_STRATEGIES, STRATEGIES, strategy_settings
from attnpool.bench.memory import MemoryRecorder, breakdown_markdown
from attnpool.comm import process_group
from attnpool.comm.all_to_all import tiny_messages
from attnpool.data.lengths import DISTRIBUTIONS
from attnpool.errors import ConfigError, TrainingError
from attnpool.kernels.sparse import device_problem as sparse_device_problem
from attnpool.model import model_config
from attnpool.plan import KV_EXCHANGING, head_chunks_problem
from attnpool.train.sections import link_rate_problem
from attnpool.plan.ulysses import ulysses_problem
from attnpool.sizes import parse_size
from attnpool.train.config import TrainConfig
from attnpool.train.flops import linear_weights
from attnpool.train.metrics import SPARSE_IMBALANCES, attention_time
from attnpool.train.launch import quiet_warnings, use_growable_segments
from attnpool.train.loop import train
from attnpool.train.memory import auto_choice
from attnpool.train.spec import attention_backend
from attnpool.train.offload import release_host_cache

FIRST_STEP_MARK = "*"  # marks a peak memory taken from a run's first step alone
TRACE_STEPS = 2  # profiled after the measured steps: one warm-up step of the profiler, one recorded
LOSS_TOLERANCE = 0.02
# Another process's memory on a GPU at start: a benchmark's timings and peaks would be another run's too.
# (A CUDA context and NCCL's buffers of this process stay well under it.)
FOREIGN_GPU_MEMORY_LIMIT = 4 * 2**30
IDLE_GPU_POLLS, IDLE_GPU_POLL_S = 24, 5.0


CHECKPOINTING_TEXT = {"keep_attention": "of the linear parts", "full": "of whole layers", "none": "off",
                      "auto": "per layer as the memory model chose (each record's layer_checkpointing)"}
# Per checkpointing mode, the share of (linear, attention) forward+backward time that recomputation adds: a
# forward is 1/3 of a linear layer's forward+backward (2 of 6 FLOPs per weight and token) and 1/3.5 of causal
# attention's (FlashAttention's backward does 2.5 forwards' FLOPs).
RECOMPUTED_SHARE = {"none": (0.0, 0.0), "keep_attention": (1 / 3, 0.0), "full": (1 / 3, 1 / 3.5)}



def linear_s_per_token(cfg) -> float:
    """Forward+backward time per token of every linear layer and the head on one GPU, from the shipped
    profile (measured on Llama-3-8B's shapes; other shapes scale by FLOPs)."""
    prof = json.loads(resources.files("attnpool.resources").joinpath("cost_h200.json").read_text())
    lin = prof["linear"]["models"]["llama3-8b"]
    ref = model_config("llama3-8b")
    layers = cfg.n_layers * lin["fwd_bwd_s_per_token"] * linear_weights(cfg) / linear_weights(ref)
    head = lin["head_fwd_bwd_s_per_token"] * (cfg.dim * cfg.vocab_size) / (ref.dim * ref.vocab_size)
    return layers + head


def model_fields(args) -> dict:
    """The model preset's fields the arguments change: its depth, and its layers' attention kinds."""
    fields = {"n_layers": args.layers}
    if args.sliding_window is not None:
        fields.update(sliding_window=args.sliding_window, layer_types=args.layer_types)
    return fields


def relays_kv(name, args) -> bool:
    """Whether strategy ``name`` runs with the hierarchical exchange: --hierarchical-exchange, where its plans send
    KV rows (ulysses's run without it)."""
    return args.hierarchical_exchange and strategy_settings(name)[0] in KV_EXCHANGING


def head_chunks(name, args) -> int:
    """Core attention's head groups for strategy ``name``: --head-chunks where its exchanges run through it and it
    is dense (attnpool train refuses them with ulysses, whose exchange is its own, and sparse attention), else 1."""
    attention, _, kv_transfer, _ = strategy_settings(name)
    return args.head_chunks if attention in KV_EXCHANGING and kv_transfer is None else 1


def traced_ranks(text: str, world: int) -> set[int]:
    """The ranks ``--trace-ranks`` names ("all" or comma-separated rank numbers) among ``world``."""
    if text == "all":
        return set(range(world))
    try:
        ranks = {int(item) for item in text.split(",")}
    except ValueError:
        ranks = None
    if not ranks or any(not 0 <= r < world for r in ranks):
        raise ConfigError("--trace-ranks", text, f"name ranks among 0..{world - 1}, comma-separated, or all")
    return ranks


def traced_strategies(args) -> list[str]:
    """The strategies ``--trace`` names (a comma-separated list; none without it)."""
    return [s for s in (args.trace or "").split(",") if s]


def run_one(name, dist_name, tokens, args, out_dir, trace=False):
    attention, pingpong, kv_transfer, layout = strategy_settings(name)
    sparse = {}
    if kv_transfer is not None:
        sparse = sparse_options(args.sparse_args)
        sparse["sparse_args"]["kv_transfer"] = kv_transfer
    elongate = {"dist": dist_name}
    if dist_name == "pretrain":  # the paper elongates pretrain lengths to reach the context
        # (a micro-batch's global batch: every GPU's tokens, a pipeline's stages sharing theirs)
        elongate["options"] = {"elongate": max(1.0, tokens * dist.get_world_size() / args.pp / 65536)}

    def run_config(tokens_per_gpu: int, stop_at: int | None, tag: str) -> TrainConfig:
        return TrainConfig(
            model=args.model, model_args=model_fields(args), data="synthetic", data_args=elongate,
            # Every run's schedule is as long as a traced run's, so that tracing changes no learning rate;
            # the others stop before the traced steps.
            tokens_per_rank=tokens_per_gpu * args.tp, tp=args.tp, pp=args.pp, pp_schedule=args.pp_schedule,
            microbatches=args.microbatches, steps=args.warmup + args.steps + TRACE_STEPS,
            stop_at=stop_at, warmup_steps=2, lr=1e-4, seed=0,
            attention=attention, layout=layout, pingpong=pingpong, **sparse, hierarchical_exchange=relays_kv(name, args),
            head_chunks=head_chunks(name, args), exchange_gibps=args.exchange_gibps if attention == "cad" else None,
            inter_node_gibps=args.inter_node_gibps if attention == "cad" else None,
            activation_checkpointing=args.activation_checkpointing, activation_offload=args.activation_offload,
            precision="bf16", attention_backend=args.attention_backend,
            device=args.device, progress=False, checkpoint_every=-1,
            out=os.path.join(out_dir, f"{dist_name}-{tokens}-{name}{tag}"))

    warmup_rows, measured_skip = [], 0
    if args.warmup_tokens is not None:  # (check_arguments refuses it without warm-up steps)
        # The warm-up steps on small batches, in a run of their own in these processes (the kernels they compile
        # stay compiled); the measured run then starts at the batches a run warmed up on its own would measure.
        warmup_rows = train(run_config(args.warmup_tokens, args.warmup, "-warmup")).rows
        measured_skip = args.warmup
        gc.collect()  # (its model and optimizer, before the measured run's are built)
        if args.device == "cuda":
            torch.cuda.empty_cache()
            release_host_cache()  # (its offload's pinned pieces, sized for the small batches)
    steps_before_trace = args.warmup + args.steps - measured_skip
    config = run_config(tokens, steps_before_trace + (TRACE_STEPS if trace else 0), "")
    if not trace:
        rows, predicted, settings = _with_prediction(train(config, skip_steps=measured_skip), config)
        return warmup_rows + rows, predicted, settings
    tag = f"{dist_name}-{tokens // 1024}K-{name}".replace("+", "_")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if args.device == "cuda" else [])
    schedule = torch.profiler.schedule(skip_first=steps_before_trace, wait=0, warmup=1, active=1, repeat=1)
    with torch.profiler.profile(activities=activities, schedule=schedule,
                                on_trace_ready=functools.partial(_write_trace, args.out, tag, args.device,
                                                                 traced_ranks(args.trace_ranks, dist.get_world_size()))
                                ) as prof:
        rows, predicted, settings = _with_prediction(train(config, on_step=prof.step, skip_steps=measured_skip),
                                                     config)
    return warmup_rows + rows[:steps_before_trace], predicted, settings


def _with_prediction(result, config: TrainConfig) -> tuple[list, int | None, dict]:
    """The run's rows, the memory model's allocated peak of its busiest rank (None where unchecked), and its settings
    as it ran where auto chooses them (each layer's checkpointing mode, activation offload, the pipeline schedule)
    or the strategy does (core attention's head groups)."""
    predicted = [None] * dist.get_world_size()
    dist.all_gather_object(predicted, result.memory.allocated_bytes if result.memory else None)
    return (result.rows, max((p for p in predicted if p is not None), default=None),
            {"layer_checkpointing": result.layer_checkpointing, "activation_offload": result.activation_offload,
             "pp_schedule": result.pp_schedule, "pp_schedule_choice": result.pp_schedule_choice,
             # the links' rates as planned with (measured at the run's start where auto)
             "head_chunks": config.attention.head_chunks, **result.link_rates})


def sparse_options(text: str) -> dict:
    """TrainConfig fields of ``--sparse-args`` ("coverage=0.9,slash_cap=64"), with vertical-slash turned on."""
    options = {"sparse": "vertical-slash", "sparse_args": {}}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("--sparse-args", item, "expected key=value")
        if key in ("coverage", "min_doc_len"):
            options[f"sparse_{key}"] = value
        else:
            options["sparse_args"][key] = value
    return options


def _write_trace(out, tag, device, ranks: set[int], prof):
    """Each of ``ranks``: the profiled step's ops by GPU (or CPU) time, and the trace itself, gzipped (rank 0's as
    trace-TAG, each other's as trace-TAG-rankN)."""
    rank = dist.get_rank()
    if rank not in ranks:
        return
    tag = tag if rank == 0 else f"{tag}-rank{rank}"
    os.makedirs(out, exist_ok=True)
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    with open(os.path.join(out, f"trace-{tag}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=60))
    path = os.path.join(out, f"trace-{tag}.json")
    prof.export_chrome_trace(path)
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)


def summarize(name, dist_name, tokens, rows, args, world, cfg, as_run: dict):
    measured = rows[args.warmup:]
    # (the measured run's steps count from 1, skipped batches or not; a first step the optimizer skipped, a loss not
    # finite, would leave the state to step 2, which the benchmark's synthetic batches do not)
    steady = [r for r in measured if r["step"] > 1]
    step = statistics.median(r["step_time_s"] for r in measured)
    global_tokens = measured[0]["tokens"]  # (--warmup-tokens: the warm-up steps' are fewer)
    linear_s = global_tokens * linear_s_per_token(cfg) / world
    # (the plan's loads are one tp rank's: its share of the heads)
    attention_s = statistics.median(r["attention_work_total"] for r in measured) * cfg.n_layers * args.tp / world
    modes, offload = as_run["layer_checkpointing"], as_run["activation_offload"]  # (auto's choice differs by layer)
    linear_again, attention_again = (statistics.mean(RECOMPUTED_SHARE[mode][i] for mode in modes) for i in (0, 1))
    rec = {
        "strategy": name, "dist": dist_name, "tokens_per_gpu": tokens, "gpus": world, "tp": args.tp, "pp": args.pp,
        "microbatches": args.microbatches, "hierarchical_exchange": relays_kv(name, args),
        "head_chunks": as_run["head_chunks"], "exchange_gibps": as_run["exchange_gibps"],
        "exchange_gibps_measured": as_run["exchange_gibps_measured"],
        "inter_node_gibps": as_run["inter_node_gibps"],
        "inter_node_gibps_measured": as_run["inter_node_gibps_measured"],
        "pp_schedule": as_run["pp_schedule"],
        "pp_schedule_choice": as_run["pp_schedule_choice"],
        "step_time_s": step, "step_times_s": [r["step_time_s"] for r in measured],
        "total_time_s": sum(r["step_time_s"] for r in measured),
        "tokens_per_s": global_tokens / step,
        # the model's FLOPs, linear and attention, over the GPUs' bf16 peak (attnpool.train.flops): the median step's
        "mfu": statistics.median(r["mfu"] for r in measured) if measured[0].get("mfu") is not None else None,
        "imbalance_after": statistics.mean(r["imbalance_after"] for r in measured),
        "imbalance_before": statistics.mean(r["imbalance_before"] for r in measured),
        "bytes_sent_per_gpu": statistics.mean(r["comm_bytes"] for r in measured) / world,
        # A run's first step makes the optimizer's state only in its optimizer step, after the step's peak (AdamW's
        # two fp32 moments: 30 GiB a GPU of the 8B on two), so the peak is taken from later steps where there are
        # any; under --warmup-tokens the measured run's first step may be the only one measured, as it says
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in (steady or measured)),
        "peak_memory_first_step_only": not steady,
        # Ideal: the step's linear work and whole-document attention (the plan's total load,
        # seconds per layer under the measured table) at single-GPU rates, shared evenly.
        "ideal_step_s": linear_s + attention_s,
        # The same with the forward work the checkpointing mode repeats in the backward: what a perfectly
        # balanced step with this memory setting would take.
        "ideal_step_with_recompute_s": linear_s * (1 + linear_again) + attention_s * (1 + attention_again),
        "losses": [r["loss"] for r in rows],
        # Host-side planning of each step (every rank plans the batch), and core attention's own time
        # on the slowest rank (not measured under ping-pong, where it interleaves with the rest).
        "plan_time_s": statistics.median(r["plan_time_s"] for r in measured),
        "attention_time_s": attention_time(measured, statistics.median),
        "attention_density": None if measured[0].get("attention_density") is None
        else statistics.mean(r["attention_density"] for r in measured),
        # the sparse layers' served work, max/mean over the ranks, measured from the patterns the kernels ran and
        # priced as planned, the same in (query, key) pairs, and their kernels' seconds (imbalance_after is the
        # planner's prediction)
        **{key: None if measured[0].get(key) is None else statistics.mean(r[key] for r in measured)
           for key in SPARSE_IMBALANCES},
        "longest_doc": max(r["longest_doc"] for r in rows),
        # per measured step, per micro-batch: the nano-batches it ran as (ping-pong hides nothing in a step of 1)
        "nano_batches": [r.get("nano_batches") for r in measured],
        "layer_checkpointing": auto_choice(modes, offload),
    }
    rec["efficiency"] = rec["ideal_step_s"] / step
    rec["efficiency_with_recompute"] = rec["ideal_step_with_recompute_s"] / step
    return rec


def check_arguments(args: argparse.Namespace) -> tuple[list, list]:
    """(configs, strategies) from the arguments, refused with ConfigError before any process group exists."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise ConfigError("launch", "no torchrun", "run it under torchrun: torchrun --nproc-per-node N -m attnpool.cli.main bench ...")
    configs = []
    for item in args.configs.split(","):
        dist_name, _, size = item.partition(":")
        if dist_name not in DISTRIBUTIONS:
            raise ConfigError("--configs", item, f"distribution must be one of {', '.join(DISTRIBUTIONS)}")
        try:
            tokens = parse_size(size)
        except ValueError:
            raise ConfigError("--configs", item, "expected dist:tokens_per_gpu, e.g. prolong:128K") from None
        if tokens < 1:
            raise ConfigError("--configs", item, "tokens per GPU must be positive")
        configs.append((dist_name, tokens))
    strategies = args.strategies.split(",")
    unknown = [s for s in strategies if strategy_settings(s) is None]
    if unknown:
        raise ConfigError("--strategies", ",".join(unknown),
                          f"unknown; choose from {', '.join(STRATEGIES)}, each but wlb also with {BALANCED} after it")
    TrainConfig(**sparse_options(args.sparse_args))  # refuses bad sparse options before any process group
    sparse = [s for s in strategies if strategy_settings(s)[2] is not None]
    if sparse and args.device == "cuda":  # here, not in the sparse strategy's run: that would lose the ones before
        problem = sparse_device_problem(int(os.environ.get("LOCAL_RANK", 0)))
        if problem is not None:
            raise ConfigError("--strategies", ",".join(sparse), problem)
    traced = traced_strategies(args)
    if any(s not in strategies for s in traced):
        raise ConfigError("--trace", args.trace, f"must name strategies run: {', '.join(strategies)}")
    traced_ranks(args.trace_ranks, int(os.environ["WORLD_SIZE"]))
    if args.memory_breakdown and args.device != "cuda":
        raise ConfigError("--memory-breakdown", True, "records the CUDA allocator: needs --device cuda")
    if args.tp < 1 or args.pp < 1 or int(os.environ["WORLD_SIZE"]) % (args.tp * args.pp):
        raise ConfigError("--tp/--pp", (args.tp, args.pp),
                          f"tp x pp must divide the number of processes ({os.environ['WORLD_SIZE']})")
    if args.head_chunks != 1:  # here, not in the first run's: that would have set up its process groups
        m = model_config(args.model, **model_fields(args))
        problem = head_chunks_problem(args.head_chunks, m.n_kv_heads // args.tp, m.n_heads // args.tp)
        if problem:
            raise ConfigError("--head-chunks", args.head_chunks,
                              f"{problem} ({args.model}'s {m.n_kv_heads} KV and {m.n_heads} query heads over --tp "
                              f"{args.tp})")
    for flag, gibps in (("--exchange-gibps", args.exchange_gibps), ("--inter-node-gibps", args.inter_node_gibps)):
        if link_rate_problem(gibps):
            raise ConfigError(flag, gibps, link_rate_problem(gibps))
    if args.steps < 1 or args.warmup < 0 or args.layers < 1:
        raise ConfigError("--steps/--warmup/--layers", (args.steps, args.warmup, args.layers),
                          "need at least 1 measured step, 0 or more warm-up steps and 1 or more layers")
    if args.warmup_tokens is not None:
        if args.warmup_tokens < 1 or not args.warmup or any(args.warmup_tokens > tokens for _, tokens in configs):
            raise ConfigError("--warmup-tokens", args.warmup_tokens, "tokens per GPU of the warm-up steps: at least 1, "
                              "at most each config's, with --warmup 1 or more")
        if sparse:  # (their planning prior learns over the steps: a warm-up elsewhere would leave it at its start)
            raise ConfigError("--strategies", ",".join(sparse), "sparse strategies warm up on full batches: drop "
                                                                 "--warmup-tokens")
    head_parallel = [s for s in strategies if strategy_settings(s)[0] == "ulysses"]
    if head_parallel:  # here, not in its run: that would lose the strategies after it
        cfg = model_config(args.model, **model_fields(args))
        dp = int(os.environ["WORLD_SIZE"]) // (args.tp * args.pp)
        problem = ulysses_problem(dp, cfg.n_heads // args.tp, cfg.n_kv_heads // args.tp)
        if problem and args.strategies != ",".join(DEFAULT_STRATEGIES):
            raise ConfigError("--strategies", ",".join(head_parallel), problem)
        if problem:  # among the defaults: left out, and said
            strategies.remove("ulysses")
            if int(os.environ["RANK"]) == 0:
                print(f"ulysses: not run: {problem}", flush=True)
    return configs, strategies + (["ablation"] if args.ablation else [])


def ablated_strategy(args: argparse.Namespace) -> str:
    """What ``--ablation`` runs with one-element messages: cad with ping-pong, or plain cad where the run is
    pipelined (the pipeline refuses ping-pong; pp_schedule pooled's exchange spans every stage's ranks)."""
    return "cad" if args.pp > 1 else "cad+pingpong"


def run(args: argparse.Namespace) -> int:
    configs, strategies = check_arguments(args)
    cuda = args.device == "cuda"
    # As attnpool train runs (and the memory model's calibration was measured). First: the allocator reads
    # its settings when CUDA starts, and the kernel's resolution below starts it (it asks for the GPU's
    # compute capability); set after that, growable segments were silently off (one H200, torch 2.11).
    use_growable_segments()
    quiet_warnings()  # as attnpool train's (FA4's compilations and torch's scheduler order)
    # The kernel every run uses, for the record ("auto" takes fa4 where it imports, so one command measures
    # different kernels on different machines), refused here where it cannot run: every rank alike, before
    # any process group.
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    args.resolved_attention_backend = attention_backend(
        TrainConfig(attention_backend=args.attention_backend, device=args.device, precision="bf16"), device)
    # (the device named: NCCL's barriers otherwise guess it, and warn)
    with process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {})):
        _run_all(args, configs, strategies, cuda)
    return 0


def may_start(elapsed_s: float, longest_run_s: float, budget_s: float, end_by_s: float) -> bool:
    """Whether the next run may start: before ``--budget-s`` (no run starts after it), and where a run as long as
    the longest so far would end by ``--end-by-s``. The budget alone lets a run begun just under it end far past
    it, where a GPU call's time limit cuts it (the finished runs' record is kept, that run lost)."""
    return elapsed_s < budget_s and elapsed_s + longest_run_s < end_by_s


def _run_all(args: argparse.Namespace, configs: list, strategies: list, cuda: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()  # (before the wait for idle GPUs, which --budget-s and --end-by-s must count)
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        wait_for_idle_gpus()
    cfg = model_config(args.model, **model_fields(args))
    records, skipped, longest_run_s = [], [], 0.0
    work_dir = tempfile.mkdtemp(prefix="attnpool-bench-")
    for dist_name, tokens in configs:
        for name in strategies:
            # Every rank must take the same decision, or one would wait in a collective forever.
            go = [may_start(time.perf_counter() - t0, longest_run_s, args.budget_s, args.end_by_s)]
            dist.broadcast_object_list(go, src=0)
            if not go[0]:
                skipped.append(f"{dist_name}:{tokens}:{name}")
                continue
            run_t0 = time.perf_counter()
            with MemoryRecorder(args.memory_breakdown) as recorder:
                if name == "ablation":
                    with tiny_messages():
                        rows, predicted, settings = run_one(ablated_strategy(args), dist_name, tokens, args, work_dir)
                else:
                    trace = name in traced_strategies(args) and (dist_name, tokens) == configs[0]
                    rows, predicted, settings = run_one(name, dist_name, tokens, args, work_dir, trace)
            label = f"{ablated_strategy(args)} (1-element messages)" if name == "ablation" else name
            rec = summarize(label, dist_name, tokens, rows, args, world, cfg, settings)
            rec["predicted_peak_memory_bytes"] = predicted  # the memory model's, of the allocator's peak
            rec["attention_backend"] = args.resolved_attention_backend
            if args.memory_breakdown:
                _add_memory_breakdown(rec, recorder.breakdown(), args.out, f"{dist_name}-{tokens // 1024}K-{name}")
            records.append(rec)
            longest_run_s = max(longest_run_s, time.perf_counter() - run_t0)
            # FSDP modules hold reference cycles: free this run's model and optimizer before
            # the next one, or its memory (and peak-memory figures) carry over.
            del rows
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                release_host_cache()  # activation offload's pinned blocks, cached sized for this run's tensors
            if rank == 0:
                finish(records, skipped, args, world, cfg, complete=False)  # what a later kill would lose
                print(f"{dist_name:8s} {tokens // 1024:4d}K {rec['strategy']:34s} step {rec['step_time_s']:7.3f} s  "
                      f"{rec['tokens_per_s'] / 1e3:8.1f}K tok/s  imbalance {rec['imbalance_after']:.3f}  "
                      f"peak {rec['peak_memory_bytes'] / 2**30:.1f} GiB  plan {rec['plan_time_s'] * 1e3:.0f} ms  "
                      f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    if rank == 0:
        finish(records, skipped, args, world, cfg)
    shutil.rmtree(work_dir, ignore_errors=True)


def wait_for_idle_gpus(polls: int = IDLE_GPU_POLLS, poll_s: float = IDLE_GPU_POLL_S) -> None:
    """Wait until no rank's GPU holds more than FOREIGN_GPU_MEMORY_LIMIT of other processes' memory (say the
    workers of a benchmark killed a moment ago, still exiting), or refuse on every rank after ``polls``.
    Every rank polls the same number of times and decides on the same all-reduced figure, so none waits
    in a collective for one that gave up."""
    for poll in range(polls + 1):
        free, total = torch.cuda.mem_get_info()
        foreign = torch.tensor([total - free - torch.cuda.memory_reserved()], dtype=torch.float64, device="cuda")
        dist.all_reduce(foreign, op=dist.ReduceOp.MAX)
        if foreign.item() <= FOREIGN_GPU_MEMORY_LIMIT:
            return
        if poll == 0 and dist.get_rank() == 0:
            print(f"waiting for the GPUs: up to {foreign.item() / 2**30:.1f} GiB in use by other processes",
                  flush=True)
        if poll < polls:
            time.sleep(poll_s)
    raise TrainingError(f"a GPU still holds {foreign.item() / 2**30:.1f} GiB of other processes' memory after "
                        f"{polls * poll_s:.0f} s (see nvidia-smi): measurements would not be this run's alone")


def _add_memory_breakdown(rec: dict, report: dict | None, out: str, tag: str) -> None:
    """Every rank's peak breakdown to rank 0, which keeps the highest peak's in the record and writes it out."""
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if dist.get_rank() != 0 or not any(reports):
        return
    worst = max((r for r, report in enumerate(reports) if report),
                key=lambda r: reports[r]["start_bytes"] + reports[r]["peak_bytes"])
    rec["memory_breakdown"] = dict(rank=worst, **reports[worst])
    os.makedirs(out, exist_ok=True)
    title = f"Peak memory of {rec['strategy']} on {rec['dist']} {rec['tokens_per_gpu'] // 1024}K, rank {worst}"
    with open(os.path.join(out, f"memory-{tag.replace('+', '_')}.md"), "w") as f:
        f.write(breakdown_markdown(title, reports[worst]))


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f}"


def _fixed(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def finish(records, skipped, args, world, cfg, complete: bool = True):
    """Writes e2e.json and e2e.md of the records so far (``complete``: all of them, and prints the table).
    ``args``: as run() completed them (``resolved_attention_backend``)."""
    by_config = {}
    for r in records:
        by_config.setdefault((r["dist"], r["tokens_per_gpu"]), []).append(r)
    for (dist_name, tokens), recs in by_config.items():
        local = next((r for r in recs if r["strategy"] == "local"), None)
        for r in recs:
            r["speedup_vs_local"] = local["step_time_s"] / r["step_time_s"] if local else None
            # The median hides the few batches with a long document, where balancing matters most.
            r["speedup_vs_local_total"] = local["total_time_s"] / r["total_time_s"] if local else None
            # Sparse training computes another function: its losses are checked against sparse local.
            sparse = (strategy_settings(r["strategy"]) or (None, None, None))[2] is not None
            same = next((x for x in recs if x["strategy"] == "local+sparse"), None) if sparse else local
            if same and "1-element" not in r["strategy"]:
                n = min(5, len(r["losses"]), len(same["losses"]))
                dev = max(abs(a - b) / b for a, b in zip(r["losses"][:n], same["losses"][:n]))
                r["loss_vs_local_max_rel"] = dev
                r["loss_ok"] = dev <= LOSS_TOLERANCE
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU process (gloo)"
    # The ranks of a node as the runs' configs resolve them (attnpool.train.spec.ranks_per_node: torchrun's
    # LOCAL_WORLD_SIZE), so that a run over several nodes, emulated ones too (bench/gpu_e2e.sh's NODES), says so
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    launch = (f"torchrun --nproc-per-node {world}" if per_node == world else
              f"torchrun --nnodes {world // per_node} --nproc-per-node {per_node}")
    meta = {"date": str(datetime.date.today()), "machine": f"{world} x {device}", "layers": args.layers,
            "ranks_per_node": per_node, "hierarchical_exchange": args.hierarchical_exchange,
            # (NCCL_HOSTID marks emulated nodes, bench/torchrun_nodes.sh; the socket settings an emulated network)
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "torch": torch.__version__, "model": f"{args.model} x {args.layers} layers" + (
                f", sliding window {args.sliding_window} ({args.layer_types or 'every layer'})"
                if args.sliding_window is not None else ""),
            "attention_backend": args.resolved_attention_backend, "warmup": args.warmup,
            "warmup_tokens": args.warmup_tokens, "measured_steps": args.steps, "skipped": skipped, "complete": complete,
            "command": f"{launch} -m attnpool.cli.main bench --model {args.model} "
                       f"--layers {args.layers} --configs {args.configs} "
                       + (f"--sliding-window {args.sliding_window} " if args.sliding_window is not None else "")
                       + (f"--layer-types {args.layer_types} " if args.layer_types else "") +
                       f"--strategies {args.strategies} --warmup {args.warmup} --steps {args.steps} "
                       + (f"--warmup-tokens {args.warmup_tokens} " if args.warmup_tokens is not None else "") +
                       f"--attention-backend {args.resolved_attention_backend}"  # as run, where "auto" was asked
                       + (" --ablation" if args.ablation else "") + (f" --trace {args.trace}" if args.trace else "")
                       + (f" --trace-ranks {args.trace_ranks}" if args.trace and args.trace_ranks != "0" else "")
                       + (f" --sparse-args {args.sparse_args}" if args.sparse_args else "")
                       + (f" --activation-checkpointing {args.activation_checkpointing}"
                          if args.activation_checkpointing != "keep_attention" else "")
                       + (" --activation-offload" if args.activation_offload else "")
                       + (" --hierarchical-exchange" if args.hierarchical_exchange else "")
                       + (f" --head-chunks {args.head_chunks}" if args.head_chunks != 1 else "")
                       + "".join(f" --{flag} {rate if isinstance(rate, str) else format(rate, 'g')}"
                                 for flag, rate in (("exchange-gibps", args.exchange_gibps),
                                                    ("inter-node-gibps", args.inter_node_gibps)) if rate is not None)
                       + "".join(f" --{k} {getattr(args, k)}" for k in ("tp", "pp", "microbatches")
                                 if getattr(args, k) != 1)
                       + (f" --pp-schedule {args.pp_schedule}" if args.pp > 1 and args.pp_schedule != "1f1b" else "")}
    with open(os.path.join(args.out, "e2e.json"), "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1)
    lines = [f"# End-to-end training steps on {meta['machine']}", "",
             f"{meta['model']}, torch {meta['torch']}, bf16, core attention kernel {meta['attention_backend']}, "
             f"FSDP2, activation checkpointing "
             f"{CHECKPOINTING_TEXT[args.activation_checkpointing]}, "
             f"{args.warmup} warm-up"
             + (f" (on batches of {args.warmup_tokens} tokens per GPU, a run of their own)" if args.warmup_tokens else "")
             + f" + {args.steps} measured steps (median), same seeds and batches for all strategies.",
             "", f"Command: `{meta['command']}`", "",
             "| dist | tokens/GPU | strategy | step (s) | tokens/s | vs local | vs local (total) | MFU | efficiency | "
             "efficiency with recompute | attn max/mean | MiB sent/GPU | peak GiB | predicted GiB | loss vs local | "
             "attn density | sparse max/mean (measured) | sparse max/mean in pairs | sparse kernel s max/mean |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lv, density = r.get("loss_vs_local_max_rel"), r["attention_density"]
        vs, vs_total = (("-" if x is None else f"{x:.3f}") for x in (r["speedup_vs_local"], r["speedup_vs_local_total"]))
        lines.append(f"| {r['dist']} | {r['tokens_per_gpu'] // 1024}K | {r['strategy']} | {r['step_time_s']:.3f} | "
                     f"{r['tokens_per_s'] / 1e3:.1f}K | {vs} | {vs_total} | {_fixed(r['mfu'])} | {r['efficiency']:.3f} | "
                     f"{r['efficiency_with_recompute']:.3f} | "
                     f"{r['imbalance_after']:.3f} | {r['bytes_sent_per_gpu'] / 2**20:.0f} | "
                     f"{r['peak_memory_bytes'] / 2**30:.1f}"
                     f"{FIRST_STEP_MARK if r['peak_memory_first_step_only'] else ''} | "
                     f"{_gib(r['predicted_peak_memory_bytes'])} | "
                     f"{'-' if lv is None else f'{lv:.4f}'} | "
                     f"{'-' if density is None else f'{density:.3f}'} | "
                     + "".join(f"{_fixed(r.get(key))} | " for key in SPARSE_IMBALANCES).rstrip())
    if args.activation_checkpointing == "auto":
        lines += ["", "auto's choice: " + "; ".join(f"{r['dist']} {r['tokens_per_gpu'] // 1024}K {r['strategy']}: "
                                                    f"{r['layer_checkpointing']}" for r in records) + "."]
    if args.pp > 1 and args.pp_schedule == "auto":
        lines += ["", "pp_schedule auto: " + "; ".join(f"{r['dist']} {r['tokens_per_gpu'] // 1024}K {r['strategy']}: "
                                                      f"{r['pp_schedule']} ({r['pp_schedule_choice']['why']})"
                                                      for r in records) + "."]
    if any(r["peak_memory_first_step_only"] for r in records):
        lines += ["", f"{FIRST_STEP_MARK}: the peak of a run's first step, the only one measured: the optimizer's "
                      "state is made after it, so it may be below the memory model's prediction, which holds that "
                      "state (measure 2 steps to compare)."]
    if skipped:
        lines += ["", f"Not run (time budget): {', '.join(skipped)}."]
    if not complete:
        lines += ["", "Partial: written after each strategy; the run had not finished."]
    with open(os.path.join(args.out, "e2e.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    if complete:
        print("\n".join(lines[6:]))
