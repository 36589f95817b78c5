"""The training loop: the components of a run (attnpool.train.*), tied together on every rank.

One step, on every rank::

    batches = stream.next_batch() x microbatches   # the same global batches on every rank (same seed)
    planned = runner.plan(batches)                 # who holds which tokens; who computes which attention shard
    runner.run(planned)                            # forward and backward (plain, pipeline or pooled)
    clip -> AdamW -> lr schedule; metrics; checkpoint

The model never sees the strategy: its attention is core attention bound to the step's plan, reused by every
layer. Every rank plans the same batch the same way, so the plans agree (core attention checks their
fingerprints).

Where each decision is made: the settings are checked in attnpool.train.config; everything they resolve to
on this rank's device in attnpool.train.spec (one ``RunSpec``), checked with the model, the data and the
checkpoint in attnpool.train.setup, and agreed on by the ranks before the first collective that depends on
it. Launching, restarts and signals are attnpool.train.launch's.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from attnpool.comm import agree, all_gather_flat, comm_stats
from attnpool.comm.probe import same_ranks_per_node, start_up_link_rates
from attnpool.comm.watchdog import RankRecords, is_collective_failure
from attnpool.data import DocumentStream
from attnpool.errors import ConfigError, TrainingError, storage_error
from attnpool.kernels.base import compile_positions
from attnpool.parallel import build_rank_mesh
from attnpool.parallel.compile import CompileClock
from attnpool.parallel.float8 import refresh_float8_scales
from attnpool.plan import SHARD_SERVING, head_group_heads
from attnpool.plan.metrics import imbalance
from attnpool.runtime.dispatch import MAX_CAUSAL_CALL_SEGMENTS
from attnpool.runtime.sparse import SparseStats
from attnpool.sizes import format_bytes
from attnpool.train.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from attnpool.train.config import TrainConfig
from attnpool.train.export import checkpoint_export_dir, export_run_model
from attnpool.train.flops import bf16_peak_flops, step_flops
from attnpool.train.memory import AUTO, MemoryEstimate, auto_choice
from attnpool.train.memory_check import smallest_capacity
from attnpool.console import START_TIME_ENV
from attnpool.train.metrics import (PLOT_FILE, SUMMARY_FILE, WARM_UP_STEPS, MetricsLog, Progress, open_logger,
                                    peak_memory_bytes, peak_reserved_bytes, plot_run, print_summary,
                                    reset_peak_memory, summarize)
from attnpool.train.offload import pin_host_ahead
from attnpool.train.optim import agree_finite, apply_optim_settings, build_optimizer, build_scheduler, clip_gradients
from attnpool.train.schedule_choice import same_schedule
from attnpool.train.planning import StepPlan
from attnpool.train.resume import changes_data, verified_checkpoint, write_config
from attnpool.train.runners import PlannedStep, build_runner
from attnpool.train.setup import prepare
from attnpool.train.signals import Preemption
from attnpool.train.spec import (context_note, link_rates, links_to_measure, measures_links, rank_device,
                                 ranks_per_node, same_attention_backend, with_measured_links)


@dataclass
class StepEnd:
    """How a step ended: its metrics row, its attention balance, whether its loss and gradients were finite (else
    it was skipped on every rank), and whether a SIGTERM asks every rank to stop after it."""

    row: dict
    balance: StepPlan
    finite: bool
    stop: bool


@dataclass
class TrainResult:
    rows: list[dict]  # metrics of every step of the run so far (earlier runs' rows included on resume)
    model: nn.Module
    summary: dict | None  # rank 0 only
    memory: MemoryEstimate | None = None  # this rank's predicted peak, where its device was checked
    layer_checkpointing: tuple[str, ...] = ()  # each layer's checkpointing mode as it ran (auto's choice, resolved)
    activation_offload: bool = False  # as it ran (auto may turn it on)
    pp_schedule: str | None = None  # the pipeline schedule as it ran (None without pipeline stages)
    pp_schedule_choice: dict | None = None  # pp_schedule auto's choice and why (ScheduleChoice.to_dict)
    # the links' rates cad's planner priced its bytes at, and whether each was measured at the start (spec.link_rates)
    link_rates: dict = field(default_factory=dict)

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.rows]


def train(config: TrainConfig, on_step=None, skip_steps: int = 0) -> TrainResult:
    """Train (or, with ``resume``, continue) on the ranks of the initialised default process group.

    ``on_step()``, if given, is called after every step (e.g. a torch.profiler's ``step``). A SIGTERM at
    any time from here on stops the run after its current (or first) step, checkpointed. ``skip_steps``: a new
    run's first step trains on the data stream's batches after that many steps' (``attnpool bench --warmup-tokens``
    warms up on small batches elsewhere, then measures the batches a run warmed up on them would)."""
    with Preemption() as preemption, deterministic_algorithms(config.run.deterministic):
        return Trainer(config, skip_steps).fit(on_step, preemption)


# cuBLAS picks its reduction order by the workspace it gets; a fixed one of 4096 KiB x 8 makes its results repeat
# (what torch's deterministic algorithms ask for on CUDA 10.2+; they raise on a matmul without it)
CUBLAS_DETERMINISTIC = ":4096:8"


@contextlib.contextmanager
def deterministic_algorithms(on: bool):
    """``deterministic``: torch's deterministic algorithms while the run trains (FlashAttention-2's backward, index
    adds and scatters without atomics; the attention backends ask torch.are_deterministic_algorithms_enabled() for
    their own kernels), as they were after; and cuBLAS's fixed workspace where the user set none. torch reads that
    setting at the process's first matmul on the GPU, which in ``attnpool train`` comes after this; a process
    that trained before without it keeps the workspace it had."""
    if not on:
        yield
        return
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def balance_groups(dims) -> np.ndarray:
    """Each rank's group of the ranks cad balances together, the dp ranks of one pipeline stage and tp rank (stages
    hold different numbers of layers), as a number per rank in the mesh's ("pp", "dp", "tp") order."""
    pp, _, tp = np.meshgrid(np.arange(dims.pp), np.arange(dims.dp), np.arange(dims.tp), indexing="ij")
    return (pp * dims.tp + tp).reshape(-1)


