"""``compile``: torch.compile of every layer's linear parts, applied from outside the model, as activation
checkpointing and the parallelisms are.

A block runs two linear parts around core attention (``TransformerBlock._qkv``: norm, Q/K/V projections,
RoPE; ``_output_and_mlp``: output projection, residual, norm, SwiGLU MLP, residual). Each is compiled on its
own, so the elementwise work between the matmuls (RoPE's float32 rotation and casts, SiLU and the gate's
product, the norms) runs as fused kernels; core attention, which plans, communicates and calls its own
kernels, is never traced. The blocks share one compiled graph (modules are inlined, their weights are
inputs), so a deep model compiles once per shape; a changed token count recompiles once with dynamic shapes.
Activation checkpointing, ping-pong, tensor and pipeline parallelism and FSDP2 call the same two parts, so
they compose unchanged; the parts' recompute in backward runs the compiled code again.
"""

from __future__ import annotations

import torch

from attnpool.model.llama import Transformer

LINEAR_PARTS = ("_qkv", "_output_and_mlp")


def compile_linear_parts(model: Transformer) -> None:
    """Replace each block's linear parts by their torch.compile'd versions (in place)."""
    for block in model.layers.values():
        for name in LINEAR_PARTS:
            setattr(block, name, torch.compile(getattr(block, name)))
