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

from attnpool.comm import under_torchrun
from attnpool.data import DocumentStream
from attnpool.parallel.pipeline import activations_in_flight, rank_layers
from attnpool.parallel.pooled_pipeline import POOLED
from attnpool.plan.metrics import AttentionRows
from attnpool.train.memory import Calibration, Capacity, MemoryEstimate, MemoryInputs, RowRatios, estimate, report, \
    settings, undominated
from attnpool.train.planning import StepPlan, plan_batch, plan_microbatch, plan_pooled_ticks
from attnpool.train.spec import RunSpec

# Batches whose plans bound core attention's buffers in the memory check (the run's first ones).
MEMORY_SAMPLE_BATCHES = 8
ROW_NAMES = ("home", "query", "returned", "unique_kv", "expanded_kv")


def memory_inputs(spec: RunSpec, rows: RowRatios = RowRatios()) -> MemoryInputs:
    """The memory model's view of a run (on CPU runs offload moves nothing, so it counts as off)."""
    c, m, dims = spec.config, spec.model.config, spec.dims
    gpu = spec.device_type == "cuda"
    schedule, pp, microbatches = c.parallel.pp_schedule, dims.pp, c.parallel.microbatches
    stages = rank_layers(m, schedule, pp) if pp > 1 else [0]
    last = rank_layers(m, schedule, pp, pp - 1) if pp > 1 and schedule != POOLED else [0]
    return MemoryInputs(m, c.data.tokens_per_rank, c.memory.activation_checkpointing,
                        c.memory.activation_offload and gpu, c.memory.optimizer_offload and gpu, spec.bf16,
                        dp=dims.dp, tp=dims.tp, pp=pp, microbatches=microbatches,
                        in_flight=activations_in_flight(schedule, pp, microbatches),
                        rows=rows, rank_layers=sum(stages), stage_layers=max(stages), loss_kernel=spec.loss_kernel,
                        layer_modules=spec.model.layer_modules,
                        backward_in_one_call=c.attention.strategy == "ulysses",
                        last_rank_layers=sum(last), last_stage_layers=max(last),
                        last_in_flight=activations_in_flight(schedule, pp, microbatches, pp - 1) if pp > 1 else 0)


def sample_row_ratios(spec: RunSpec, source, batches: int = MEMORY_SAMPLE_BATCHES) -> dict:
    """Core attention's rows per token of tokens_per_rank, from the plans of the run's first ``batches``
    batches (with ping-pong, both nano-batches' rows; with a pooled pipeline, every tick's plan over all
    stages' ranks, of the first ``batches`` steps), as MemoryInputs fields: ``rows``, the largest of each
    count over the plans and dp ranks, and each plan's rank rows that no other matches in every count
    (memory.undominated): ``row_candidates``, or for a pooled pipeline, whose rank holds every tick's
    rows at once, ``held_candidates``: each step's rank rows summed over its ticks. Expanded KV rows are
    counted where the kernel copies prefixes (spec.prefix_copies), and where a layer is sparse (the sparse
    serving copies)."""
    c, dims = spec.config, spec.dims
    if dims.dp == 1 and not spec.pooled:
        return {"rows": RowRatios()}
    stream = DocumentStream(source, dims.dp, c.data.tokens_per_rank, c.data.seed, c.data.max_doc_len)
    prior = spec.new_sparse_prior()
    copies = spec.prefix_copies or spec.sparse is not None
    worst, candidates = np.zeros(len(ROW_NAMES)), []

    def ratios(counts) -> RowRatios:
        return RowRatios(*(counts / c.data.tokens_per_rank).tolist(), batches=batches)

    for _ in range(batches):
        if spec.pooled:  # one unit per tick, each with its own plan's rows
            tables = [plan_batch(stream.next_batch(), spec, prior, strategy="local").plan.pieces
                      for _ in range(c.parallel.microbatches)]
            units = [[AttentionRows.of(t.plan, copies)] for t in plan_pooled_ticks(tables, spec)]
        else:
            units = [[layer_mean_rows(p, spec, copies) for p in plan_microbatch(stream.next_batch(), spec, prior)]]
        # (counts, ranks) of each unit; a pooled rank holds every tick's at once, the others one unit at a time
        per_unit = [np.array([np.sum([getattr(r, name) for r in rows], axis=0) for name in ROW_NAMES])
                    for rows in units]
        worst = np.maximum(worst, np.max([counts.max(axis=1) for counts in per_unit], axis=0))
        for counts in [sum(per_unit)] if spec.pooled else per_unit:
            candidates += [ratios(rank) for rank in counts.T]
    return {"rows": ratios(worst), "held_candidates" if spec.pooled else "row_candidates": undominated(candidates)}