def served_imbalance(served: np.ndarray, dims) -> float:
    """max/mean of every rank's served sparse work (world,) within each group cad balances (:func:`balance_groups`),
    the largest over the groups."""
    served, groups = np.asarray(served), balance_groups(dims)
    return max(imbalance(served[groups == group]) for group in np.unique(groups))


class Trainer:
    """One run on this rank: its components, built once, and the loop over its steps."""

    def __init__(self, config: TrainConfig, skip_steps: int = 0):
        if skip_steps < 0:  # (every rank is given the same number: each refuses it, before any collective)
            raise ConfigError("skip_steps", skip_steps, "a number of steps: 0 or more")
        # The run's wall time counts from the command's start (start-up, reading the model, compiling included);
        # taken once, so that a later run in the same process (the benchmark's, one after another) counts from its
        # own start rather than adding up the runs before it
        self.started = float(os.environ.pop(START_TIME_ENV, time.time()))
        self.config, self.rank, self.world = config, dist.get_rank(), dist.get_world_size()
        self.device = rank_device(config)
        # auto's choices (each layer's checkpointing, whether pooled's activations fit) must be every rank's: made
        # for the smallest rank's memory
        auto_capacity = smallest_capacity(config, self.world, self.device) \
            if AUTO in (config.memory.activation_checkpointing, config.parallel.pp_schedule) else None
        self.setup = agree(lambda: prepare(config, self.world, self.device, auto_capacity=auto_capacity))
        spec = self.spec = self.setup.spec
        same_attention_backend(spec.backend_name, config.attention.backend)
        if spec.schedule_choice is not None:
            same_schedule(spec)
        # The plan is made over the dp ranks; this rank holds its dp rank's tokens and runs core attention
        # on its share of the heads (and, pipelined, its stage's layers) with the dp ranks of its tp and
        # pipeline index (attnpool.parallel.mesh).
        self.mesh = build_rank_mesh(spec.dims, self.device.type, timedelta(seconds=config.faults.collective_timeout_s))
        if measures_links(config):
            spec = self.spec = self._measured_links()
        self.records = RankRecords(config.run.out, self.rank, self.world)
        self.peak_flops = bf16_peak_flops(self.device) if spec.bf16 else None  # MFU's denominator, per GPU
        self.resume_from = verified_checkpoint(config, spec.model, self.setup.resume_from) \
            if self.setup.resume_from is not None else None
        self.runner = build_runner(spec, self.mesh)
        self.model = self.runner.model
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.model, config.optim, fused=self.device.type == "cuda")
        self.scheduler = build_scheduler(self.optimizer, config.optim)
        self.stream = DocumentStream(self.setup.source, spec.dims.dp, config.data.tokens_per_rank, config.data.seed,
                                     config.data.max_doc_len)
        self.prior = spec.new_sparse_prior()
        self.extra_state = {"sparse_prior": self.prior} if self.prior else {}
        self.step = 0
        self.steps_run = 0  # by this process (a resumed run's first steps compile again)
        self.compile_clock: CompileClock | None = None  # (fit's, while it runs)
        # (each step draws a batch per micro-batch; a resumed run's stream continues where its checkpoint's stopped)
        for _ in range(skip_steps * config.parallel.microbatches):
            self.stream.next_batch()
        if self.resume_from is not None:
            self.step = load_checkpoint(self.resume_from, self.model, self.optimizer, self.scheduler, self.stream,
                                        self.extra_state, self.device,
                                        same_data=not changes_data(config, self.resume_from))
            apply_optim_settings(self.optimizer, self.scheduler, config.optim)
        self.start_step = self.step
        self.log = self._open_log()
        self._compile_position_kernel()
        self._pin_offload_memory()
        self.nonfinite_total = sum(1 for r in self.log.rows if r.get("skipped_step"))  # resumed: the earlier steps'
        self.nonfinite_in_a_row = 0

    def _measured_links(self):
        """The run's spec with the link rates left to measurement (exchange_gibps or inter_node_gibps auto)
        measured now where its plans use them (spec.links_to_measure; unset where not), on every rank alike
        (comm.probe: the slowest rank's), before anything is planned."""
        per_node = ranks_per_node(self.config, self.world)
        if self.config.attention.strategy == "cad":  # (which links a rank measures follows its nodes)
            same_ranks_per_node(per_node, self.device)
        inside, between = links_to_measure(self.spec)
        t0 = time.perf_counter()
        rates = start_up_link_rates(self.device, per_node, inside, between, self.mesh.timeout) \
            if inside or between else (None, None)
        if self.rank == 0 and (inside or between):
            measured = [f"{gibps:.1f} GiB/s per GPU {where}" for gibps, where in zip(rates, ("inside a node",
                                                                                          "between nodes"))
                        if gibps is not None]
            print(f"links: all-to-all {', '.join(measured)}, measured for cad's planner in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)
        return with_measured_links(self.spec, self.world, *rates)

    def _compile_position_kernel(self) -> None:
        """The backend's position kernel compiled before the first step, where a server may get several shards of
        one document (runtime.dispatch.DocumentServing: cad's tasks of one document) and some dense layer serves
        them at their positions. FA4 compiles it on its first call, 8-11 s (2 x H200)
        (bench/results/2026-11-27-h200-h100-fa4-positions.md), which otherwise lands in whichever step first serves
        such a document: in a benchmark a measured one (percp's single-document step at pretrain 128K,
        2026-11-30-h200x2-head-chunks.md). A strategy whose documents have at most
        dispatch.MAX_CAUSAL_CALL_SEGMENTS segments on a server (plan.SHARD_SERVING: percp's head and tail) runs them
        as causal calls, one's keys holding the other's, and needs no position kernel, except in a sliding-window
        layer whose kernel serves positions (fa4's copies prefixes there instead)."""
        spec = self.spec
        kernel = spec.backend.positions if spec.backend is not None else None
        servers = spec.dims.dp * (spec.dims.pp if spec.pooled else 1)  # the ranks a plan spreads over
        dense = spec.sparse is None or spec.sparse.dense_layers > 0  # (sparse layers serve through their patterns)
        strategy = self.config.attention.strategy
        most_segments = SHARD_SERVING.get(strategy)
        causal_calls = (most_segments is not None and most_segments <= MAX_CAUSAL_CALL_SEGMENTS
                        and all(kind.window is None or spec.prefix_copies_of(kind) for kind in spec.layer_kinds))
        if (kernel is None or not kernel.compiles_on_first_call or strategy not in SHARD_SERVING or causal_calls
                or servers == 1 or not dense or all(spec.prefix_copies_of(kind) for kind in spec.layer_kinds)):
            return
        t0 = time.perf_counter()
        shape = spec.attention_shape
        compile_positions(kernel, self.device, spec.compute_dtype,
                          *head_group_heads(spec.head_chunks, shape.n_q_heads, shape.n_kv_heads), shape.head_dim)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.rank == 0:
            print(f"{spec.backend_name}: its position kernel compiled in {time.perf_counter() - t0:.1f} s, before the "
                  "first step", flush=True)

    def _pin_offload_memory(self) -> None:
        """Activation offload's host pieces of each layer's input, pinned before the first step
        (offload.pin_host_ahead): pinned as the offloads go, tens of GiB at 256K tokens per GPU, they would be part
        of the first step, which a benchmark warmed up on small batches (--warmup-tokens) measures. Every mode
        offloads a layer's input (keep_attention's core-attention state, smaller pieces, is left to the step); with
        pipeline stages, whose micro-batches in flight vary, nothing is pinned ahead."""
        spec = self.spec
        if not spec.activation_offload or self.device.type != "cuda" or spec.dims.pp > 1:
            return
        tokens, dim = spec.stage_hidden  # (a rank's layer input: its sequence shard under tp)
        t0 = time.perf_counter()
        pinned = pin_host_ahead(tokens * dim * spec.compute_dtype.itemsize, spec.model.config.n_layers)
        if self.rank == 0 and pinned:
            print(f"activation offload: {format_bytes(pinned)} of host memory pinned in "
                  f"{time.perf_counter() - t0:.1f} s, before the first step", flush=True)

    def _open_log(self) -> MetricsLog:
        config, resumed = self.config, self.resume_from is not None
        if self.rank == 0:
            try:
                os.makedirs(config.run.out, exist_ok=True)
                write_config(config, self.resume_from, self.step)
            except OSError as exc:  # (rank 0's alone: the launcher ends the others, and says this)
                raise storage_error(exc, os.path.join(config.run.out, "config.yaml")) from None
        logger = open_logger(config.run.logger, config.run.out, config.to_dict()) if self.rank == 0 else None
        log = MetricsLog(config.run.out, write=self.rank == 0, resume_step=self.step if resumed else None,
                         logger=logger)
        dist.barrier()  # every rank has read the earlier rows before rank 0 rewrites the file
        log.start()
        if self.rank == 0:
            self._print_start()
        return log

    def _print_start(self) -> None:
        config, spec, dims = self.config, self.spec, self.spec.dims
        resumed = f", resumed from {self.resume_from}" if self.resume_from else ""
        layout = f" (pp {dims.pp} x dp {dims.dp} x tp {dims.tp})" if dims.pp > 1 else \
            f" (dp {dims.dp} x tp {dims.tp})" if dims.tp > 1 else ""
        microbatches = config.parallel.microbatches
        micro = f" in {microbatches} micro-batches" if microbatches > 1 else ""
        print(f"attnpool train: {spec.model.name} ({spec.model.num_params(self.model) / 1e6:.2f}M params) on "
              f"{self.world} x {self.device.type}{layout}, {config.attention.strategy} attention ({spec.backend_name} "
              f"kernel), {dims.dp} x {microbatches * config.data.tokens_per_rank} tokens per step{micro}, "
              + (f"steps {self.step + 1}..{config.last_step}" if self.step < config.last_step else "no step left")
              + f" of {config.optim.steps}{resumed} -> {config.run.out}", flush=True)
        if getattr(spec.model, "has_weights", None) is False:  # (an hf: directory with a config.json alone)
            print(f"{spec.model.name}: no safetensors weights in its directory: initialised at random from its "
                  "config.json", flush=True)
        note = context_note(config, spec.model, dims.dp)
        if note is not None:
            print(note, flush=True)
        if spec.mixed_kinds:  # each kind of layer planned and served on its own (attnpool.kinds)
            counts = Counter(kind.describe() for kind in spec.layer_kinds)
            print("attention kinds: " + "; ".join(f"{n} x {what}" for what, n in counts.items())
                  + f" ({len(spec.plan_windows)} plans per micro-batch)", flush=True)
        if getattr(spec.cost_model, "backend", spec.backend_name) != spec.backend_name and self.device.type == "cuda":
            print(f"cost model: {spec.cost_model.source}", flush=True)  # a stand-in table plans this kernel
        if spec.schedule_choice is not None:
            print(f"pp_schedule auto: {spec.schedule_choice.chosen} ({spec.schedule_choice.why})", flush=True)
        if spec.layer_checkpointing:
            print(f"activation checkpointing auto: {auto_choice(spec.layer_checkpointing, spec.activation_offload)}",
                  flush=True)
        memory = self.setup.memory
        if memory is not None and self.device.type == "cuda":
            capacity = torch.cuda.get_device_properties(self.device).total_memory
            print(f"memory: predicted peak {format_bytes(memory.peak_bytes)} per GPU of its "
                  f"{format_bytes(capacity)} ({memory.inputs.setting})", flush=True)
        if spec.sparse is not None and self.device.type == "cuda" and config.model.precision == "fp32":
            print("the float32 sparse kernels (IEEE products) compile for minutes the first time they run", flush=True)

    def fit(self, on_step, preemption: Preemption) -> TrainResult:
        """Every step up to the run's last (or a SIGTERM's), then the end's export and summary."""
        config, last_step = self.config, self.config.last_step
        end = None
        comm_stats.timing = True
        # (compiling steps are timed, so that the steady throughput can leave them out: attnpool.parallel.compile)
        self.compile_clock = CompileClock() if self.spec.compile else None
        try:
            with self.compile_clock or contextlib.nullcontext(), \
                    Progress(self.rank == 0 and config.run.progress, last_step, self.step,
                             config.attention.strategy) as progress:
                while self.step < last_step:
                    self.step += 1
                    end = self.train_step(preemption)
                    self.log.append(end.row)
                    progress.update(end.row)
                    if on_step is not None:
                        on_step()
                    self._checkpoint_if_due(end)
                    self._refuse_nonfinite_steps()
                    if end.stop:
                        self._say_stopped(end)
                        break
        except (ConfigError, TrainingError):
            raise
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            # A peer is gone (or silent past collective_timeout_s): name it, on every survivor.
            raise TrainingError(self.records.describe_failure(exc, self.step, config.faults.collective_timeout_s),
                                restartable=True) from None
        finally:
            comm_stats.timing = False
            self.log.close()
        if self.spec.model.writes_hf_export and config.checkpoint.hf_export and self.step == last_step:
            export_run_model(self.model, self.spec.model, config, self.mesh)
        balance = end.balance if end is not None else None
        summary = self._report(balance, time.time() - self.started) if self.rank == 0 else None
        modes = self.spec.layer_checkpointing or (self.config.memory.activation_checkpointing,) * \
            self.spec.model.config.n_layers
        choice = self.spec.schedule_choice
        return TrainResult(self.log.rows, self.model, summary, self.setup.memory, tuple(modes),
                           self.spec.activation_offload, self.spec.pp_schedule if self.spec.dims.pp > 1 else None,
                           choice.to_dict() if choice is not None else None, link_rates(self.config, self.spec))

    def train_step(self, preemption: Preemption) -> StepEnd:
        """One optimizer step, on every rank."""
        self.records.step(self.step)
        t0 = time.perf_counter()
        reset_peak_memory(self.device)
        micro_batches = [self.stream.next_batch() for _ in range(self.config.parallel.microbatches)]
        # A step may hold no target at all (task sources mark only answers; a batch of ordinary documents has
        # none): its loss is then 0, not 0 / 0, and the optimizer does not step (AdamW's momentum and weight
        # decay would move the weights without a gradient).
        targets = sum(b.num_label_tokens for b in micro_batches)
        if self.spec.float8_all_gather:  # the scales of the weights as this step's gathers see them
            refresh_float8_scales(self.model)
        t_plan = time.perf_counter()
        planned = self.runner.plan(micro_batches, self.prior)
        plan_time = time.perf_counter() - t_plan
        comm_stats.reset()
        # the served work each rank's kernels ran, priced as this step's plans price it (SparseStats.served_work)
        price = self.prior.served_price(self.spec.cost_model) if self.prior is not None else None
        learns = price is not None and self.prior.learns_kernel_scale(self.spec.cost_model)
        stats = SparseStats(price)
        outcome = self.runner.run(planned, max(1, targets), stats)
        grad_norm = clip_gradients(self.params, self.config.optim.grad_clip or float("inf"),
                                   self.mesh.pp_group if self.spec.dims.pp > 1 else None, self.runner.counted_params)
        lr = self.scheduler.get_last_lr()[0]
        # A step whose loss or gradient is not finite is skipped on every rank (its gradients dropped), and the
        # schedule goes on, so that step numbers keep their learning rates.
        finite = agree_finite(outcome.loss_sum, grad_norm, self.device)
        if finite:
            if targets:  # the same on every rank: the micro-batches are the global batches
                self.optimizer.step()
            self.nonfinite_in_a_row = 0
        else:
            self.nonfinite_total += 1
            self.nonfinite_in_a_row += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        per_rank = self._gather_rank_values(outcome, stats, preemption)
        stop = bool(per_rank[:, 7].max() > 0)  # a SIGTERM reached some rank: all stop after this step
        sparse_sums, served, by_length = SparseStats.parse(per_rank[:, 9:])
        self.steps_run += 1
        if self.prior is not None:
            self.prior.update(*sparse_sums[:3], by_length=by_length)
        # The same on every rank (all ranks' values). Not this process's first steps, nor a step that compiled: their
        # clocks hold compilation (Triton's kernels' too, which CompileClock does not see).
        if learns and self.steps_run > WARM_UP_STEPS and not per_rank[:, 8].max() > 0:
            self.prior.update_kernel_scale(served[2], served[3], served[4], groups=balance_groups(self.spec.dims))
        values = {"step_time_s": time.perf_counter() - t0, "plan_time_s": plan_time, "lr": lr,
                  "grad_norm": float(grad_norm), "sparse_kernel_price_scale": price.sparse_scale if learns else None}
        row = self._row(micro_batches, planned, per_rank, sparse_sums, served, values, outcome.timed, finite,
                        max(1, targets))
        return StepEnd(row, planned.balance, finite, stop)

    def _gather_rank_values(self, outcome, stats: SparseStats, preemption: Preemption) -> np.ndarray:
        """(world, values): every rank's loss, attention and communication times, bytes, peaks, offloaded bytes,
        stop request, seconds torch.compile compiled in the step and sparse statistics, in one all-gather."""
        offload, device = self.runner.offload, self.device
        compiled = self.compile_clock.take() if self.compile_clock is not None else 0.0
        values = [float(outcome.loss_sum), outcome.attention_seconds(), comm_stats.seconds(),
                  float(comm_stats.bytes_sent), float(peak_memory_bytes(device)), float(peak_reserved_bytes(device)),
                  float(offload.offloaded_bytes if offload else 0), float(preemption.requested), compiled,
                  *stats.values()]
        out = all_gather_flat(torch.tensor(values, dtype=torch.float64, device=device))
        return out.cpu().numpy().reshape(dist.get_world_size(), len(values))

    def _row(self, micro_batches, planned: PlannedStep, per_rank: np.ndarray, sparse_sums: np.ndarray,
             served: np.ndarray, values: dict, attention_timed: bool, finite: bool, label_tokens: int) -> dict:
        """The step's metrics row (attnpool.train.metrics says what each means); ``served``: every rank's served
        sparse-layer pairs, work, kernel seconds and the work's parts (SparseStats.SERVED, world; SparseStats.parse);
        ``values``: this rank's times, learning rate, gradient norm and the sparse price scale its plans used."""
        balance = planned.balance
        step_tokens = sum(b.num_tokens for b in micro_batches)
        cuda, sparse = self.device.type == "cuda", self.spec.sparse is not None
        flops = sum(step_flops(self.spec.model.config, b.doc_lens) for b in micro_batches)
        return {
            "step": self.step,
            # a dp rank's tp ranks agree on its loss; off the last pipeline stage ranks report none
            "loss": float(per_rank[:, 0].sum() / self.spec.dims.tp / label_tokens),
            "lr": values["lr"],
            "grad_norm": values["grad_norm"],
            "tokens": step_tokens,
            "tokens_per_s": step_tokens / values["step_time_s"],
            "step_time_s": values["step_time_s"],
            "model_flops": flops,
            "mfu": flops / (values["step_time_s"] * self.world * self.peak_flops) if self.peak_flops else None,
            "plan_time_s": values["plan_time_s"],
            # the slowest rank's seconds compiling (torch.compile's new graphs and recompiles); null without compile
            "compile_s": float(per_rank[:, 8].max()) if self.spec.compile else None,
            "attention_time_s": float(per_rank[:, 1].max()) if attention_timed else None,
            "comm_time_s": float(per_rank[:, 2].max()),
            "comm_bytes": int(per_rank[:, 3].sum()),
            "peak_memory_bytes": int(per_rank[:, 4].max()),
            "peak_reserved_bytes": int(per_rank[:, 5].max()) if cuda else None,
            "activation_offload_bytes": int(per_rank[:, 6].max()) if self.runner.offload else None,
            "attention_work_total": float(np.sum(balance.load_local)),  # cost-model units
            "attention_density": float(sparse_sums[3] / sparse_sums[4]) if sparse else None,
            # every rank's served sparse-layer work, measured from the patterns its kernels ran (SparseStats): in
            # pairs, priced as the plans price it (whose spread is the measured balance), and its kernels' seconds
            "sparse_served_pairs": served[0].tolist() if sparse else None,
            "sparse_served_work": served[1].tolist() if sparse else None,
            "sparse_served_kernel_s": served[2].tolist() if sparse else None,
            "sparse_imbalance_measured": served_imbalance(served[1], self.spec.dims) if sparse else None,
            "sparse_imbalance_measured_pairs": served_imbalance(served[0], self.spec.dims) if sparse else None,
            "sparse_imbalance_measured_kernel": served_imbalance(served[2], self.spec.dims) if sparse else None,
            # what this step's plans multiplied the sparse tiles' calibrated prices by (null: the calibration's)
            "sparse_kernel_price_scale": values["sparse_kernel_price_scale"],
            "imbalance_before": balance.imbalance_local,
            "imbalance_after": balance.imbalance_planned,
            "num_docs": sum(b.num_docs for b in micro_batches),
            "longest_doc": int(max(b.doc_lens.max() for b in micro_batches)),
            "nano_batches": [len(unit) for unit in planned.microbatches],
            "skipped_step": not finite,
            "nonfinite_steps": self.nonfinite_total,
        }

    def _checkpoint_if_due(self, end: StepEnd) -> None:
        """A checkpoint every checkpoint_every steps, at the run's last step and where a SIGTERM stops it; never of a
        skipped step (a run that diverges leaves the last good one newest)."""
        config, step = self.config, self.step
        every = config.checkpoint.every
        if end.finite and every >= 0 and (step == config.last_step or end.stop or (every and step % every == 0)):
            save_checkpoint(checkpoint_path(config.run.out, step), self.model, self.optimizer, self.scheduler,
                            self.stream, step, self.extra_state, self.device, config.to_dict(), config.checkpoint.keep)
            if config.checkpoint.hf_exports:
                export_run_model(self.model, self.spec.model, config, self.mesh,
                                 checkpoint_export_dir(config.run.out, step))

    def _refuse_nonfinite_steps(self) -> None:
        """End a run whose last max_nonfinite_steps steps were all skipped."""
        limit = self.config.faults.max_nonfinite_steps
        if self.nonfinite_in_a_row >= limit:
            raise TrainingError(f"step {self.step}: the loss or gradient norm was not finite in "
                                f"{self.nonfinite_in_a_row} steps in a row (max_nonfinite_steps={limit}); their "
                                "updates were skipped, so the weights are those of the last finite step. Lower --lr, "
                                "or clip gradients (--grad-clip)")

    def _say_stopped(self, end: StepEnd) -> None:
        if self.rank != 0:
            return
        config, every = self.config, self.config.checkpoint.every
        saved = f"checkpoint {checkpoint_path(config.run.out, self.step)} written" if end.finite and every >= 0 \
            else "no checkpoint written (checkpoint_every=-1)" if every < 0 else "no checkpoint (a skipped step)"
        print(f"SIGTERM: stopped after step {self.step}, {saved}; --resume continues", flush=True)

    def _report(self, balance: StepPlan | None, wall_s: float) -> dict | None:
        """Rank 0 at the end: summary.json, summary.png and the printed summary."""
        config, spec, dims = self.config, self.spec, self.spec.dims
        if balance is None:
            print(f"nothing to do: the checkpoint is at step {self.step}, the run stops there")
            return None
        memory = self.setup.memory
        checked = memory is not None and self.device.type == "cuda"
        info = {"model": spec.model.name, "params": spec.model.num_params(self.model), "world": self.world,
                "dp": dims.dp, "tp": dims.tp, "pp": dims.pp,
                # the pipeline schedule the run used, and auto's reasons where it chose
                "pp_schedule": spec.pp_schedule if dims.pp > 1 else None,
                "pp_schedule_choice": spec.schedule_choice.to_dict() if spec.schedule_choice is not None else None,
                # the memory model's allocated peak (beside the measured peak_memory_bytes, as attnpool bench gives
                # it) and what the check compared with the GPU's memory: the reserved peak plus the CUDA context
                "predicted_peak_memory_bytes": memory.allocated_bytes if checked else None,
                "predicted_device_bytes": memory.peak_bytes if checked else None,
                "tokens_per_rank": config.data.tokens_per_rank, "microbatches": config.parallel.microbatches,
                "strategy": config.attention.strategy, "layout": config.attention.layout,
                **link_rates(config, spec),  # (cad's price of a byte: the links' rates as planned with)
                "steps": config.optim.steps,
                # what the memory settings resolved to: auto's choice of each layer's mode, and of activation offload
                "activation_checkpointing": config.memory.activation_checkpointing,
                "layer_checkpointing": list(spec.layer_checkpointing) or None,
                "activation_offload": spec.activation_offload,
                "start_step": self.start_step, "end_step": self.step, "wall_s": wall_s}
        loads = {"local": balance.load_local, "planned": balance.load_planned,
                 "unit": getattr(spec.cost_model, "unit", "work")}
        summary = summarize(self.log.rows, loads, info)
        out = config.run.out
        plot = os.path.join(out, PLOT_FILE)
        try:
            with open(os.path.join(out, SUMMARY_FILE), "w") as fh:
                json.dump(summary, fh, indent=1)
            plot_run(self.log.rows, loads, config.attention.strategy, plot)
        except OSError as exc:
            raise storage_error(exc, f"{os.path.join(out, SUMMARY_FILE)} or {plot}") from None
        checkpoint = checkpoint_path(out, self.step)
        print_summary(summary, [self.log.path, plot] + ([checkpoint] if os.path.isdir(checkpoint) else []))
        return summary
