"""The memory check: a run's predicted peak per rank (attnpool.train.memory) from its run spec and the plans of
its first batches, refused before anything is allocated where it does not fit. ``attnpool memory`` shows the
same prediction, from the same spec, so what it says and what a run checks cannot disagree.
"""

from __future__ import annotations

from collections import Counter

import os
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from attnpool.comm import under_torchrun
from attnpool.errors import ConfigError
from attnpool.data import DocumentStream
from attnpool.parallel.pipeline import activations_in_flight, rank_layers
from attnpool.parallel.pooled_pipeline import POOLED
from attnpool.plan.metrics import AttentionRows
from attnpool.runtime.dispatch import MAX_CAUSAL_CALL_SEGMENTS
from attnpool.plan.cost import attention_flops
from attnpool.plan.documents import window_pairs
from attnpool.sizes import format_bytes
from attnpool.train.flops import linear_weights
from attnpool.train.memory import AUTO, Calibration, MemoryEstimate, MemoryInputs, RowRatios, estimate, undominated
from attnpool.train.memory_fit import Capacity, auto_checkpointing, report, settings
from attnpool.train.planning import StepPlan, plan_batch, plan_microbatch, plan_pooled_ticks
from attnpool.train.config import TrainConfig
from attnpool.train.spec import RunSpec

# Batches whose plans bound core attention's buffers in the memory check (the run's first ones).
MEMORY_SAMPLE_BATCHES = 8
ROW_NAMES = ("home", "query", "returned", "unique_kv", "expanded_kv")
# The MemoryInputs fields sample_row_ratios fills
SAMPLED_FIELDS = ("rows", "row_candidates", "held_candidates")


def memory_inputs(spec: RunSpec, rows: RowRatios = RowRatios()) -> MemoryInputs:
    """The memory model's view of a run (on CPU runs offload moves nothing, so it counts as off)."""
    c, m, dims = spec.config, spec.model.config, spec.dims
    gpu = spec.device_type == "cuda"
    schedule, pp, microbatches = spec.pp_schedule, dims.pp, c.parallel.microbatches
    stages = rank_layers(m, schedule, pp) if pp > 1 else [0]
    last = rank_layers(m, schedule, pp, pp - 1) if pp > 1 and schedule != POOLED else [0]
    layers = sum(stages) or m.n_layers
    return MemoryInputs(m, c.data.tokens_per_rank, c.memory.activation_checkpointing,
                        spec.activation_offload and gpu, c.memory.optimizer_offload and gpu, spec.bf16,
                        dp=dims.dp, tp=dims.tp, pp=pp, microbatches=microbatches,
                        in_flight=activations_in_flight(schedule, pp, microbatches),
                        rows=rows, rank_layers=sum(stages), stage_layers=max(stages), loss_kernel=spec.loss_kernel,
                        layer_modules=spec.model.layer_modules, compiled=spec.compile,
                        backward_in_one_call=c.attention.strategy == "ulysses",
                        last_rank_layers=sum(last), last_stage_layers=max(last),
                        last_in_flight=activations_in_flight(schedule, pp, microbatches, pp - 1) if pp > 1 else 0,
                        # auto's choice (one mode for every layer under pipeline stages: the first rank's count)
                        layer_modes=spec.layer_checkpointing[:layers])


