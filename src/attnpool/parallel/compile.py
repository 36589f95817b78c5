"""``compile``: torch.compile of every block's linear parts, applied from outside the model.

A block runs two linear parts around core attention (``TransformerBlock.before_attention``: norm, Q/K/V
projections, RoPE; ``after_attention``: output projection, residual, norm, SwiGLU MLP, residual). Each is
compiled on its own, so the elementwise work between the matmuls (RoPE's float32 rotation and casts, SiLU and
the gate's product, the norms) runs as fused kernels; core attention, which plans, communicates and calls its
own kernels, is never traced. The blocks share one compiled graph (modules are inlined, their weights are
inputs), so a deep model compiles once per shape; a changed token count recompiles once with dynamic shapes.
Activation checkpointing (applied after, attnpool.parallel.parallelize), ping-pong, tensor and pipeline
parallelism and FSDP2 call the same two parts, so they compose unchanged; the parts' recompute in backward runs
the compiled code again.
"""

from __future__ import annotations

import torch
from torch import nn

from attnpool.parallel.checkpointing import SPLIT_PARTS


def compile_linear_parts(model: nn.Module) -> None:
    """Replace each block's linear parts by their torch.compile'd versions (in place)."""
    for block in model.layers.values():
        for name in SPLIT_PARTS:
            setattr(block, name, torch.compile(getattr(block, name)))
