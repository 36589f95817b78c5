"""Cost models of CA-tasks: how long a query shard [a, b) with KV prefix [0, b) takes.

Under a sliding window of w keys (``windowed(w)``: a model of the same kernel for a layer kind with a
window) a task's keys are [max(0, a - w + 1), b) and its work ``window_pairs(a, b, w)``: about
min(w, position) keys per query, not the whole prefix.

Two models, one interface (``cost(a, b) -> float64 array``, vectorised):

- :class:`PairsCost`: the number of causal (query, key) pairs. Additive: cutting a
  shard in two conserves it exactly.
- :class:`TableCost`: seconds, from a table of measured kernel throughput by
  (query-shard length, prefix length), interpolated bilinearly in log2 of both.
  It knows that small shards and short documents run the kernel below its peak,
  which pair counts alone do not. The schedulers use it by default.

The rate curve is the kernel's, so a cost-table JSON keeps one table per kernel backend
(attnpool.kernels: flash, fa4, ...) under ``backends``; a table at the top level of the file
(every file written before tables were kept per backend) is the flash backend's. A backend
without a table of its own is costed with flash's, and the TableCost says so (``backend``,
``source``): the pair counts are the same, only the rate curve is another kernel's.

The default table (``resources/cost_h200.json``) was measured on an H200 by
``attnpool profile`` (bench/results/2026-11-21-h200-profile.md has the command); it
agrees with our earlier FlashAttention-2 measurements, which
:func:`build_h200_default_table` reproduces, within a few percent. The flash backend's table is
at its top level; fa4's (FlashAttention-4, measured on an H200 on 2026-11-26:
bench/results/2026-11-26-h200-fa4.md) under ``backends.fa4``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from attnpool.errors import ConfigError, read_json_file
from attnpool.plan.documents import key_start, window_pairs

# Forward FLOPs per (query, key) pair and head: QK^T and PV, 2 FLOPs per multiply-add each.
FWD_FLOPS_PER_PAIR_PER_HEAD_DIM = 4.0
# Backward is about 2.5x the forward FLOPs.
BWD_TO_FWD_FLOPS = 2.5
PHASES = ("fwd", "fwd+bwd")
# The backend of a table at a file's top level that names none (files before per-backend tables).
TOP_LEVEL_BACKEND = "flash"
# What a table is made of, in a file's top level or under backends.NAME.
TABLE_KEYS = ("source", "n_q_heads", "n_kv_heads", "head_dim", "dtype", "phase", "q_grid", "k_grid", "tables",
              "tflops", "attention")


def backend_tables(obj: dict) -> dict:
    """Every kernel backend's table in a cost-table JSON object, by backend name: those under ``backends``,
    and the one at the top level (the ``backend`` it names, else flash)."""
    if not isinstance(obj, dict):
        return {}
    tables = dict(obj.get("backends") or {})
    top = str(obj.get("backend", TOP_LEVEL_BACKEND))  # TableCost.to_json names it
    if top not in tables and any(key in obj for key in ("q_grid", "k_grid", "tables", "tflops")):
        tables[top] = {key: obj[key] for key in TABLE_KEYS if key in obj}
    return tables


def backend_table(obj: dict, backend: str = TOP_LEVEL_BACKEND) -> tuple[dict, str]:
    """(the table, the backend it was measured with) that costs ``backend``'s kernel: its own where the
    file has one, else flash's (ConfigError where the file has neither)."""
    tables = backend_tables(obj)
    for name in (backend, TOP_LEVEL_BACKEND):
        if name in tables:
            if not isinstance(tables[name], dict):
                raise ConfigError("cost_table", f"backends.{name}", "must be a JSON object (a cost table)")
            return tables[name], name
    raise ConfigError("cost_table", ", ".join(sorted(tables)) or "no table",
                      f"has no kernel table for the {backend} backend, nor flash's to stand in; measure one with "
                      f"attnpool profile --attention-backend {backend}")


def doc_costs(cost_model):
    """``(cost(a, b, doc), cost1(a, b, doc))`` for any cost model.

    A per-document model (``per_doc = True``, e.g. sparse attention, whose cost depends
    on each document's pattern) gets the document; the others ignore it.
    """
    if getattr(cost_model, "per_doc", False):
        return cost_model.cost, cost_model.cost1
    return (lambda a, b, doc: cost_model.cost(a, b)), (lambda a, b, doc: cost_model.cost1(a, b))


