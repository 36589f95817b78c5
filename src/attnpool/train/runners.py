"""Step runners: how one step's micro-batches run forward and backward on this rank, behind one interface.

    runner = build_runner(spec, mesh)             # this rank's model (or pipeline stages), parallelized
    planned = runner.plan(micro_batches, prior)   # every micro-batch's layout and plans, the same on every rank
    outcome = runner.run(planned, label_tokens, stats)

- :class:`PlainRunner` (dp x tp): each micro-batch's forward and backward in turn, FSDP2 reducing the
  gradients after the last; with ping-pong, a micro-batch's nano-batches interleaved layer by layer
  (attnpool.parallel.pingpong).
- :class:`ScheduleRunner`: torch.distributed.pipelining's schedules over this rank's stages
  (attnpool.parallel.pipeline).
- :class:`PooledRunner`: the pooled schedule (attnpool.parallel.pooled_pipeline), its ticks' core attention
  planned over every stage's ranks.

Each rank's summed token loss is divided by the global batch's label tokens before backward, and FSDP2 sums
gradients over ranks (attnpool.parallel.parallelize), so the gradient is that of the mean loss over every real
token of the global batch, however the tokens are spread.
"""

from __future__ import annotations

import contextlib
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from attnpool.data import GlobalBatch, RankTensors
from attnpool.parallel import RankMesh, parallelize
from attnpool.parallel.pipeline import PipelineRunner, build_stage_models, merged_stages, sum_tied_gradients
from attnpool.parallel.pooled_pipeline import PooledPipelineRunner
from attnpool.plan import linear_table
from attnpool.plan.stages import pooled_slots
from attnpool.runtime import CoreAttention, LayerKinds, attention_for
from attnpool.runtime.sparse import SparseStats
from attnpool.sparse.cost import SparsePrior
from attnpool.train.memory import saved_bytes_per_layer
from attnpool.train.memory_check import memory_inputs
from attnpool.train.metrics import AttentionTimer
from attnpool.train.offload import ActivationOffload
from attnpool.train.planning import StepPlan, combine_plans, plan_microbatch, plan_pooled_ticks
from attnpool.train.spec import RunSpec


@dataclass
class PlannedStep:
    microbatches: list[list[StepPlan]]  # per micro-batch, per nano-batch: the layouts (and plans) that run
    balance: StepPlan  # the step's per-rank attention loads, served at home against planned
    ticks: list[list[StepPlan | None]] | None = None  # a pooled pipeline's plans, per tick and layer slot


@dataclass
class StepOutcome:
    loss_sum: torch.Tensor  # this rank's summed token loss (0 off a pipeline's last stage)
    timers: list[AttentionTimer]  # core attention's, where it has a time of its own (not interleaved)

    @property
    def timed(self) -> bool:
        return bool(self.timers)

    def attention_seconds(self) -> float:
        """Core attention's time, forward and backward, over every layer (waits for the GPU); NaN untimed."""
        return sum(t.seconds() for t in self.timers) if self.timers else float("nan")


def build_model(spec: RunSpec, mesh: RankMesh | None = None) -> nn.Module:
    """This rank's model: built by its spec, parallelized over ``mesh`` (attnpool.parallel.parallelize), then
    given its weights' values (seeded: every layout starts from the same weights)."""
    torch.manual_seed(spec.config.data.seed)
    return _materialized(spec, parallelize(spec.model.build(spec.device), spec, mesh))


def build_stages(spec: RunSpec, mesh: RankMesh) -> tuple[list[int], list[nn.Module]]:
    """This pipeline rank's stages (attnpool.parallel.pipeline) of the model :func:`build_model` builds, each
    parallelized as it parallelizes the whole model."""
    torch.manual_seed(spec.config.data.seed)
    stage_ids, stages = build_stage_models(spec.model.build(spec.device), spec.pp_schedule,
                                           spec.dims.pp, mesh.pp_rank)
    return stage_ids, [_materialized(spec, parallelize(stage, spec, mesh)) for stage in stages]


def _materialized(spec: RunSpec, model: nn.Module) -> nn.Module:
    storage = torch.device("cpu") if spec.optimizer_offload else spec.device
    spec.model.materialize(model, spec.device, spec.config.data.seed, storage)
    return model


@contextlib.contextmanager
def step_context(device_type: str, bf16: bool, vocab_parallel: bool):
    """What a training step's forward and backward run under: bf16 autocast, and with tensor parallelism
    PyTorch's ``loss_parallel`` (the logits are split by vocabulary)."""
    with loss_parallel() if vocab_parallel else nullcontext(), \
            torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
        yield


