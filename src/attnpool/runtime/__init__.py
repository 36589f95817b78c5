"""Runtime: a plan turned into dispatch layouts and the distributed core-attention call."""

from attnpool.runtime.core_attention import CoreAttention, core_attention, dispatch_layout
from attnpool.runtime.dispatch import DispatchLayout

__all__ = ["CoreAttention", "core_attention", "dispatch_layout", "DispatchLayout"]
