"""Core attention of a model whose layers differ in attention kind (attnpool.plan.kinds).

A micro-batch has one plan per distinct window (local and global layers balance differently, and a windowed
plan moves only its windows' KV); :class:`LayerKinds` holds one core attention per kind of layer, each over its
window's plan, and runs a layer's call with its kind's: the model calls ``attention(q, k, v, layer=i)`` as it
would with one core attention, and does not know the kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from attnpool.errors import ConfigError
from attnpool.plan.kinds import CAUSAL, AttentionKind
from attnpool.plan.plan import Plan


def check_layer_kind(attention, layer: int, kind: AttentionKind) -> None:
    """Refuse a call of ``attention`` for ``layer`` where it would not compute the layer's ``kind`` (the model's):
    a :class:`LayerKinds` (or anything with ``kind_of``) says what it runs for each layer; any other core attention
    computes plain causal attention. Cheap: a comparison per layer call."""
    kind_of = getattr(attention, "kind_of", None)
    runs = kind_of(layer) if kind_of is not None else CAUSAL
    if runs != kind:
        raise ConfigError("attention kind", kind.describe(), f"layer {layer} needs it, but the core attention it was "
                                                            f"given computes {runs.describe()} (build it with "
                                                            "runtime.LayerKinds for the model's layer kinds)")


@dataclass
class _Pending:
    attention: Any
    pending: Any


class LayerKinds:
    """``kinds``: each layer's kind (a model's layer_kinds); ``plans``: window -> the micro-batch's plan for it;
    ``make(plan, softcap)``: the core attention of one kind (CoreAttention or UlyssesAttention, attention_for).
    Calls give ``layer``, the model's 0-based layer index. Ping-pong's phases (dispatch, compute, collect) go to
    the layer's attention too."""

    def __init__(self, kinds: tuple[AttentionKind, ...], plans: dict, make: Callable[[Plan, float | None], Any]):
        self.kinds = tuple(kinds)
        self._attentions = {}
        for kind in dict.fromkeys(self.kinds):
            self._attentions[kind] = make(plans[kind.window], kind.softcap)

    def kind_of(self, layer: int) -> AttentionKind:
        return self.kinds[layer]

    def _of(self, layer: int | None):
        if layer is None:
            raise ValueError("a model with several attention kinds calls core attention with its layer index")
        return self._attentions[self.kinds[layer]]

    def __call__(self, q, k, v, *, layer: int | None = None):
        return self._of(layer)(q, k, v, layer=layer)

    def dispatch(self, q, k, v, *, layer: int | None = None) -> _Pending:
        attention = self._of(layer)
        return _Pending(attention, attention.dispatch(q, k, v, layer=layer))

    def compute(self, p: _Pending) -> None:
        p.attention.compute(p.pending)

    def collect(self, p: _Pending):
        return p.attention.collect(p.pending)


def plan_layer_kinds(kinds, pieces, strategy: str = "cad", group=None, *, backend=None, scale: float | None = None,
                     **plan_options) -> LayerKinds:
    """Core attention for a model with layer ``kinds`` over one batch's ``pieces`` (per rank, or a PieceTable):
    each distinct window planned with ``strategy`` (plan_attention's other options in ``plan_options``) and a
    :class:`LayerKinds` over the plans, the attention a model's forward takes. Every rank must call it alike."""
    from attnpool.plan import plan_attention
    from attnpool.plan.kinds import plan_windows
    from attnpool.runtime import attention_for

    plans = {window: plan_attention(pieces, strategy, window=window, **plan_options) for window in plan_windows(kinds)}
    return LayerKinds(kinds, plans, lambda plan, softcap: attention_for(plan, group, backend=backend, scale=scale,
                                                                        softcap=softcap))