def sample_row_ratios(spec: RunSpec, source, batches: int = MEMORY_SAMPLE_BATCHES) -> dict:
    """Core attention's rows per token of tokens_per_rank, from the plans of the run's first ``batches``
    batches (with ping-pong, both nano-batches' rows; with a pooled pipeline, every tick's plan over all
    stages' ranks, of the first ``batches`` steps), as MemoryInputs fields: ``rows``, the largest of each
    count over the plans and dp ranks, and each plan's rank rows that no other matches in every count
    (memory.undominated): ``row_candidates``, or for a pooled pipeline, whose rank holds every tick's
    rows at once, ``held_candidates``: each step's rank rows summed over its ticks. Expanded KV rows are
    counted where the kernel copies prefixes (spec.prefix_copies: where a document would take a position call, or
    may, plan.metrics.AttentionRows), and every one where a layer is sparse (the sparse serving always copies)."""
    c, dims = spec.config, spec.dims
    if dims.dp == 1 and not spec.pooled:
        return {"rows": RowRatios()}
    stream = DocumentStream(source, dims.dp, c.data.tokens_per_rank, c.data.seed, c.data.max_doc_len)
    prior = spec.new_sparse_prior()
    copies = spec.prefix_copies or spec.sparse is not None
    causal_calls = 0 if spec.sparse is not None else MAX_CAUSAL_CALL_SEGMENTS  # (the sparse serving makes none)
    worst, candidates = np.zeros(len(ROW_NAMES)), []

    def ratios(counts) -> RowRatios:
        return RowRatios(*(counts / c.data.tokens_per_rank).tolist(), batches=batches)

    for _ in range(batches):
        if spec.pooled:  # one unit per tick, each with its own plan's rows
            tables = [plan_batch(stream.next_batch(), spec, prior, strategy="local").plan.pieces
                      for _ in range(c.parallel.microbatches)]
            units = [[slot_mean_rows(tick, copies, causal_calls)] for tick in plan_pooled_ticks(tables, spec)]
        else:
            units = [[layer_mean_rows(p, spec, copies, causal_calls)
                      for p in plan_microbatch(stream.next_batch(), spec, prior)]]
        # (counts, ranks) of each unit; a pooled rank holds every tick's at once, the others one unit at a time
        per_unit = [np.array([np.sum([getattr(r, name) for r in rows], axis=0) for name in ROW_NAMES])
                    for rows in units]
        worst = np.maximum(worst, np.max([counts.max(axis=1) for counts in per_unit], axis=0))
        for counts in [sum(per_unit)] if spec.pooled else per_unit:
            candidates += [ratios(rank) for rank in counts.T]
    return {"rows": ratios(worst), "held_candidates" if spec.pooled else "row_candidates": undominated(candidates)}


def attention_rows(plan, copies: bool, causal_calls: int = MAX_CAUSAL_CALL_SEGMENTS) -> AttentionRows:
    """plan.metrics.AttentionRows as the runtime serves ``plan``: a server's documents of at most ``causal_calls``
    segments as a causal call per segment (runtime.dispatch.DocumentServing; 0 for the sparse serving, which copies
    every prefix)."""
    return AttentionRows.of(plan, copies, causal_call_segments=causal_calls)


def slot_mean_rows(tick: list[StepPlan | None], copies: bool,
                   causal_calls: int = MAX_CAUSAL_CALL_SEGMENTS) -> AttentionRows:
    """A pooled tick's rows per layer slot: what a rank keeps, averaged over its slots (a rank keeps every slot's,
    its layers' and the queries it serves, until the tick's backward; a slot where no rank has tokens holds none),
    and the keys one kernel call reads, the most of any slot."""
    rows = [attention_rows(slot.plan, copies, causal_calls) for slot in tick if slot is not None]
    per_call = ("expanded_kv",)
    return AttentionRows(**{name: np.max([getattr(r, name) for r in rows], axis=0) if name in per_call
                            else sum(getattr(r, name) for r in rows) / len(tick) for name in ROW_NAMES})


def layer_mean_rows(step: StepPlan, spec: RunSpec, copies: bool,
                    causal_calls: int = MAX_CAUSAL_CALL_SEGMENTS) -> AttentionRows:
    """Core attention's rows of a micro-batch's plans, one per layer kind (attnpool.kinds), as one layer's: the
    rows a layer saves for backward (its tokens, outputs returned, unique KV) averaged over the layers, each kind's
    weighted by its share of them; the rows one kernel call holds at once (queries served, the keys it reads,
    copied where the kind's kernel copies prefixes: RunSpec.prefix_copies_of) the largest kind's, as the memory
    model's transients are a call's peak."""
    kinds = Counter(spec.layer_kinds)
    if not step.plans or not kinds:
        return attention_rows(step.plan, copies, causal_calls)
    rows = {kind: attention_rows(step.plans[kind.window], copies or spec.prefix_copies_of(kind), causal_calls)
            for kind in kinds}
    total = sum(kinds.values())

    def mean(name):
        return sum(kinds[kind] / total * getattr(r, name) for kind, r in rows.items())

    def largest(name):
        return np.max([getattr(r, name) for r in rows.values()], axis=0)

    return AttentionRows(home=mean("home"), query=largest("query"), returned=mean("returned"),
                         unique_kv=mean("unique_kv"), expanded_kv=largest("expanded_kv"))


