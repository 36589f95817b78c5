"""``pp_schedule: auto``: 1F1B or the pooled schedule, whichever the simulator predicts faster for the run.

The pooled schedule (attnpool.parallel.pooled_pipeline) serves core attention in the pipeline's bubbles, but
runs its stages in lock-step with equal layers (the last stage's output projection is not balanced away) and
moves more bytes: on one NVLink node with prolong's documents it measured 10% slower than 1F1B (4 x H200,
bench/results/2026-11-26-h200x4-parallel.md), where long documents (pretrain) make it faster. ``auto`` asks the
simulator (attnpool.sim.pipeline, which models both as they run) on the run's own first batches and takes pooled
only where it predicts at least ``AUTO_POOLED_GAIN`` over 1F1B, where pooled can run at all, and, on a rank, where
its memory holds pooled's activations (it keeps every tick's until the backward). Every rank draws the same
batches and decides alike (and ``same_schedule`` checks it before the first step); the choice and its reason go to
the run's start and its summary. The simulator prices with its packaged H200 table of the flash kernel, whatever
kernel the run resolves to and at the model's FLOPs whatever its head_dim: what it compares is two schedules of the
same work, and a launcher, ``attnpool memory`` and the ranks must come to the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from attnpool.data import DocumentStream
from attnpool.errors import ConfigError
from attnpool.parallel.pooled_pipeline import pooled_problem
from attnpool.plan.stages import AUTO_SCHEDULE, POOLED
from attnpool.sim.costs import load_sim_costs
from attnpool.sim.pipeline import simulate_pipeline
from attnpool.sim.simulate import MIN_EPS, SimConfig
from attnpool.sizes import format_bytes
from attnpool.train.memory import estimate
from attnpool.train.memory_check import resolve_auto_checkpointing, run_memory_inputs
from attnpool.train.memory_fit import Capacity
from attnpool.train.spec import RunSpec, ranks_per_node

AUTO_POOLED_GAIN = 0.05  # pooled must be predicted at least this much faster than 1F1B
FALLBACK = "1f1b"
CHOICE_STEPS = 2  # steps of the run's first micro-batches the simulator times (fewer where the run is shorter)
# The kernel table the simulator prices with, whatever kernel the run resolves to: a launcher, `attnpool memory` and
# the ranks (where "auto" may become fa4) must choose alike, and what it compares is two schedules of the same work
PRICED_WITH = "flash"
# The simulator's recompute for a checkpointing mode (auto's choice comes later; under pooled it is one of these)
RECOMPUTE = {"none": "none", "keep_attention": "linear", "auto": "linear"}


@dataclass(frozen=True)
class ScheduleChoice:
    chosen: str
    why: str
    predicted_step_s: dict  # schedule -> the simulator's mean step (empty where it was not asked)

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "why": self.why, "predicted_step_s": dict(self.predicted_step_s)}


def resolve_pp_schedule(spec: RunSpec, source) -> RunSpec:
    """``spec`` with ``pp_schedule: auto`` resolved (:func:`choose_schedule`); a spec that names a schedule is
    returned as it is."""
    if spec.config.parallel.pp_schedule != AUTO_SCHEDULE or spec.schedule_choice is not None:
        return spec
    return replace(spec, schedule_choice=choose_schedule(spec, source))


def pooled_obstacle(spec: RunSpec) -> str | None:
    """Why ``auto`` cannot take the pooled schedule for this run, or None."""
    c = spec.config
    if spec.dims.pp == 1:
        return "one pipeline stage"
    if c.attention.strategy != "cad":
        return f"pooling balances cad's CA-tasks over the stages, and attention is {c.attention.strategy}"
    problem = pooled_problem(c.memory.activation_checkpointing, c.sparse.mode != "none")
    if problem is not None:
        return f"{problem[0]}={problem[1]}: {problem[2]}"
    if spec.mixed_kinds:
        return "the pooled schedule plans causal attention only, and the model's layers differ in kind"
    if c.parallel.hierarchical_exchange:
        return "hierarchical_exchange: the pooled schedule's attention spans every stage's ranks and exchanges flat"
    return None


def choose_schedule(spec: RunSpec, source) -> ScheduleChoice:
    """1F1B or pooled for ``spec``'s run, as the simulator predicts on its first micro-batches."""
    obstacle = pooled_obstacle(spec)
    if obstacle is not None:
        return ScheduleChoice(FALLBACK, obstacle, {})
    c, dims = spec.config, spec.dims
    microbatches = c.parallel.microbatches
    steps = max(1, min(CHOICE_STEPS, c.last_step))
    stream = DocumentStream(source, dims.dp, c.data.tokens_per_rank, c.data.seed, c.data.max_doc_len)
    batches = [stream.next_batch().doc_lens.tolist() for _ in range(steps * microbatches)]
    per_node = ranks_per_node(c, dims.world)
    cfg = spec.model.config
    # (a dp rank's tokens are padded to a multiple of tp; the simulator's smallest eps stands in for one below it)
    config = SimConfig(model=c.model.name, gpus=dims.world, tp=dims.tp, gpus_per_node=per_node,
                       tokens_per_gpu=-(-c.data.tokens_per_rank // dims.tp), eps=max(c.attention.eps, MIN_EPS),
                       strategies=("cad",), batches=len(batches), recompute=RECOMPUTE[c.memory.activation_checkpointing])
    costs = load_sim_costs(cfg, c.model.name, attention_backend=PRICED_WITH, min_shard_tokens=c.attention.min_shard,
                           any_head_dim=True)
    result = simulate_pipeline(config, dims.pp, microbatches, steps, FALLBACK, costs=costs, doc_batches=batches,
                               model_cfg=cfg)
    one_f_one_b, pooled = result["strategies"]["cad-serial"]["step_s"], result["pooled"]["step_s"]
    predicted = {FALLBACK: one_f_one_b, POOLED: pooled}
    gain = 1 - pooled / one_f_one_b
    said = (f"the simulator on the run's first {len(batches)} micro-batches: pooled {pooled:.3g} s a step against "
            f"1f1b's {one_f_one_b:.3g} s ({gain:+.1%}")
    if gain >= AUTO_POOLED_GAIN:
        return ScheduleChoice(POOLED, f"{said})", predicted)
    return ScheduleChoice(FALLBACK, f"{said}; pooled needs at least {AUTO_POOLED_GAIN:.0%})", predicted)


def keep_pooled_if_it_fits(spec: RunSpec, source, capacity: Capacity, calibration) -> RunSpec:
    """``pp_schedule: auto``'s pooled choice, given up for 1F1B where ``capacity`` (every rank's smallest: the
    ranks decide alike) cannot hold pooled's activations, one tick's per layer slot until the backward; any other
    spec as it is."""
    if not spec.pooled or spec.schedule_choice is None:
        return spec
    try:
        resolved, sampled = resolve_auto_checkpointing(spec, source, capacity, calibration)
        predicted = estimate(run_memory_inputs(resolved, source, capacity, calibration, sampled), calibration)
    except ConfigError as error:  # auto checkpointing found no setting that fits
        return without_pooled(spec, f"no checkpointing fits its activations ({error.problem})")
    if capacity.holds(predicted):
        return spec
    return without_pooled(spec, f"its activations would not fit ({format_bytes(predicted.peak_bytes)} predicted, "
                                f"{format_bytes(capacity.device_bytes)} held)")


def without_pooled(spec: RunSpec, why: str) -> RunSpec:
    """``spec`` with auto's pooled choice given up for 1F1B (the rank's memory cannot hold it: ``why``)."""
    choice = spec.schedule_choice
    return replace(spec, schedule_choice=ScheduleChoice(FALLBACK, f"{choice.why}; but {why}", choice.predicted_step_s))


def same_schedule(spec: RunSpec) -> None:
    """Refuse, on every rank, a run whose ranks resolved ``pp_schedule: auto`` differently (their pooled ticks and
    1F1B's hand-overs would wait on each other forever). A collective over the default process group."""
    import torch.distributed as dist

    schedules = [None] * dist.get_world_size()
    dist.all_gather_object(schedules, spec.pp_schedule)
    if len(set(schedules)) > 1:
        found = ", ".join(f"rank {r}: {s}" for r, s in enumerate(schedules))
        raise ConfigError("pp_schedule", AUTO_SCHEDULE, f"the ranks chose different schedules ({found}); name one")

