"""Core attention of a model whose layers differ in attention kind (attnpool.kinds).

A micro-batch has one plan per distinct window (local and global layers balance differently, and a windowed
plan moves only its windows' KV); :class:`LayerKinds` holds one core attention per kind of layer, each over its
window's plan, and runs a layer's call with its kind's: the model calls ``attention(q, k, v, layer=i)`` as it
would with one core attention, and does not know the kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from attnpool.kinds import AttentionKind
from attnpool.plan.plan import Plan


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

