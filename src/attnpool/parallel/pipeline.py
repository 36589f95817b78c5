"""Pipeline parallelism: the model cut into stages by layers, run by ``torch.distributed.pipelining``.

A stage is the model with the other stages' layers deleted (:func:`as_stage`: its weights keep their names, so
checkpoints reshard across pipeline sizes); the first stage also holds the embedding, the last the final norm,
the output projection and the loss. Stages are balanced by compute:
every layer counts one, the output projection and loss as many layers as their matrix products weigh
against a layer's (``head_layers``), so the last stage gets fewer layers. Each pipeline rank holds one
stage (``1f1b``, ``gpipe``) or two (``interleaved-1f1b``: stages r and r + pp). torch's zero-bubble
schedules are refused (REFUSED_SCHEDULES says why).

Every micro-batch has its own plan and its own core attention (a CoreAttention per micro-batch, over the
stage's dp ranks); the schedule passes the micro-batch's index with its inputs, and the stage picks that
micro-batch's core attention. The last stage returns its micro-batch's summed token loss times the step's
``loss_scale`` (one over the step's label tokens), so the summed gradients are those of the mean loss
over every token of the step. Pipeline stages exchange fixed shapes: every dp rank must hold the same
number of tokens in every micro-batch (the linear or the balanced layout; not wlb, not ping-pong's halves).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnpool.model import ModelConfig
from attnpool.plan.stages import (AUTO_SCHEDULE, POOLED, REFUSED_SCHEDULES, SCHEDULES, rank_stages, schedule_names,
                                  schedule_stage_layers, stages_per_rank)


def activations_in_flight(schedule: str, pp: int, microbatches: int, pp_rank: int = 0) -> int:
    """Micro-batches whose activations pipeline rank ``pp_rank`` holds at once (the first holds the most), counted
    in stage-sized units: GPipe keeps all of them; 1F1B one per stage from it to the last (the last rank runs
    each micro-batch's backward right after its forward); interleaved 1F1B the first rank's count on every rank
    (a bound); the pooled schedule one per tick (an idle tick's served rows counted as a busy one's: an upper
    bound, which the memory check replaces with the sampled ticks' rows summed, memory.MemoryInputs.held_rows)."""
    if pp == 1:
        return 1
    if schedule == POOLED:  # every tick's, idle ones included: they keep what serving saved for backward
        return microbatches + pp - 1
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, pp - pp_rank)
    return min(microbatches, pp) * SCHEDULES[schedule][1]


def pipeline_problem(cfg: ModelConfig, pp: int, schedule: str, microbatches: int) -> tuple[str, object, str] | None:
    """(field, value, why) where a pipeline of ``pp`` ranks cannot run this model, or None."""
    if schedule in REFUSED_SCHEDULES:
        return "pp_schedule", schedule, ("zero-bubble schedules split the backward into input and weight gradients, "
                                         f"which this model's gradients do not survive; use {', '.join(SCHEDULES)}")
    if schedule not in schedule_names():
        return "pp_schedule", schedule, f"unknown schedule; choose one of {', '.join(schedule_names())}"
    if pp == 1:
        return None
    stages = pp * stages_per_rank(schedule)
    if stages > cfg.n_layers:
        return "pp", pp, (f"{stages} pipeline stages ({schedule}: {stages_per_rank(schedule)} per rank) need at least "
                          f"one layer each, and the model has {cfg.n_layers}")
    if schedule == AUTO_SCHEDULE and microbatches < pp:
        return "microbatches", microbatches, (f"pp_schedule {schedule} chooses between 1f1b and {POOLED}, and 1f1b "
                                              f"needs at least pp={pp} micro-batches")
    if schedule not in ("gpipe", POOLED) and microbatches < pp:
        return "microbatches", microbatches, f"{schedule} needs at least pp={pp} micro-batches"
    if schedule == "interleaved-1f1b":
        rounds = microbatches // pp  # torch runs the micro-batches in rounds of equal size
        if microbatches % rounds:
            return "microbatches", microbatches, (f"{schedule} runs micro-batches in {rounds} rounds of equal size: "
                                                  f"give a multiple of pp={pp}, or fewer than {2 * pp}")
    return None


def as_stage(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """``model`` (attnpool's Transformer, not yet parallelized) as one pipeline stage, in place: the other stages'
    blocks deleted, and the embedding (unless ``first``) or the final norm and output projection (unless ``last``);
    called as torch's schedules call a stage (:class:`StageForward`). A model that ties its output projection to
    its embedding keeps the embedding on the last stage too, as its output projection, under the same name: the
    two copies start equal (read or drawn by name), their gradients are summed after every backward
    (:func:`sum_tied_gradients`), so they stay equal, and a checkpoint holds one."""
    for key in [k for k in model.layers if int(k) not in layers]:
        del model.layers[key]
    if not first:
        model.embeds_tokens = False
        if not (last and model.config.tie_embeddings):
            model.embed = None
    if not last:
        model.norm = None
        model.lm_head = None
    model.forward = StageForward(model.forward, last)
    return model


class StageForward:
    """A stage's forward the way the pipeline schedule calls it: hidden states (tokens on the first stage) as the
    argument, the rest by keyword, one micro-batch at a time; the micro-batch's index picks its core attention.
    The last stage returns the micro-batch's summed token loss times ``loss_scale``."""

    def __init__(self, forward, last: bool):
        self.forward, self.last = forward, last

    def __call__(self, x: Tensor, *, positions: Tensor, microbatch: Tensor, attentions: tuple, labels: Tensor,
                 loss_scale: float) -> Tensor:
        attention = attentions[int(microbatch)]
        if not self.last:
            return self.forward(x, positions, attention)
        return self.forward(x, positions, attention, labels=labels) * loss_scale


def rank_layers(cfg: ModelConfig, schedule: str, pp: int, pp_rank: int = 0) -> list[int]:
    """The layers of each stage pipeline rank ``pp_rank`` holds (the first rank holds the most)."""
    ranges = schedule_stage_layers(cfg, schedule, pp)
    return [len(ranges[s]) for s in rank_stages(schedule, pp, pp_rank)]


def build_stage_models(model: nn.Module, schedule: str, pp: int, pp_rank: int) -> tuple[list[int], list[nn.Module]]:
    """This pipeline rank's stages of ``model`` (a whole model, not yet parallelized): their indices and modules
    (copies where the rank holds two)."""
    stage_ids = rank_stages(schedule, pp, pp_rank)
    num_stages = pp * stages_per_rank(schedule)
    ranges = schedule_stage_layers(model.config, schedule, pp)
    models = []
    for i, s in enumerate(stage_ids):
        stage = model if i == len(stage_ids) - 1 else copy.deepcopy(model)
        models.append(as_stage(stage, ranges[s], s == 0, s == num_stages - 1))
    return stage_ids, models


@dataclass
class PipelineRunner:
    """The schedule over this rank's stages, and how to feed it one step's micro-batches."""

    schedule: object
    stage_ids: list[int]
    num_stages: int

    @classmethod
    def build(cls, stage_ids: list[int], models: list[nn.Module], schedule: str, microbatches: int,
              tokens: int, hidden: tuple[int, ...], hidden_dtype: torch.dtype, device: torch.device, group):
        """``tokens``: a dp rank's tokens per micro-batch (the first stage's input); ``hidden``: the shape of
        the hidden states a stage passes on (per tp rank)."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        num_stages = len(stage_ids) * (group.size() if group is not None else 1)
        stages = []
        for s, model in zip(stage_ids, models):
            # Examples of what a stage receives and sends (hidden states carry gradients back).
            inputs = torch.empty(tokens, dtype=torch.long, device=device) if s == 0 \
                else torch.empty(hidden, dtype=hidden_dtype, device=device, requires_grad=True)
            outputs = torch.empty((), dtype=torch.float32, device=device, requires_grad=True) if s == num_stages - 1 \
                else torch.empty(hidden, dtype=hidden_dtype, device=device, requires_grad=True)
            stages.append(PipelineStage(model, s, num_stages, device, input_args=inputs, output_args=outputs,
                                        group=group))
        schedule_class = get_schedule_class(SCHEDULES[schedule][0])
        # The last stage already returns its share of the step's mean loss: the "loss" is its output, and
        # the micro-batches' gradients add up unscaled.
        runner = schedule_class(stages[0] if SCHEDULES[schedule][1] == 1 else stages, n_microbatches=microbatches,
                                loss_fn=lambda output, target: output, scale_grads=False)
        return cls(runner, stage_ids, num_stages)

    @property
    def first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def last(self) -> bool:
        return self.num_stages - 1 in self.stage_ids

    def step(self, tokens: list[Tensor], positions: list[Tensor], labels: list[Tensor], attentions: list,
             loss_scale: float) -> Tensor:
        """Forward and backward of one step's micro-batches (each dp rank's tensors, one per micro-batch);
        returns this rank's sum of the micro-batches' loss shares (0 off the last stage)."""
        losses: list = []
        count = len(tokens)
        kwargs = dict(positions=torch.cat(positions), labels=torch.cat(labels), microbatch=torch.arange(count),
                      attentions=tuple(attentions), loss_scale=loss_scale)
        args = (torch.cat(tokens),) if self.first else ()
        target = torch.zeros(count) if self.last else None
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if not losses:
            return torch.zeros((), device=positions[0].device)
        total = sum(loss.detach() for loss in losses)
        return total.full_tensor() if hasattr(total, "full_tensor") else total


def sum_tied_gradients(model: nn.Module, group) -> None:
    """Sum the gradients of a tied embedding's two copies, the first stage's (the embedding's) and the last's (the
    output projection's), over ``group`` (this rank and its peer of the same dp and tp index on the other end of
    the pipeline: their shards are the same slices), in place: both copies then take the whole gradient."""
    weight = model.embed.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    grad = weight.grad
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    torch.distributed.all_reduce(local, group=group)


def merged_stages(models: list[nn.Module]) -> nn.Module:
    """A rank's stages as one module holding their parts under the whole model's names (for
    checkpoints and optimizers); the stage itself where the rank holds one."""
    if len(models) == 1:
        return models[0]
    merged = nn.Module()
    merged.layers = nn.ModuleDict({key: layer for m in models for key, layer in m.layers.items()})
    for name in ("embed", "norm", "lm_head"):
        part = next((getattr(m, name) for m in models if getattr(m, name) is not None), None)
        if part is not None:
            setattr(merged, name, part)
    return merged