def for_window(cost_model, window: int | None):
    """``cost_model`` pricing tasks under a sliding window of ``window`` keys (None: causal), where the model
    prices windows (``windowed``); a model that does not (sparse patterns, which refuse windows) as it is."""
    if hasattr(cost_model, "windowed") and getattr(cost_model, "window", None) != window:
        return cost_model.windowed(window)
    return cost_model


def attention_flops(pairs, n_q_heads: int, head_dim: int, phase: str = "fwd+bwd"):
    """FLOPs of core attention over ``pairs`` causal pairs."""
    fwd = FWD_FLOPS_PER_PAIR_PER_HEAD_DIM * head_dim * n_q_heads * np.asarray(pairs, dtype=np.float64)
    return fwd * (1.0 + BWD_TO_FWD_FLOPS) if phase == "fwd+bwd" else fwd


# The share of an exchange's time that ping-pong (or head groups) leaves on the step, the other nano-batch's compute
# hiding the rest. A fit, not a derivation (hiding is a hinge: free up to the other nano-batch's compute, then whole):
# by the simulator on the 2-GPU cells of bench/results/2026-11-30-sim-cad-byte-price.md, 0.3 and 0.2 gain or hold in
# every cell but one (0.4% slower), where 0.5 loses 1.5% at pretrain 256K and 0.1 gives up prolong 128K's 2.8%; at
# 16-256 GPUs 0.2, 0.3 and 0.5 kept plans within 0.5% of each other (a server's bytes counted then as sent plus
# received).
OVERLAPPED_EXCHANGE_SHARE = 0.3


def gibps_problem(gibps) -> str | None:
    """Why ``gibps`` is not a link's rate (GiB/s per GPU), or None."""
    return None if math.isfinite(gibps) and gibps > 0 else "must be a positive number of GiB/s"


def byte_price_problem(cost_model) -> str | None:
    """Why bytes cannot be priced against ``cost_model``'s work (it must count seconds), or None."""
    unit = getattr(cost_model, "unit", None)
    return None if unit == "s" else (f"prices bytes in seconds of attention work, and the cost model "
                                     f"{getattr(cost_model, 'name', type(cost_model).__name__)} counts "
                                     f"{unit or 'work'}: use a kernel table")


def exchange_byte_seconds(gibps: float, recomputed_share: float = 0.0, overlapped: bool = False) -> float:
    """What one byte of a server's forward exchange costs the step, in seconds of its fwd+bwd attention work, on a
    link of ``gibps`` GiB/s per GPU: cad's price of bytes against balance (plan.cad, ``byte_seconds``).

    The backward exchanges move as many bytes again (dQ/dK/dV are Q/K/V's size, dO O's), and a layer whose forward
    runs again in the backward (``recomputed_share`` of the layers: full activation checkpointing) exchanges its
    forward's once more, while its attention work grows by a forward's share (:data:`BWD_TO_FWD_FLOPS`).
    ``overlapped``: ping-pong or head groups hide part of every exchange (:data:`OVERLAPPED_EXCHANGE_SHARE`)."""
    if gibps_problem(gibps):
        raise ConfigError("exchange_gibps", gibps, gibps_problem(gibps))
    if not 0.0 <= recomputed_share <= 1.0:
        raise ConfigError("recomputed_share", recomputed_share, "must be in [0, 1]")
    exchanges = 2.0 + recomputed_share
    work = 1.0 + recomputed_share / (1.0 + BWD_TO_FWD_FLOPS)
    exposed = OVERLAPPED_EXCHANGE_SHARE if overlapped else 1.0
    return exposed * exchanges / work / (gibps * 2**30)


@dataclass(frozen=True)
class PairsCost:
    """Work = (query, key) pairs. Exact, additive, device-independent."""

    window: int | None = None  # a sliding window's keys; None: causal over the whole prefix

    name = "pairs"
    unit = "pairs"

    def windowed(self, window: int | None) -> "PairsCost":
        """The same model for tasks under a sliding window of ``window`` keys (None: causal)."""
        return PairsCost(window)

    def cost1(self, a: int, b: int) -> float:
        """cost() of one task in plain Python (the scheduler's scalar path)."""
        return float(window_pairs(a, b, self.window))

    def cost(self, a, b) -> np.ndarray:
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        return window_pairs(a, b, self.window).astype(np.float64)

    def least_total(self, doc_len) -> float:
        """The least summed cost of tasks that cover each document of ``doc_len`` once, however cut: its pairs."""
        lens = np.asarray(doc_len, dtype=np.int64)
        return float(window_pairs(np.zeros_like(lens), lens, self.window).sum())


