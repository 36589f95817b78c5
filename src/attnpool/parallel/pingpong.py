"""Ping-pong: nano-batches interleaved layer by layer, so that one's core-attention traffic overlaps another's compute.

A step's batch is split into nano-batches of whole documents, each with its own plan and core attention
(attnpool.runtime.CoreAttention, whose three phases are dispatch, compute and collect). In every layer, while
one nano-batch's Q/KV or outputs are on the wire, the next computes: all QKV projections and dispatches first,
then every kernel (each launching its outputs back), then every output projection and MLP. Autograd runs the
mirror image in backward, on the same asynchronous collectives, with no host synchronisation. It computes the
same function as running the nano-batches one after another.

:func:`apply_pingpong` lets a model take nano-batches in lists, from outside: its forward and each block's
are wrapped, and a single batch runs as before::

    apply_pingpong(model)
    logits_a, logits_b = model([tokens_a, tokens_b], [positions_a, positions_b], [attention_a, attention_b])

The model is attnpool's (its ``prepare``, ``layers`` and ``head``; each block's ``before_attention`` and
``after_attention``); it does not know it is interleaved. The model and its blocks are still called as modules,
so what wraps their calls (FSDP2's gathering of a unit's parameters) sees every nano-batch. Apply it after
activation checkpointing (attnpool.parallel.parallelize does): a block's parts are then recomputed as the
block's own, ``keep_attention``'s chunked parts, or with ``full`` the whole interleaved layer, its exchanges
included.
"""

from __future__ import annotations

from torch import Tensor, nn

from attnpool.errors import ConfigError
from attnpool.kinds import check_layer_kind
from attnpool.parallel.checkpointing import run_layer


def apply_pingpong(model: nn.Module) -> None:
    """Let ``model`` (and each of its blocks) take nano-batches in lists, interleaved (in place; once is enough)."""
    if isinstance(vars(model).get("forward"), NanoBatchForward):
        return
    for block in model.layers.values():
        block.forward = InterleavedLayer(block, block.forward)
    model.forward = NanoBatchForward(model, model.forward)


class NanoBatchForward:
    """A model's forward that also takes lists, one entry per nano-batch: tokens, positions and core attentions
    (and labels). Returns a list of outputs (logits, losses with ``labels``, or normed hidden states with
    ``return_hidden``), as the model's forward gives them for one."""

    def __init__(self, model: nn.Module, forward):
        self.model, self.forward = model, forward

    def __call__(self, tokens, positions, attention, *, return_hidden: bool = False, labels=None):
        if not isinstance(tokens, (list, tuple)):
            return self.forward(tokens, positions, attention, return_hidden=return_hidden, labels=labels)
        if not (len(tokens) == len(positions) == len(attention)) or (labels is not None and len(labels) != len(tokens)):
            raise ConfigError("nano-batches", (len(tokens), len(positions), len(attention)),
                              "need one positions tensor, one core attention (and one labels tensor) per nano-batch")
        model = self.model
        starts = [model.prepare(t, p) for t, p in zip(tokens, positions)]
        hs, coss, sins = ([start[i] for start in starts] for i in range(3))
        for block in model.layers.values():
            hs = block(hs, coss, sins, attention)
        labels = labels if labels is not None else [None] * len(hs)
        return [model.head(h, labels=y, return_hidden=return_hidden) for h, y in zip(hs, labels)]


class InterleavedLayer:
    """A block's forward that also takes lists of nano-batches' hidden states, RoPE angles and core attentions,
    and interleaves them. The tensors go into a checkpoint one by one (a list would be kept as it is, on the
    GPU, out of activation offload's reach)."""

    def __init__(self, block: nn.Module, forward):
        self.block, self.forward = block, forward

    def __call__(self, x, cos, sin, core_attention):
        if not isinstance(x, (list, tuple)):
            return self.forward(x, cos, sin, core_attention)
        n = len(x)
        return list(run_layer(self.forward, _interleave, self.block, n, core_attention, *x, *cos, *sin))


def _interleave(block: nn.Module, n: int, attentions: list, *tensors: Tensor) -> list[Tensor]:
    xs, coss, sins = tensors[:n], tensors[n:2 * n], tensors[2 * n:]
    pending = []
    for x, cos, sin, attention in zip(xs, coss, sins, attentions):
        q, k, v = block.before_attention(x, cos, sin)
        check_layer_kind(attention, block.layer_id, block.kind)
        pending.append(attention.dispatch(q, k, v, layer=block.layer_id))
    for attention, p in zip(attentions, pending):
        attention.compute(p)
    return [block.after_attention(x, attention.collect(p)) for x, attention, p in zip(xs, attentions, pending)]
