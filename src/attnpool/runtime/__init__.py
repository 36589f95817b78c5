"""Runtime: a plan turned into dispatch layouts and the distributed core-attention call."""

from __future__ import annotations

import torch

from attnpool.kernels.base import Backend
from attnpool.kinds import plan_windows
from attnpool.plan import plan_attention
from attnpool.plan.plan import Plan
from attnpool.runtime.core_attention import CoreAttention, dispatch_layout
from attnpool.runtime.dispatch import DispatchLayout
from attnpool.runtime.layer_kinds import LayerKinds
from attnpool.runtime.ulysses import UlyssesAttention
from attnpool.sparse import SparseConfig


def attention_for(plan: Plan, group=None, *, backend: str | Backend | None = None, scale: float | None = None,
                  sparse: SparseConfig | None = None, softcap: float | None = None, **options):
    """The core attention that serves ``plan``: :class:`UlyssesAttention` for a head-parallel plan (dense only),
    else :class:`CoreAttention` (``options``: its other keywords, which a head-parallel plan has no use for).
    ``softcap``: the layer kind's soft-cap."""
    if plan.head_parallel:
        if sparse is not None and sparse.enabled:
            raise ValueError("ulysses serves dense attention (attnpool train refuses sparse with it)")
        return UlyssesAttention(plan, group, backend=backend, scale=scale, softcap=softcap)
    return CoreAttention(plan, group, backend=backend, scale=scale, sparse=sparse, softcap=softcap, **options)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Plan, group=None, *,
                   backend: str | Backend | None = None, scale: float | None = None,
                   sparse: SparseConfig | None = None, layer: int | None = None,
                   softcap: float | None = None, relay_nodes: tuple[int, ...] | None = None,
                   head_chunks: int = 1) -> torch.Tensor:
    """Causal attention of every token over its own document's earlier tokens, wherever they live.

    q (T_r, H_q, D), k and v (T_r, H_kv, D) hold this rank's tokens in the order of its
    pieces in ``plan``; returns (T_r, H_q, D). Differentiable in q, k and v. Any strategy's plan; a plan
    made for a sliding window (``plan_attention(..., window=w)``) computes each token over the ``w`` keys
    ending at it. ``softcap``: scores soft-capped (c * tanh(s / c)). ``sparse`` and ``layer``:
    vertical-slash sparse attention, as :class:`CoreAttention` takes them. ``relay_nodes``: each rank's node, for
    the hierarchical exchange, and ``head_chunks``: the call in that many groups of heads, one's exchanges behind
    another's kernel (:class:`CoreAttention`; a head-parallel plan takes neither).
    """
    return attention_for(plan, group, backend=backend, scale=scale, sparse=sparse, softcap=softcap,
                         relay_nodes=relay_nodes, head_chunks=head_chunks)(q, k, v, layer=layer)


def plan_layer_kinds(kinds, pieces, strategy: str = "cad", group=None, *, backend=None, scale: float | None = None,
                     **plan_options) -> LayerKinds:
    """Core attention for a model with layer ``kinds`` over one batch's ``pieces`` (per rank, or a PieceTable):
    each distinct window planned with ``strategy`` (plan_attention's other options in ``plan_options``) and a
    :class:`LayerKinds` over the plans, the attention a model's forward takes. Every rank must call it alike."""
    plans = {window: plan_attention(pieces, strategy, window=window, **plan_options) for window in plan_windows(kinds)}
    return LayerKinds(kinds, plans, lambda plan, softcap: attention_for(plan, group, backend=backend, scale=scale,
                                                                        softcap=softcap))


__all__ = ["CoreAttention", "LayerKinds", "UlyssesAttention", "attention_for", "core_attention", "dispatch_layout",
           "plan_layer_kinds", "DispatchLayout"]
