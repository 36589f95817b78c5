"""What fits a rank's memory, by the memory model (attnpool.train.memory): a capacity, the largest tokens_per_rank a
setting holds, every memory setting fastest first, ``activation_checkpointing: auto``'s choice of each layer's mode,
and the verdict a run or ``attnpool memory`` reports (:func:`report`), with the field to change where nothing fits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from attnpool.errors import ConfigError
from attnpool.plan.cost import BWD_TO_FWD_FLOPS
from attnpool.sizes import format_bytes, format_tokens
from attnpool.train.memory import AUTO, LAYER_CHECKPOINTING, Calibration, MemoryEstimate, MemoryInputs, estimate
from attnpool.train.sections import AUTO_HEADROOM


@dataclass(frozen=True)
class Capacity:
    """What one rank may use: its device's memory and, for what the offloads keep there, host memory
    (None: not checked)."""

    device_bytes: int
    device_name: str
    host_bytes: int | None = None
    shared_by_ranks: bool = False  # a machine's memory split among its ranks (CPU runs): more ranks, less each

    def holds(self, e: MemoryEstimate) -> bool:
        return e.peak_bytes <= self.device_bytes and (self.host_bytes is None or e.host_bytes <= self.host_bytes)


def largest_tokens(x: MemoryInputs, capacity: Capacity, calibration: Calibration | None = None,
                   granularity: int = 1024) -> int:
    """The largest tokens_per_rank, a multiple of ``granularity``, whose predicted peak the capacity holds
    (0 if none). The row ratios are taken as they are at x.tokens_per_rank."""
    def fits(tokens):
        return capacity.holds(estimate(replace(x, tokens_per_rank=tokens), calibration))

    if not fits(granularity):
        return 0
    low, high = 1, 2
    while fits(high * granularity):
        low, high = high, high * 2
        if high > 1 << 30:
            return high * granularity  # no limit in sight: memory does not grow with tokens here
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid * granularity) else (low, mid)
    return low * granularity


# Memory settings, fastest first, as measured on one H200 (bench/results/2026-11-25-h200-memory.md):
# keep_attention recomputes the linear parts, full also core attention; offloading keep_attention's
# or full's activations cost 0.6-1.8% of the step, offloading everything none keeps 61% (the PCIe link
# is the bound); an offloaded optimizer steps on the CPU.
SETTINGS_FASTEST_FIRST = (
    ("none", False, False), ("keep_attention", False, False), ("keep_attention", True, False),
    ("full", False, False), ("full", True, False), ("none", True, False),
    ("keep_attention", False, True), ("keep_attention", True, True), ("full", False, True), ("full", True, True),
    ("none", False, True), ("none", True, True),
)


def settings(x: MemoryInputs, offloads: bool = True) -> list[MemoryInputs]:
    """x under every memory setting its layers run, fastest first (``offloads=False``: checkpointing modes only)."""
    return [replace(x, activation_checkpointing=mode, activation_offload=activation, optimizer_offload=optimizer,
                    layer_modes=())
            for mode, activation, optimizer in SETTINGS_FASTEST_FIRST
            if (offloads or not (activation or optimizer)) and mode in LAYER_CHECKPOINTING[x.layer_modules]]



# What activation offload costs a step where it moves only what checkpointing keeps (layer inputs, core attention's
# saved state): 0.6-1.8% measured on one H200 (bench/results/2026-11-25-h200-memory.md), the upper end taken.
OFFLOAD_STEP_SHARE = 0.018


def auto_checkpointing(x: MemoryInputs, capacity: Capacity, calibration: Calibration | None = None,
                       attention_share: float = 0.0, offload: bool = False, runs: tuple[str, ...] | None = None,
                       headroom: float = AUTO_HEADROOM) -> MemoryInputs | None:
    """``activation_checkpointing: auto``: x with each of the rank's layers' mode (``layer_modes``) that recomputes
    the least while the capacity holds the predicted peak; None where even full recompute does not fit.

    Recompute is counted in forward FLOPs of one layer's linear parts: keep_attention's is 1, full's 1 +
    ``attention_share`` (core attention's forward FLOPs over the linear parts', in the run's batches). The layers
    that recompute most come first: their backward runs last, when the later layers' activations are freed. Under
    pipeline stages every layer takes one mode (the memory model counts stages of one mode). ``offload``: activation
    offload may be turned on (GPU runs), at a cost of OFFLOAD_STEP_SHARE of the step, and then only for layers that
    recompute (offloading everything ``none`` keeps measured 61% slower); x's own activation_offload keeps it on,
    and then no layer is ``none``.
    ``runs``: the modes it may choose (default: all the layers run). The predicted peak leaves ``headroom`` of the
    device's memory free, and the offloaded state as much of the host's (default: the config's default
    auto_headroom, and why it is that: attnpool.train.sections)."""
    layers = x.rank_layers or math.ceil(x.model.n_layers / x.pp)
    runs = [mode for mode in LAYER_CHECKPOINTING[x.layer_modules] if runs is None or mode in runs]
    capacity = replace(capacity, device_bytes=int(capacity.device_bytes * (1 - headroom)),
                       host_bytes=None if capacity.host_bytes is None else int(capacity.host_bytes * (1 - headroom)))
    step = layers * (3 + (1 + BWD_TO_FWD_FLOPS) * attention_share)  # the layers' forward and backward, same unit

    def inputs(full: int, keep: int, offloaded: bool) -> MemoryInputs:
        modes = ("full",) * full + ("keep_attention",) * keep + ("none",) * (layers - full - keep)
        return replace(x, activation_checkpointing=AUTO, activation_offload=offloaded, layer_modes=modes)

    def fits(full: int, keep: int, offloaded: bool) -> bool:
        return capacity.holds(estimate(inputs(full, keep, offloaded), calibration))

    def cost(full: int, keep: int, offloaded: bool) -> float:
        return keep + full * (1 + attention_share) + (OFFLOAD_STEP_SHARE * step if offloaded else 0.0)

    best = None  # (cost, full, keep, offloaded)
    for offloaded in (False, True) if offload and not x.activation_offload else (x.activation_offload,):
        for full in ((0, layers) if x.pp > 1 else range(layers + 1)) if "full" in runs else (0,):
            keeps = (0, layers - full) if x.pp > 1 else range(layers - full + 1)
            # The cheapest split with this many full layers: the fewest keep_attention layers that fit, found in
            # order (the peak need not fall with each: a keep_attention layer's chunked recompute can hold more
            # than a none layer's backward at short contexts); none cheaper than the best so far is left unseen.
            for keep in keeps:
                if (keep and "keep_attention" not in runs) or (offloaded and full + keep < layers):
                    continue
                if best is not None and cost(full, keep, offloaded) >= best[0]:
                    break
                if fits(full, keep, offloaded):
                    best = (cost(full, keep, offloaded), full, keep, offloaded)
                    break
    return None if best is None else inputs(*best[1:])


# --- Verdicts --------------------------------------------------------------------------------------------


@dataclass
class SettingFit:
    """One memory setting at the configured tokens: its estimate, whether the capacity holds it, and the
    largest tokens_per_rank it holds."""

    inputs: MemoryInputs
    estimate: MemoryEstimate
    fits: bool
    largest_tokens: int


@dataclass
class MemoryReport:
    configured: SettingFit
    capacity: Capacity
    settings: list[SettingFit]  # every setting, fastest first (see settings())

    @property
    def fits(self) -> bool:
        return self.configured.fits

    def first_fitting(self) -> SettingFit | None:
        """The fastest setting that fits the configured tokens."""
        return next((s for s in self.settings if s.fits), None)

    def refusal(self, in_a_run: bool = True) -> ConfigError:
        """Why the configuration cannot run, naming the field to change and the largest value that fits (``in_a_run``:
        with where to see more and how to skip the check, for a run's memory check; not for `attnpool memory`)."""
        x, e, cap = self.configured.inputs, self.configured.estimate, self.capacity
        if e.peak_bytes > cap.device_bytes:
            said = (f"predicted peak {format_bytes(e.peak_bytes)} per rank with {x.setting} is more than the "
                    f"{format_bytes(cap.device_bytes)} of {cap.device_name}")
        else:
            said = (f"with {x.setting} the offloaded state needs {format_bytes(e.host_bytes)} of host memory per "
                    f"rank, more than the {format_bytes(cap.host_bytes)} this machine has for each")
        hint = "; `attnpool memory` with the same flags shows the breakdown, --no-memory-check skips this check" \
            if in_a_run else ""
        alternative = self.first_fitting()
        other = f"; {alternative.inputs.setting} fits it ({format_bytes(alternative.estimate.peak_bytes)})" \
            if alternative is not None else ""
        if self.configured.largest_tokens > 0:
            return ConfigError("tokens_per_rank", x.tokens_per_rank,
                               f"{said}: the largest tokens_per_rank that fits is "
                               f"{format_tokens(self.configured.largest_tokens)}{other}{hint}")
        if alternative is not None:
            field_name = next(name for name in ("optimizer_offload", "activation_offload", "activation_checkpointing")
                              if getattr(alternative.inputs, name) != getattr(x, name))
            return ConfigError(field_name, getattr(x, field_name),
                               f"{said}, and no tokens_per_rank fits with these settings{other}{hint}")
        best = max(self.settings, key=lambda s: s.largest_tokens)
        if best.largest_tokens > 0:
            return ConfigError("tokens_per_rank", x.tokens_per_rank,
                               f"{said}, and no memory setting holds that many tokens per rank: the most any holds "
                               f"is {format_tokens(best.largest_tokens)}, with {best.inputs.setting}{hint}")
        if cap.shared_by_ranks:  # each rank's share shrinks with more of them: fewer, not more
            return ConfigError("nproc", x.dp, f"{said}, and no memory setting fits even one token per rank: start "
                                              f"fewer processes{hint}")
        return ConfigError("nproc", x.dp, f"{said}, and no memory setting fits even one token per rank: shard the "
                                          f"model over more ranks{hint}")


def report(x: MemoryInputs, capacity: Capacity, calibration: Calibration | None = None,
           offloads: bool = True) -> MemoryReport:
    """x and every other memory setting (``offloads``: the offload ones too) against the capacity."""
    def fit(inputs):
        e = estimate(inputs, calibration)
        return SettingFit(inputs, e, capacity.holds(e), largest_tokens(inputs, capacity, calibration))

    return MemoryReport(fit(x), capacity, [fit(s) for s in settings(x, offloads)])
