"""``parallelize``: every parallelism and wrapper a run applies to its model, from outside, in one order.

0. float8 (attnpool.parallel.float8), where asked for: the decoder layers' linear layers become torchao's float8
   modules, first, so that what follows wraps and shards those (with ``float8_all_gather`` FSDP2 gathers their
   weights in float8).
1. Tensor parallelism (attnpool.parallel.tensor), where tp > 1: DTensor plans on the linear layers, sequence
   parallelism between them. So that what follows sees the model's tensor-parallel modules.
2. Compile (attnpool.parallel.compile): each block's linear parts.
3. Activation checkpointing (attnpool.parallel.checkpointing): after compile, so that a recompute runs the
   compiled parts again (the checkpoint around compiled code, never compiled code around a checkpoint).
4. Ping-pong (attnpool.parallel.pingpong), where asked for: the model and its blocks take nano-batches in lists.
   After checkpointing, so that a block's recompute covers the interleaved layer.
5. The loss kernel (attnpool.model.fused_loss): the head's cross-entropy.
6. FSDP2 over the dp ranks (:func:`apply_fsdp`): each block a unit, the root last.

The model's weights get their values after (``ModelSpec.materialize``): one built on the meta device has
storage only once tensor parallelism and FSDP2 have cut it. What a model family cannot run (tensor
parallelism, compile or keep_attention for transformers' modules) was refused when the run started.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from attnpool.model.fused_loss import use_loss_kernel
from attnpool.parallel.checkpointing import apply_activation_checkpointing
from attnpool.parallel.compile import compile_linear_parts
from attnpool.parallel.float8 import apply_float8
from attnpool.parallel.mesh import RankMesh
from attnpool.parallel.pingpong import apply_pingpong
from attnpool.parallel.tensor import apply_tensor_parallel


class ParallelizeSpec(Protocol):
    """What parallelize reads of a run's resolved settings (attnpool.train.spec.RunSpec)."""

    activation_checkpointing: str | tuple[str, ...]  # none, full or keep_attention; or each layer's, by index
    compile: bool
    float8: str | None  # the float8 recipe (one of model.float8_options.RECIPES), None for bf16 linear layers
    float8_all_gather: bool  # FSDP2 gathers the float8 layers' weights in float8 (tensorwise)
    pingpong: bool  # nano-batches interleaved layer by layer
    loss_kernel: str  # resolved: chunked or liger
    bf16: bool  # bf16 compute, float32 master weights and gradient reduction
    optimizer_offload: bool  # FSDP2 keeps parameters, gradients and optimizer states in host memory
    device: torch.device  # the rank's compute device


def parallelize(model: nn.Module, spec: ParallelizeSpec, mesh: RankMesh | None = None) -> nn.Module:
    """``model`` (or a pipeline stage of it) with everything in the module docstring applied, in place, over
    ``mesh``'s "tp" and "dp" ranks (None: every rank is a dp rank)."""
    if spec.float8:
        apply_float8(model, spec.float8, all_gather=spec.float8_all_gather, tp=mesh.dims.tp if mesh is not None else 1)
    if mesh is not None and mesh.dims.tp > 1:
        apply_tensor_parallel(model, mesh.tp_mesh)
    if spec.compile:
        compile_linear_parts(model)
    apply_activation_checkpointing(model, spec.activation_checkpointing)
    if spec.pingpong:
        apply_pingpong(model)
    use_loss_kernel(model, spec.loss_kernel)
    apply_fsdp(model, mesh.dp_mesh if mesh is not None else None, spec.bf16, spec.optimizer_offload, spec.device)
    return model


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh | None, bf16: bool, offload: bool, device: torch.device) -> None:
    """FSDP2 over ``dp_mesh``: every block of ``model.layers`` a unit, then the root (the embedding, final norm and
    output projection; a tied output projection is the embedding itself, used twice by the root's forward).

    With ``bf16`` each unit's parameters are gathered in bf16 for compute (half the all-gather bytes, no per-use
    casts) and gradients reduced in float32; the sharded master weights and the optimizer stay float32.
    ``offload``: the shards, their gradients and the optimizer's state live in host memory. Gradients are
    summed over the ranks, not averaged: each rank's loss is already its share of the step's mean over every
    token of the global batch."""
    # cast_forward_inputs=False: a layer's input is already bf16, and FSDP2 would otherwise round RoPE's
    # float32 cos and sin to bf16 at every layer (and keep that copy for backward).
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     cast_forward_inputs=False) if bf16 else MixedPrecisionPolicy()
    options = dict(mp_policy=mp_policy, mesh=dp_mesh)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in model.layers.values():
        fully_shard(block, **options)
    fully_shard(model, **options)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # plain SUM, which gloo supports (no PREMUL_SUM)
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