def forward_backward(model: nn.Module, batches: list[RankTensors], attentions: list, global_label_tokens: int,
                     bf16: bool = False, offload: ActivationOffload | None = None,
                     vocab_parallel: bool = False) -> torch.Tensor:
    """Forward and backward of this rank's tokens; returns the rank's summed token loss (detached).

    One batch with its core attention, or (ping-pong) several nano-batches, interleaved. The rank
    back-propagates its summed loss / the global batch's label tokens. With ``offload``, what the forward
    saves for backward waits in host memory. ``vocab_parallel`` (tensor parallelism): the logits are split by
    vocabulary over the tp ranks, and the cross-entropy, forward and backward, is PyTorch's ``loss_parallel``;
    every tp rank gets the whole loss.
    """
    with step_context(batches[0].tokens.device.type, bf16, vocab_parallel):
        with offload or nullcontext():
            if len(batches) == 1:
                losses = [model(batches[0].tokens, batches[0].positions, attentions[0], labels=batches[0].labels)]
            else:  # ping-pong's nano-batches (attnpool.parallel.pingpong, applied by parallelize)
                losses = model([b.tokens for b in batches], [b.positions for b in batches], attentions,
                               labels=[b.labels for b in batches])
        loss_sum = sum(losses)  # summed token cross-entropy, computed in chunks inside the model
        (loss_sum / global_label_tokens).backward()
    loss_sum = loss_sum.detach()
    return loss_sum.full_tensor() if isinstance(loss_sum, DTensor) else loss_sum


class StepRunner:
    """This rank's model and how a step runs on it (see the module docstring). ``model`` is what checkpoints and
    the optimizer see (a pipeline rank's stages merged)."""

    model: nn.Module

    def __init__(self, spec: RunSpec, mesh: RankMesh):
        self.spec, self.mesh, self.device = spec, mesh, spec.device
        self.offload = None
        if spec.activation_offload:  # prefetch in backward: one layer's saved activations ahead
            self.offload = ActivationOffload(spec.device, prefetch_bytes=saved_bytes_per_layer(memory_inputs(spec)))
        # With ping-pong or head groups, the exchanges inside compute (sparse patterns, the hierarchical exchange's
        # forwarding) get a communicator of their own (CoreAttention.pattern_group).
        inside = spec.sparse or spec.relay_nodes is not None
        overlapped = spec.pingpong or spec.head_chunks > 1
        self.pattern_group = mesh.new_attention_group() if inside and overlapped else None

    def plan(self, micro_batches: list[GlobalBatch], prior: SparsePrior | None = None) -> PlannedStep:
        """Every micro-batch's plans (a plan per nano-batch with ping-pong), made at the start of the step."""
        units = [plan_microbatch(batch, self.spec, prior) for batch in micro_batches]
        return PlannedStep(units, combine_plans([p for unit in units for p in unit]))

    def run(self, planned: PlannedStep, label_tokens: int, stats: SparseStats) -> StepOutcome:
        raise NotImplementedError

    @property
    def counted_params(self) -> list[nn.Parameter]:
        """The parameters the gradient norm counts: every one this rank holds, a copy of another rank's once."""
        return list(self.model.parameters())

    def _tensors(self, planned: PlannedStep) -> list[list[RankTensors]]:
        """This dp rank's tokens, positions and labels of every unit, on the device."""
        return [[p.batch.rank_batch(p.plan.pieces, self.mesh.dp_rank).to_torch(self.device) for p in unit]
                for unit in planned.microbatches]

    def _attentions(self, planned: PlannedStep, stats: SparseStats) -> list[list]:
        """Every unit's core attention over its dp ranks; timed where a micro-batch is one unit (ping-pong's
        interleaved phases leave core attention no wall time of its own)."""
        s = self.spec

        def attention(plan, softcap=None):
            return attention_for(plan, self.mesh.attention_group, backend=s.backend, sparse=s.sparse,
                                 sparse_stats=stats, pattern_group=self.pattern_group, softcap=softcap,
                                 relay_nodes=s.relay_nodes, head_chunks=s.head_chunks)

        if s.mixed_kinds:  # each layer runs its kind's plan
            attentions = [[LayerKinds(s.layer_kinds, p.plans, attention) for p in unit]
                          for unit in planned.microbatches]
        else:
            attentions = [[attention(p.plan) for p in unit] for unit in planned.microbatches]
        if all(len(unit) == 1 for unit in attentions):
            return [[AttentionTimer(unit[0], self.device)] for unit in attentions]
        return attentions

    def _step_context(self):
        return step_context(self.device.type, self.spec.bf16, self.spec.dims.tp > 1)


def _timers(attentions: list[list]) -> list[AttentionTimer]:
    return [a for unit in attentions for a in unit if isinstance(a, AttentionTimer)]


class PlainRunner(StepRunner):
    def __init__(self, spec: RunSpec, mesh: RankMesh):
        super().__init__(spec, mesh)
        self.model = build_model(spec, mesh)

    def run(self, planned: PlannedStep, label_tokens: int, stats: SparseStats) -> StepOutcome:
        tensors, attentions = self._tensors(planned), self._attentions(planned, stats)
        loss_sum, last = 0.0, len(tensors) - 1
        for i, (unit_tensors, unit_attentions) in enumerate(zip(tensors, attentions)):
            if last > 0:  # FSDP2 reduces gradients once, after the last micro-batch
                self.model.set_requires_gradient_sync(i == last)
            loss_sum = loss_sum + forward_backward(self.model, unit_tensors, unit_attentions, label_tokens,
                                                   self.spec.bf16, self.offload, self.spec.dims.tp > 1)
        return StepOutcome(loss_sum, _timers(attentions))