def layer_mean_rows(step: StepPlan, spec: RunSpec, copies: bool) -> AttentionRows:
    """Core attention's rows of a micro-batch's plans, one per layer kind (attnpool.kinds), as one layer's: the
    rows a layer saves for backward (its tokens, outputs returned, unique KV) averaged over the layers, each kind's
    weighted by its share of them; the rows one kernel call holds at once (queries served, the keys it reads,
    copied where the kind's kernel copies prefixes: RunSpec.prefix_copies_of) the largest kind's, as the memory
    model's transients are a call's peak."""
    kinds = Counter(spec.layer_kinds)
    if not step.plans or not kinds:
        return AttentionRows.of(step.plan, copies)
    rows = {kind: AttentionRows.of(step.plans[kind.window], copies or spec.prefix_copies_of(kind)) for kind in kinds}
    total = sum(kinds.values())

    def mean(name):
        return sum(kinds[kind] / total * getattr(r, name) for kind, r in rows.items())

    def largest(name):
        return np.max([getattr(r, name) for r in rows.values()], axis=0)

    return AttentionRows(home=mean("home"), query=largest("query"), returned=mean("returned"),
                         unique_kv=mean("unique_kv"), expanded_kv=largest("expanded_kv"))


def run_memory_inputs(spec: RunSpec, source, capacity: Capacity, calibration: Calibration) -> MemoryInputs:
    """The memory model's inputs for a run, core attention's rows from plans of its first batches (at most
    MEMORY_SAMPLE_BATCHES, and no more than the run trains on). Those are drawn only if, with the fewest
    rows core attention can hold (RowRatios(), a lower bound of the busiest rank's), some memory setting fits:
    a batch far too large is refused before one is drawn."""
    x = memory_inputs(spec)
    if any(capacity.holds(estimate(s, calibration)) for s in settings(x, offloads=spec.device_type == "cuda")):
        # A run shorter than the sample plans no more batches than it draws (from the stream's start, also
        # when it resumes later on); a pooled pipeline's sample is of steps, the others' of micro-batches.
        steps = spec.config.last_step
        run_batches = steps if spec.pooled else steps * spec.config.parallel.microbatches
        x = replace(x, **sample_row_ratios(spec, source, batches=min(MEMORY_SAMPLE_BATCHES, run_batches)))
    return x


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def ranks_on_this_machine(spec: RunSpec) -> int:
    """The ranks sharing this machine's memory: torchrun's LOCAL_WORLD_SIZE, else all of them under torchrun, else
    the processes the built-in launcher starts."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", spec.dims.world if under_torchrun() else spec.config.run.nproc))


def check_memory(spec: RunSpec, source) -> MemoryEstimate:
    """The predicted peak of this rank (attnpool.train.memory), refused with the field to change where it does
    not fit: on GPU the device's memory (with the packaged calibration) and, for offloaded state, this
    machine's memory shared by its ranks; on CPU that shared memory alone (the hand count alone)."""
    device, gpu = spec.device, spec.device_type == "cuda"
    local_ranks = ranks_on_this_machine(spec)
    host = host_memory_bytes() // local_ranks
    for_each = f" for each of its {local_ranks} ranks" if local_ranks > 1 else ""
    if gpu:
        calibration = Calibration.load()
        capacity = Capacity(torch.cuda.get_device_properties(device).total_memory, torch.cuda.get_device_name(device),
                            host)
    else:
        calibration, capacity = Calibration.none(), Capacity(host, "this machine's memory" + for_each)
    x = run_memory_inputs(spec, source, capacity, calibration)
    predicted = estimate(x, calibration)
    if not capacity.holds(predicted):
        raise report(x, capacity, calibration, offloads=gpu).refusal()
    return predicted