@dataclass(frozen=True, eq=False)
class TableCost:
    """Seconds per CA-task from a throughput table (TFLOP/s by query length and prefix length)."""

    q_grid: np.ndarray  # (Nq,) ascending query-shard lengths
    k_grid: np.ndarray  # (Nk,) ascending prefix lengths
    tflops: np.ndarray  # (Nq, Nk) throughput, TFLOP/s counted from causal pairs
    n_q_heads: int
    head_dim: int
    phase: str = "fwd+bwd"
    source: str = ""
    backend: str = TOP_LEVEL_BACKEND  # the kernel backend whose measurements these are
    window: int | None = None  # a sliding window's keys; None: causal over the whole prefix

    name = "table"
    unit = "s"

    # The scheduler calls rate() in its inner loop, so the bilinear interpolant is
    # sampled once on a fine log2 grid (1/32 octave: within 1.5% of the interpolant
    # where the rate is steepest) and looked up by index.
    STEPS_PER_OCTAVE = 32

    def __post_init__(self):
        lq0, lk0 = np.log2(self.q_grid[0]), np.log2(self.k_grid[0])
        nq = int(round((np.log2(self.q_grid[-1]) - lq0) * self.STEPS_PER_OCTAVE)) + 1
        nk = int(round((np.log2(self.k_grid[-1]) - lk0) * self.STEPS_PER_OCTAVE)) + 1
        fq = 2.0 ** (lq0 + np.arange(nq) / self.STEPS_PER_OCTAVE)
        fk = 2.0 ** (lk0 + np.arange(nk) / self.STEPS_PER_OCTAVE)
        fine = self.interpolate(fq[:, None], fk[None, :])
        object.__setattr__(self, "_fine", fine)
        # the best rate of any task of at most q queries over at most k keys (least_total)
        object.__setattr__(self, "_fine_best", np.maximum.accumulate(np.maximum.accumulate(fine, axis=0), axis=1))
        object.__setattr__(self, "_origin", (lq0, lk0))

    def interpolate(self, q_len, k_len) -> np.ndarray:
        """Bilinear interpolation of the table in (log2 q, log2 k), clamped to the grid."""
        gq, gk = np.log2(self.q_grid), np.log2(self.k_grid)
        lq = np.clip(np.log2(np.maximum(q_len, 1)), gq[0], gq[-1])
        lk = np.clip(np.log2(np.maximum(k_len, 1)), gk[0], gk[-1])
        iq = np.minimum(np.searchsorted(gq, lq, side="right") - 1, len(gq) - 2)
        ik = np.minimum(np.searchsorted(gk, lk, side="right") - 1, len(gk) - 2)
        tq = (lq - gq[iq]) / (gq[iq + 1] - gq[iq])
        tk = (lk - gk[ik]) / (gk[ik + 1] - gk[ik])
        t = self.tflops
        lo = t[iq, ik] + tq * (t[iq + 1, ik] - t[iq, ik])
        hi = t[iq, ik + 1] + tq * (t[iq + 1, ik + 1] - t[iq, ik + 1])
        return lo + tk * (hi - lo)

    def rate(self, q_len, k_len) -> np.ndarray:
        """TFLOP/s for tasks of ``q_len`` query tokens over ``k_len`` keys (fine-grid lookup)."""
        return self._fine[self._fine_index(q_len, 0), self._fine_index(k_len, 1)]

    def _fine_index(self, lengths, axis: int) -> np.ndarray:
        """The fine grid's row (axis 0: query lengths) or column (axis 1: key lengths) of ``lengths``, clamped to
        the grid; never smaller for a larger length."""
        i = np.rint((np.log2(np.maximum(lengths, 1)) - self._origin[axis]) * self.STEPS_PER_OCTAVE).astype(np.int64)
        # np.minimum/maximum, not np.clip: clip's per-call overhead dominates on small arrays.
        return np.minimum(np.maximum(i, 0), self._fine.shape[axis] - 1)

    def least_total(self, doc_len) -> float:
        """A lower bound on the summed cost of tasks that cover each document of ``doc_len`` once, however cut and
        wherever served: a part of a document of L tokens has at most L queries over at most L keys, so it runs at
        most at the best rate the table has for such tasks (the table is measured, not monotone), and the parts'
        pairs add up to the document's."""
        lens = np.asarray(doc_len, dtype=np.int64)
        best = self._fine_best[self._fine_index(lens, 0), self._fine_index(lens, 1)]  # (a part's index is no larger)
        flops = attention_flops(window_pairs(np.zeros_like(lens), lens, self.window), self.n_q_heads, self.head_dim,
                                self.phase)
        return float((flops / (best * 1e12)).sum())

    def windowed(self, window: int | None) -> "TableCost":
        """The same kernel's table for tasks under a sliding window of ``window`` keys (None: causal): a task's
        work is its windowed pairs, at the rate of its query length over the keys it reads."""
        table = copy.copy(self)  # the fine grid goes with it: the rate curve is the same
        object.__setattr__(table, "window", window)
        return table

    def cost1(self, a: int, b: int) -> float:
        """cost() of one task in plain Python (the scheduler's scalar path)."""
        fine, s = self._fine, self.STEPS_PER_OCTAVE
        iq = min(max(round((math.log2(max(b - a, 1)) - self._origin[0]) * s), 0), fine.shape[0] - 1)
        keys = b - key_start(a, self.window)
        ik = min(max(round((math.log2(max(keys, 1)) - self._origin[1]) * s), 0), fine.shape[1] - 1)
        pairs = window_pairs(a, b, self.window)
        flops = FWD_FLOPS_PER_PAIR_PER_HEAD_DIM * self.head_dim * self.n_q_heads * pairs
        if self.phase == "fwd+bwd":
            flops *= 1.0 + BWD_TO_FWD_FLOPS
        return flops / (float(fine[iq, ik]) * 1e12)

    def cost(self, a, b) -> np.ndarray:
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        flops = attention_flops(window_pairs(a, b, self.window), self.n_q_heads, self.head_dim, self.phase)
        return flops / (self.rate(b - a, b - key_start(a, self.window)) * 1e12)

    def to_json(self) -> dict:
        return {
            "format": "attnpool-cost-table/1",
            "source": self.source,
            "backend": self.backend,
            "n_q_heads": self.n_q_heads,
            "head_dim": self.head_dim,
            "phase": self.phase,
            "q_grid": self.q_grid.tolist(),
            "k_grid": self.k_grid.tolist(),
            "tflops": np.round(self.tflops, 3).tolist(),
        }

    @classmethod
    def from_json(cls, obj: dict, phase: str | None = None, backend: str = TOP_LEVEL_BACKEND) -> "TableCost":
        """Load the table that costs ``backend``'s kernel (see backend_table). A table may hold several
        phases under ``tables``; pick one."""
        if not isinstance(obj, dict):
            raise ConfigError("cost_table", type(obj).__name__, "must be a JSON object")
        obj, measured_with = backend_table(obj, backend)
        missing = [f for f in ("q_grid", "k_grid", "n_q_heads", "head_dim") if f not in obj]
        if "tables" in obj:
            phase = phase or "fwd+bwd"
            if not isinstance(obj["tables"], dict) or phase not in obj["tables"]:
                raise ConfigError("phase", phase, f"cost table has no '{phase}' table under 'tables'")
            table = obj["tables"][phase]
        else:
            table = obj
            phase = table.get("phase", phase or "fwd+bwd")
        if not isinstance(table, dict) or "tflops" not in table:
            missing.append("tflops")
        if missing:
            raise ConfigError("cost_table", ", ".join(missing), "missing field(s); a table needs q_grid, k_grid, tflops, n_q_heads, head_dim")
        try:
            q = np.asarray(obj["q_grid"], dtype=np.float64)
            k = np.asarray(obj["k_grid"], dtype=np.float64)
            t = np.asarray(table["tflops"], dtype=np.float64)
            heads, dim = int(obj["n_q_heads"]), int(obj["head_dim"])
        except (TypeError, ValueError) as exc:
            raise ConfigError("cost_table", str(exc), "malformed cost table: grids and tflops must be numbers") from None
        if heads < 1 or dim < 1:
            raise ConfigError("cost_table", f"n_q_heads={heads} head_dim={dim}", "must both be >= 1")
        if q.ndim != 1 or k.ndim != 1 or t.shape != (len(q), len(k)) or len(q) < 2 or len(k) < 2 \
                or not np.all(np.isfinite(t)) or np.any(t <= 0) or np.any(q < 1) or np.any(k < 1) \
                or np.any(np.diff(q) <= 0) or np.any(np.diff(k) <= 0):
            raise ConfigError("cost_table", f"shape {t.shape}", "tflops must be positive and finite with shape (len(q_grid), len(k_grid)); grids ascending, >= 1, at least 2 points each")
        source = str(obj.get("source", ""))
        if measured_with != backend:
            source = f"{source} ({measured_with}'s table standing in for {backend}, which has none)".lstrip()
        return cls(q, k, t, heads, dim, phase, source, measured_with)

    def scaled_to(self, n_q_heads: int, head_dim: int) -> "TableCost":
        """The same throughput for another head configuration (FLOPs scale; rate is kept)."""
        return dataclasses.replace(self, n_q_heads=n_q_heads, head_dim=head_dim)