class _StagedRunner(StepRunner):
    """A pipeline rank's stages and a schedule that takes the whole step's micro-batches at once."""

    pipeline: PipelineRunner | PooledPipelineRunner

    def __init__(self, spec: RunSpec, mesh: RankMesh):
        super().__init__(spec, mesh)
        self.stage_ids, self.stages = build_stages(spec, mesh)
        self.model = merged_stages(self.stages)
        # A tied embedding has a copy on the last stage (parallel.pipeline.as_stage): their gradients are summed.
        self.tied_group = mesh.tied_embedding_group() if spec.model.config.tie_embeddings else None

    @property
    def counted_params(self) -> list[nn.Parameter]:
        params = list(self.model.parameters())
        if self.tied_group is not None and 0 not in self.stage_ids:  # the last stage's copy of the embedding
            params = [p for p in params if p is not self.model.embed.weight]
        return params

    def _run_schedule(self, planned: PlannedStep, attentions, label_tokens: int) -> torch.Tensor:
        """The schedule's step over this dp rank's micro-batches: the loss shares of the step's mean, summed back
        into token losses for the log."""
        tensors = [unit[0] for unit in self._tensors(planned)]
        with self._step_context(), self.offload or nullcontext():
            loss = self.pipeline.step([t.tokens for t in tensors], [t.positions for t in tensors],
                                      [t.labels for t in tensors], attentions, 1.0 / label_tokens) * label_tokens
        if self.tied_group is not None:
            sum_tied_gradients(self.model, self.tied_group)
        return loss


class ScheduleRunner(_StagedRunner):
    def __init__(self, spec: RunSpec, mesh: RankMesh):
        super().__init__(spec, mesh)
        self.pipeline = PipelineRunner.build(self.stage_ids, self.stages, spec.pp_schedule,
                                             spec.config.parallel.microbatches, spec.padded_tokens, spec.stage_hidden,
                                             spec.compute_dtype, spec.device, mesh.pp_group)

    def run(self, planned: PlannedStep, label_tokens: int, stats: SparseStats) -> StepOutcome:
        attentions = self._attentions(planned, stats)
        loss_sum = self._run_schedule(planned, [unit[0] for unit in attentions], label_tokens)
        return StepOutcome(loss_sum, _timers(attentions))


class PooledRunner(_StagedRunner):
    def __init__(self, spec: RunSpec, mesh: RankMesh):
        super().__init__(spec, mesh)
        shape = spec.attention_shape
        self.pipeline = PooledPipelineRunner(self.model, [int(k) for k in self.model.layers],
                                             pooled_slots(spec.model.config, spec.dims.pp), mesh.pp_rank,
                                             spec.dims.pp, mesh.pp_peers(), spec.stage_hidden, spec.compute_dtype,
                                             (shape.n_q_heads, shape.n_kv_heads, shape.head_dim), spec.device,
                                             loss_in_parts=spec.loss_kernel != "liger")
        self.group = mesh.pooled_attention_group()

    def plan(self, micro_batches: list[GlobalBatch], prior: SparsePrior | None = None) -> PlannedStep:
        """The micro-batches laid out over their stage's dp ranks, and every tick's plans over all stages' ranks,
        one per layer slot: those plans are what runs, and the step's balance is theirs (the slots run in turn)."""
        units = [plan_microbatch(batch, self.spec, prior, strategy="local") for batch in micro_batches]
        dp = self.spec.dims.dp  # (over another layout, the linear one's: what every rank would have served at home)
        linear = None if self.spec.config.attention.layout == "linear" else \
            [linear_table(batch.doc_lens, dp, batch.tokens_per_rank) for batch in micro_batches]
        ticks = plan_pooled_ticks([unit[0].plan.pieces for unit in units], self.spec, linear)
        slots = [plan for tick in ticks for plan in tick if plan is not None]
        return PlannedStep(units, combine_plans(slots, in_turn=True), ticks)

    def run(self, planned: PlannedStep, label_tokens: int, stats: SparseStats) -> StepOutcome:
        backend = self.spec.backend

        def tick_attention(tick: int) -> list:
            """Tick ``tick``'s core attention per layer slot (one per distinct plan; None where no rank has tokens)."""
            made: dict[int, CoreAttention] = {}
            return [None if p is None else made.setdefault(id(p), CoreAttention(p.plan, self.group, backend=backend,
                                                                               head_chunks=self.spec.head_chunks))
                    for p in planned.ticks[tick]]

        return StepOutcome(self._run_schedule(planned, tick_attention, label_tokens), [])


def build_runner(spec: RunSpec, mesh: RankMesh) -> StepRunner:
    """The runner of the run's layout and schedule, with its model built (collectives: every rank calls it)."""
    if spec.pooled:
        return PooledRunner(spec, mesh)
    if spec.dims.pp > 1:
        return ScheduleRunner(spec, mesh)
    return PlainRunner(spec, mesh)
