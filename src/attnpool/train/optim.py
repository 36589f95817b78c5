"""The optimizer step: AdamW, the learning-rate schedule, gradient clipping, and the ranks' agreement that a
step's loss and gradients are finite (a step that is not is skipped on every rank alike)."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from attnpool.train.sections import OptimSection


def build_optimizer(model: torch.nn.Module, optim: OptimSection, fused: bool = False) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms or biases). ``fused`` (GPU runs, offloaded state
    included): one kernel per step, and no temporaries the size of the parameters, which the
    multi-tensor implementation allocates (attnpool.train.memory counts none)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), fused=fused or None)


def lr_factor(done: int, warmup_steps: int, steps: int, min_ratio: float) -> float:
    """Peak-lr multiplier for the step after ``done`` steps: linear warmup, then cosine down to ``min_ratio``."""
    if done < warmup_steps:
        return (done + 1) / warmup_steps
    progress = min(1.0, (done - warmup_steps) / max(1, steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer, optim: OptimSection) -> torch.optim.lr_scheduler.LambdaLR:
    factor = functools.partial(lr_factor, warmup_steps=optim.warmup_steps, steps=optim.steps,
                               min_ratio=optim.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def apply_optim_settings(optimizer, scheduler, optim: OptimSection) -> None:
    """The settings' peak lr, betas and weight decay over those a checkpoint's optimizer and schedule state brought
    back (its saved values), so that a resume with allow_config_change that changes them trains with the new ones.
    The schedule's shape (warmup, steps, min_lr_ratio) is the settings' already: its function is not saved."""
    scheduler.base_lrs = [optim.lr] * len(optimizer.param_groups)
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    # build_optimizer's groups: the matrices (decayed), then norms and biases
    for group, decay in zip(optimizer.param_groups, (optim.weight_decay, 0.0)):
        group.update(initial_lr=optim.lr, lr=optim.lr * factor, betas=(optim.beta1, optim.beta2), weight_decay=decay)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # (what get_last_lr reports)


def clip_gradients(params: list, max_norm: float, pp_group=None, counted: list | None = None) -> torch.Tensor:
    """The gradients' total 2-norm over every rank's parameters (``pp_group``: also over the other
    pipeline stages'; ``counted``: the parameters it counts, default ``params``: a copy of another stage's
    weight once), ``params`` clipped to ``max_norm`` (inf: not clipped); returns the norm before clipping."""
    grads = [p.grad for p in (params if counted is None else counted) if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        squared = norm ** 2
        dist.all_reduce(squared, group=pp_group)
        norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def agree_finite(loss_sum, grad_norm, device: torch.device) -> bool:
    """Whether every rank's loss and the gradient norm are finite (one all-reduce): a step that is not
    is skipped on all ranks alike."""
    finite = math.isfinite(float(loss_sum)) and math.isfinite(float(grad_norm))
    flag = torch.tensor([1.0 if finite else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)