# Measured on one H200, FlashAttention-2 varlen (PyTorch), bf16, 32 query / 8 KV heads of 128.
# Query-shard sweep at prefix 32K; "whole" documents of a given length.
_H200_SHARD = {32: (86, 54), 64: (174, 108), 128: (339, 181), 256: (335, 235), 512: (341, 275),
               1024: (344, 301), 4096: (345, 325), 65536: (348, 331)}
_H200_WHOLE_DOC = {512: (152, 139), 2048: (292, 255), 8192: (338, 313), 65536: (348, 331)}


def _interp_log2(table: dict, x: np.ndarray, phase_index: int) -> np.ndarray:
    keys = np.array(sorted(table), dtype=np.float64)
    vals = np.array([table[k][phase_index] for k in sorted(table)], dtype=np.float64)
    return np.interp(np.log2(x), np.log2(keys), vals)


def build_h200_default_table(phase: str = "fwd+bwd") -> TableCost:
    """Default table: a task runs at min(rate of its shard size, rate of a whole doc of its prefix length).

    The shard sweep was measured at a 32K prefix, where the prefix does not limit the
    kernel; short prefixes limit it the way short whole documents do. Taking the
    smaller of the two reproduces both measured sweeps at their measured points.
    """
    idx = PHASES.index(phase)
    grid = 2.0 ** np.arange(5, 20)  # 32 .. 512K
    shard_rate = _interp_log2(_H200_SHARD, grid, idx)
    doc_rate = _interp_log2(_H200_WHOLE_DOC, grid, idx)
    tflops = np.minimum(shard_rate[:, None], doc_rate[None, :])
    return TableCost(grid, grid.copy(), tflops, 32, 128, phase, "H200 FlashAttention-2 varlen, bf16, earlier measurements")