def sampled_batches(spec: RunSpec) -> int:
    """How many of the run's first batches the memory model samples: MEMORY_SAMPLE_BATCHES, and no more than the run
    draws (from the stream's start, also when it resumes later on; a pooled pipeline's sample is of steps, the
    others' of micro-batches)."""
    steps = spec.config.last_step
    return min(MEMORY_SAMPLE_BATCHES, steps if spec.pooled else steps * spec.config.parallel.microbatches)


def attention_share(spec: RunSpec, source) -> float:
    """Core attention's forward FLOPs over the linear parts' in one layer (the mean over the model's layer kinds),
    over the run's first batches: what recomputing a layer whole costs beyond recomputing its linear parts
    (memory_fit.auto_checkpointing). Dense attention's: a sparse layer's recompute costs less."""
    c, m = spec.config, spec.model.config
    stream = DocumentStream(source, spec.dims.dp, c.data.tokens_per_rank, c.data.seed, c.data.max_doc_len)
    lens = np.concatenate([stream.next_batch().doc_lens for _ in range(sampled_batches(spec))])
    kinds = m.layer_kinds()
    pairs = sum(float(np.sum(window_pairs(0 * lens, lens, kind.window))) for kind in kinds) / len(kinds)
    return float(attention_flops(pairs, m.n_heads, m.head_dim, "fwd")) / (2.0 * linear_weights(m) * float(lens.sum()))


def choose_checkpointing(spec: RunSpec, x: MemoryInputs, source, capacity: Capacity,
                         calibration: Calibration) -> MemoryInputs:
    """The run's memory inputs ``x`` (run_memory_inputs) with what ``activation_checkpointing: auto`` chooses for
    ``capacity``: each layer's mode and, on a GPU, activation offload where it costs less than recompute
    (memory_fit.auto_checkpointing). Refused with the field to change where even the most recompute does not fit."""
    gpu, headroom = spec.device_type == "cuda", spec.config.memory.auto_headroom
    runs = ("none", "keep_attention") if spec.pooled else None  # (a pooled schedule recomputes no core attention)
    chosen = auto_checkpointing(x, capacity, calibration, attention_share(spec, source), offload=gpu, runs=runs,
                                headroom=headroom)
    if chosen is not None:
        return chosen
    slowest = report(replace(x, activation_checkpointing="keep_attention" if spec.pooled else "full"), capacity,
                     calibration, offloads=gpu)
    if not slowest.fits:
        raise slowest.refusal()
    raise ConfigError("auto_headroom", headroom, f"no choice of layers leaves {headroom:.0%} of the "
                                                 f"{format_bytes(capacity.device_bytes)} of {capacity.device_name} "
                                                 f"free: {slowest.configured.inputs.setting} would hold "
                                                 f"{format_bytes(slowest.configured.estimate.peak_bytes)}; lower "
                                                 "auto_headroom, or name that mode")


def resolve_auto_checkpointing(spec: RunSpec, source, capacity: Capacity,
                               calibration: Calibration) -> tuple[RunSpec, dict | None]:
    """``spec`` with ``activation_checkpointing: auto`` resolved for ``capacity`` (choose_checkpointing): each
    layer's mode, by layer index, and whether activation offload is turned on; and the core-attention rows sampled
    for it (MemoryInputs fields: the memory check takes them as they are, run_memory_inputs). A spec that names one
    mode is returned as it is, with nothing sampled (None)."""
    if spec.config.memory.activation_checkpointing != AUTO or spec.layer_checkpointing:
        return spec, None
    x = run_memory_inputs(spec, source, capacity, calibration)
    chosen = choose_checkpointing(spec, x, source, capacity, calibration)
    n_layers = spec.model.config.n_layers
    modes = chosen.layer_modes if spec.dims.pp == 1 else chosen.layer_modes[:1] * n_layers
    return (replace(spec, layer_checkpointing=tuple(modes),
                    auto_offload=chosen.activation_offload and not spec.config.memory.activation_offload),
            {name: getattr(x, name) for name in SAMPLED_FIELDS})


