"""``compile``: torch.compile of every block's linear parts, applied from outside the model.

A block runs two linear parts around core attention (``TransformerBlock.before_attention``: norm, Q/K/V
projections, RoPE; ``after_attention``: output projection, residual, norm, SwiGLU MLP, residual). Each is
compiled on its own, so the elementwise work between the matmuls (RoPE's float32 rotation and casts, SiLU and
the gate's product, the norms) runs as fused kernels; core attention, which plans, communicates and calls its
own kernels, is never traced. The blocks share one compiled graph (modules are inlined, their weights are
inputs), so a deep model compiles once per shape (and token counts, below).
Activation checkpointing (applied after, attnpool.parallel.parallelize), ping-pong, tensor and pipeline
parallelism and FSDP2 call the same two parts, so they compose unchanged; the parts' recompute in backward runs
the compiled code again.

A part compiles again where a call's token count leaves the ranges its graphs were made for: the first change
makes the token count dynamic, and inductor's lowering then guards on ranges of it (on 2 x H200: 8192 tokens and
more, 1280-8191, and below 1280). keep_attention's chunked recompute once left remainders of a few hundred tokens,
which recompiled both parts mid-run; its chunks are now of equal size (attnpool.parallel.checkpointing.linear_chunks).
A step that compiles is not a steady one: CompileClock times compiling, and a run's steady throughput leaves such
steps out (attnpool.train.metrics).
"""

from __future__ import annotations

import threading
import time

import torch
from torch import nn

from attnpool.parallel.checkpointing import SPLIT_PARTS


def compile_linear_parts(model: nn.Module) -> None:
    """Replace each block's linear parts by their torch.compile'd versions (in place)."""
    for block in model.layers.values():
        for name in SPLIT_PARTS:
            setattr(block, name, torch.compile(getattr(block, name)))


class CompileClock:
    """The seconds torch.compile spends compiling in this process while it is entered, from dynamo's compile start
    and end callbacks: new frames and recompiles (a guard failed: a new token-count range), and backward graphs,
    which compile lazily in the first backward that needs them. ``take()`` returns the seconds since the last
    take; nested compiles count once (dynamo calls the callbacks at the outermost start and end only)."""

    def __init__(self):
        self._seconds = 0.0
        self._since: float | None = None
        self._lock = threading.Lock()  # (a lazy backward compiles on autograd's thread)

    def __enter__(self) -> CompileClock:
        from torch._dynamo import callback_handler as handler  # (imported where compile is on, not at start-up)

        handler.register_start_callback(self._started)
        handler.register_end_callback(self._ended)
        return self

    def __exit__(self, *exc) -> None:
        from torch._dynamo import callback_handler as handler

        # (torch._dynamo.reset() clears every callback: leaving must not raise over the error that ended a run)
        if self._started in handler.start_callbacks:
            handler.remove_start_callback(self._started)
        if self._ended in handler.end_callbacks:
            handler.remove_end_callback(self._ended)

    def _started(self, *args) -> None:
        with self._lock:
            self._since = time.perf_counter()

    def _ended(self, *args) -> None:
        with self._lock:
            if self._since is not None:
                self._seconds += time.perf_counter() - self._since
                self._since = None

    def take(self) -> float:
        """Seconds compiled since the last take (a compile still running counts up to now)."""
        with self._lock:
            now = time.perf_counter()
            seconds = self._seconds + (now - self._since if self._since is not None else 0.0)
            self._seconds = 0.0
            if self._since is not None:
                self._since = now
            return seconds