@lru_cache(maxsize=16)
def _load_packaged(name: str, phase: str, backend: str) -> TableCost:
    text = resources.files("attnpool.resources").joinpath(name).read_text()
    return TableCost.from_json(json.loads(text), phase, backend)


def default_cost_model(phase: str = "fwd+bwd", backend: str = TOP_LEVEL_BACKEND) -> TableCost:
    """The shipped table of ``backend``'s kernel (see backend_table), measured on an H200 with ``attnpool profile``."""
    if phase not in PHASES:
        raise ConfigError("phase", phase, f"must be one of {PHASES}")
    return _load_packaged("cost_h200.json", phase, backend)


def load_cost_model(spec: str | Path | None, phase: str = "fwd+bwd", backend: str = TOP_LEVEL_BACKEND):
    """``None``/"table": the default table; "pairs": :class:`PairsCost`; else a JSON path. A table is the
    one of kernel backend ``backend`` (see backend_table)."""
    if spec is None or spec == "table":
        return default_cost_model(phase, backend)
    if spec == "pairs":
        return PairsCost()
    if not Path(spec).is_file():
        raise ConfigError("cost_model", str(spec), "not 'pairs', 'table' or an existing JSON file")
    try:
        return TableCost.from_json(read_json_file("cost_model", spec), phase, backend)
    except ConfigError as exc:  # (the table's own field, named as what the user gave: the file)
        if exc.field == "cost_model":
            raise
        raise ConfigError("cost_model", str(spec), f"is not a cost table: {exc.field}={exc.value!r}: "
                                                   f"{exc.problem}") from None


def default_min_shard_tokens(model=None, efficiency: float = 0.8, prefix: int = 32768) -> int:
    """Smallest power-of-two query shard whose fwd+bwd rate is >= ``efficiency`` of a whole document.

    With the H200 table: 512 tokens (83%; 256 tokens reach 71%, 128 only 55%).
    """
    table = model if isinstance(model, TableCost) else default_cost_model("fwd+bwd")
    whole = float(table.rate(prefix, prefix))
    for q in table.q_grid:
        if q <= prefix and float(table.rate(q, prefix)) >= efficiency * whole:
            return int(q)
    return int(prefix)