def run_memory_inputs(spec: RunSpec, source, capacity: Capacity, calibration: Calibration,
                      sampled: dict | None = None) -> MemoryInputs:
    """The memory model's inputs for a run, core attention's rows from plans of its first batches (at most
    MEMORY_SAMPLE_BATCHES, and no more than the run trains on). Those are drawn only if, with the fewest
    rows core attention can hold (RowRatios(), a lower bound of the busiest rank's), some memory setting fits:
    a batch far too large is refused before one is drawn. ``sampled``: rows already drawn for this spec's batches
    (resolve_auto_checkpointing's), taken as they are."""
    x = memory_inputs(spec)
    if sampled is not None:
        return replace(x, **sampled)
    if any(capacity.holds(estimate(s, calibration)) for s in settings(x, offloads=spec.device_type == "cuda")):
        x = replace(x, **sample_row_ratios(spec, source, batches=sampled_batches(spec)))
    return x


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def ranks_on_this_machine(config: TrainConfig, world: int) -> int:
    """The ranks sharing this machine's memory: torchrun's LOCAL_WORLD_SIZE, else all ``world`` under torchrun, else
    the processes the built-in launcher starts."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world if under_torchrun() else config.run.nproc))


def rank_capacity(device: torch.device, local_ranks: int) -> tuple[Capacity, Calibration]:
    """What a rank on ``device`` may use, with ``local_ranks`` ranks on its machine, and the calibration its
    prediction takes: on GPU the device's memory (with the packaged calibration) and, for offloaded state, this
    machine's memory shared by its ranks; on CPU that shared memory alone (the hand count and each process's own memory)."""
    host = host_memory_bytes() // local_ranks
    for_each = f" for each of its {local_ranks} ranks" if local_ranks > 1 else ""
    if device.type == "cuda":
        return Capacity(torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device),
                        host), Calibration.load()
    return Capacity(host, "this machine's memory" + for_each, shared_by_ranks=True), Calibration.cpu()


def smallest_capacity(config: TrainConfig, world: int, device: torch.device) -> Capacity:
    """The smallest of every rank's capacity (rank_capacity; device and host memory apart): what
    ``activation_checkpointing: auto`` chooses for, so that every rank checkpoints its layers alike. (A rank that
    recomputes a layer whole runs core attention's exchanges again in backward, which the other ranks must join.)
    A collective over the default process group: every rank calls it, before anything it could refuse."""
    mine, _ = rank_capacity(device, ranks_on_this_machine(config, world))
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    hosts = [c.host_bytes for c in everyone if c.host_bytes is not None]
    return replace(min(everyone, key=lambda c: c.device_bytes), host_bytes=min(hosts) if hosts else None)


def check_memory(spec: RunSpec, source, sampled: dict | None = None) -> MemoryEstimate:
    """The predicted peak of this rank (attnpool.train.memory), refused with the field to change where it does
    not fit its capacity (rank_capacity). ``sampled``: core attention's rows, where already drawn
    (run_memory_inputs)."""
    capacity, calibration = rank_capacity(spec.device, ranks_on_this_machine(spec.config, spec.dims.world))
    gpu = spec.device_type == "cuda"
    x = run_memory_inputs(spec, source, capacity, calibration, sampled)
    if x.activation_checkpointing == AUTO and not x.layer_modes:  # (setup.prepare resolves a rank's spec first)
        raise ValueError("activation_checkpointing auto: resolve the run spec (resolve_auto_checkpointing) first")
    predicted = estimate(x, calibration)
    if not capacity.holds(predicted):
        raise report(x, capacity, calibration, offloads=gpu).refusal()
    return predicted
