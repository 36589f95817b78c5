"""Activation checkpointing, applied to a model's blocks from outside: what a layer keeps for its backward, and
what it computes again instead.

- ``full``: each block keeps only its input, and its forward runs again in backward, core attention and its
  communication included. It wraps the block's forward, so it works for any block (attnpool's, or a
  transformers decoder layer behind the adapter).
- ``keep_attention``: the block is split at core attention. Core attention runs once and keeps what its
  backward needs (its output, its inputs); the linear parts before and after it (the block's
  ``before_attention`` and ``after_attention``) keep only their inputs and are recomputed in backward, a chunk
  of at most :data:`LINEAR_CHUNK_TOKENS` tokens at a time: more memory kept than ``full``, but the expensive and
  possibly remote part runs once, and the recompute never holds a whole sequence's MLP intermediates.
- ``none``: every block as it is.

Each block can take its own mode: ``activation_checkpointing: auto`` (attnpool.train.memory_fit.auto_checkpointing)
recomputes only as many layers, and only as much of each, as the device's memory requires.

The wrappers replace the block's methods on the block itself (its class, modules and weights' names stay as
they are, so tensor parallelism's plans, FSDP2 and checkpoints see the same model). They wrap whatever the
methods are when applied: attnpool.parallel.parallelize compiles the parts first, so that a recompute runs the
compiled code again, and ping-pong (attnpool.parallel.pingpong) after. Applying a mode replaces the one applied
before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# The block's linear parts around core attention (attnpool.model.llama.TransformerBlock).
SPLIT_PARTS = ("before_attention", "after_attention")
# The linear parts act on each token alone, so their recompute can run a chunk of tokens at a time: what the
# recompute and its backward hold at once (the MLP's four ffn_dim-wide intermediates and their gradients, RoPE's
# float32 copies) is then one chunk's, not the whole sequence's: at 256K tokens of Llama-3-8B about 1.5 GiB
# instead of 45. The chunk's matrix products stay large enough to run at full speed. At most this many tokens a
# chunk, in chunks of equal size (linear_chunks).
LINEAR_CHUNK_TOKENS = 8192


def linear_chunks(tokens: int, chunk_tokens: int) -> list[int]:
    """The sizes of the fewest chunks of at most ``chunk_tokens`` that ``tokens`` splits into, equal within one
    token. Equal, not ``chunk_tokens`` and a remainder: under compile a remainder of a few hundred tokens fell in a
    range of token counts the compiled parts had not met, and recompiled them mid-run (9.7 s of a float8 step on
    the full 8B, 2 x H200: bench/results/2026-11-30-h200x2-auto-checkpointing-float8.md); equal chunks of a
    sequence longer than one chunk hold between half a chunk and a chunk."""
    count = max(1, -(-tokens // chunk_tokens))
    return [tokens // count + (1 if i < tokens % count else 0) for i in range(count)]


def recompute_in_chunks(fn, chunk_tokens: int, *rows: torch.Tensor):
    """``fn(*rows)`` for a function that treats each token (row) alone, run at most ``chunk_tokens`` rows at a
    time (linear_chunks) under activation checkpointing: forward keeps only the inputs, backward recomputes and
    differentiates one chunk at a time. ``fn`` returns a tensor or a tuple of tensors, concatenated
    over the chunks. (``split``, not slicing: its backward assembles the input's gradient in one
    copy, where each slice's would fill a zero tensor of the whole input.) Inputs of different lengths
    (a sequence shard beside the whole sequence's RoPE angles, under sequence parallelism) cannot be
    chunked alike: they run whole."""
    if rows[0].shape[0] <= chunk_tokens or any(r.shape[0] != rows[0].shape[0] for r in rows):
        return checkpoint(fn, *rows, use_reentrant=False)
    sizes = linear_chunks(rows[0].shape[0], chunk_tokens)
    parts = [checkpoint(fn, *chunk, use_reentrant=False) for chunk in zip(*(r.split(sizes) for r in rows))]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(outputs) for outputs in zip(*parts))
    return torch.cat(parts)


class _Wrapper:
    """A block's method, wrapped; ``wrapped`` is what it replaced."""

    def __init__(self, wrapped):
        self.wrapped = wrapped


class RecomputedLayer(_Wrapper):
    """A block's forward, recomputed in backward (``full``). A checkpoint keeps its tensor arguments through
    autograd, where activation offload sees them, and any other argument as it is."""

    def __call__(self, *args, **kwargs):
        return checkpoint(self.wrapped, *args, use_reentrant=False, **kwargs)


class RecomputedInChunks(_Wrapper):
    """One of a block's linear parts, recomputed in backward a chunk of tokens at a time (``keep_attention``)."""

    def __call__(self, *rows):
        return recompute_in_chunks(self.wrapped, LINEAR_CHUNK_TOKENS, *rows)


MODES = ("none", "keep_attention", "full")  # the least recomputed first


def apply_activation_checkpointing(model: nn.Module, mode: str | Sequence[str]) -> None:
    """Checkpoint every block of ``model.layers`` as ``mode`` says (see the module docstring), replacing the mode
    applied before: one mode for every block, or each block's, by its layer index (the key in ``model.layers``; a
    pipeline stage's blocks keep the whole model's). ``keep_attention`` needs blocks split at core attention
    (``SPLIT_PARTS``)."""
    modes = [mode] if isinstance(mode, str) else list(mode)
    for name in modes:
        if name not in MODES:
            raise ValueError(f"activation checkpointing mode {name!r}: choose none, full or keep_attention")
    for index, block in model.layers.items():
        if isinstance(mode, str):
            layer_mode = mode
        elif int(index) < len(modes):
            layer_mode = modes[int(index)]
        else:
            raise ValueError(f"activation checkpointing modes for {len(modes)} layers, but the model has layer {index}")
        wrapped = vars(block).get("forward")
        if wrapped is not None and not isinstance(wrapped, _Wrapper):
            raise ValueError(f"block {type(block).__name__}'s forward is wrapped by {type(wrapped).__name__}: apply "
                             "activation checkpointing first (attnpool.parallel.parallelize's order)")
        for name in ("forward", *SPLIT_PARTS):
            _unwrap(block, name)
        if layer_mode == "full":
            block.forward = RecomputedLayer(block.forward)
        elif layer_mode == "keep_attention":
            for name in SPLIT_PARTS:
                setattr(block, name, RecomputedInChunks(getattr(block, name)))


def _unwrap(block: nn.Module, name: str) -> None:
    """Put back what a wrapper replaced: the class's own method (no attribute on the block), or what was set on the
    block before (a compiled part)."""
    wrapper = vars(block).get(name)
    if not isinstance(wrapper, _Wrapper):
        return
    original = wrapper.wrapped
    if getattr(original, "__self__", None) is block and getattr(original, "__func__", None) is getattr(type(block), name):
        delattr(block, name)
    else:
        setattr(block, name, original)


def run_layer(forward, fn, *args):
    """``fn(*args)``, a computation of a block's whole layer other than its ``forward`` (ping-pong's interleaved
    nano-batches), checkpointed where that forward is recomputed (``full``)."""
    if isinstance(forward, RecomputedLayer):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
