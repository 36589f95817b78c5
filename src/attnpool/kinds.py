"""Attention kinds: what one layer's core attention computes over a document (no torch: the planner, the
runtime, the models and the config share them).

A kind is causal attention, optionally under a sliding window of ``window`` keys (query i sees keys
(i - window, i]) and optionally with its scores soft-capped at ``softcap`` (s -> softcap * tanh(s / softcap),
Gemma 2). Models mix them: Mistral's every layer windowed, Gemma 2 alternating windowed and global layers,
Gemma 3 five windowed layers to one global. Local and global layers balance differently, so a micro-batch gets
one plan per distinct window (the soft-cap changes what a kernel computes, not its work or the keys it reads)
and each layer runs its kind's plan.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from attnpool.errors import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' names of the two layer types
LAYER_TYPES = (SLIDING, FULL)


@dataclass(frozen=True)
class AttentionKind:
    window: int | None = None  # keys each query sees, itself included; None: the whole causal prefix
    softcap: float | None = None  # scores soft-capped at this value; None: not capped

    def __post_init__(self):
        if self.window is not None and (isinstance(self.window, bool) or not isinstance(self.window, int)
                                        or self.window < 1):
            raise ConfigError("sliding_window", self.window, "a sliding window is a positive number of keys")
        if self.softcap is not None and not (isinstance(self.softcap, (int, float)) and math.isfinite(self.softcap)
                                             and self.softcap > 0):
            raise ConfigError("attn_softcap", self.softcap, "a soft-cap is a positive number")

    @property
    def causal(self) -> bool:
        return self.window is None and self.softcap is None

    def describe(self) -> str:
        parts = ["causal" if self.window is None else f"window {self.window}"]
        if self.softcap is not None:
            parts.append(f"soft-cap {self.softcap:g}")
        return ", ".join(parts)


CAUSAL = AttentionKind()


def layer_kinds(n_layers: int, sliding_window: int | None = None, layer_types=None,
                attn_softcap: float | None = None) -> tuple[AttentionKind, ...]:
    """Each layer's kind from a model's settings as transformers names them: ``sliding_window`` (None: no layer
    is windowed), ``layer_types`` (each layer's "sliding_attention" or "full_attention"; None: every layer
    sliding where there is a window) and ``attn_softcap`` (every layer's)."""
    if layer_types is None:
        layer_types = (SLIDING,) * n_layers
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise ConfigError("layer_types", layer_types, f"one of {', '.join(LAYER_TYPES)} for each of the {n_layers} "
                                                      "layers")
    return tuple(AttentionKind(sliding_window if t == SLIDING else None, attn_softcap) for t in layer_types)


def expand_layer_types(n_layers: int, layer_types):
    """``layer_types`` as a tuple of names, from a list of them or from a pattern "S/F" (or "S:F"): S sliding layers
    then F full ones, repeated over the layers (Gemma 3 is "5/1", Gemma 2 "1/1")."""
    if isinstance(layer_types, (list, tuple)):
        return tuple(layer_types)
    match = re.fullmatch(r"\s*(\d+)\s*[:/]\s*(\d+)\s*", layer_types) if isinstance(layer_types, str) else None
    if not match or int(match[1]) + int(match[2]) == 0:
        raise ConfigError("layer_types", layer_types, 'a list of sliding_attention / full_attention per layer, or a '
                                                      'pattern "S/F" (S sliding layers then F full ones, repeated; '
                                                      'YAML reads an unquoted 5:1 as the number 301)')
    cycle = (SLIDING,) * int(match[1]) + (FULL,) * int(match[2])
    return tuple(cycle[i % len(cycle)] for i in range(n_layers))


def plan_windows(kinds) -> tuple[int | None, ...]:
    """The distinct windows of ``kinds`` in the order the layers first use them: one plan each per micro-batch."""
    return tuple(dict.fromkeys(kind.window for kind in kinds))


def check_layer_kind(attention, layer: int, kind: AttentionKind) -> None:
    """Refuse a call of ``attention`` for ``layer`` where it would not compute the layer's ``kind`` (the model's):
    attnpool.runtime's core attentions say what they run for each layer (``kind_of``: a LayerKinds its layer's kind,
    a CoreAttention its plan's window and its soft-cap); any other callable counts as plain causal attention.
    Cheap: a comparison per layer call."""
    kind_of = getattr(attention, "kind_of", None)
    runs = kind_of(layer) if kind_of is not None else CAUSAL
    if runs != kind:
        raise ConfigError("attention kind", kind.describe(), f"layer {layer} needs it, but the core attention it was "
                                                            f"given computes {runs.describe()} (build it with "
                                                            "attnpool.runtime.LayerKinds for the model's layer kinds)")
