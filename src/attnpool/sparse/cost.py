"""Cost of a sparse CA-task from its pattern: tile counts times per-GPU coefficients.

A CA-task [a, b) of a document (queries a..b-1, keys 0..b-1) runs the query
blocks I in [i0, i1) = [a // B, ceil(b / B)) (a shard that starts mid-block
still pays its whole first tile, as the kernel does). Per query head:

- slash tiles (B x B): query block I visits the diagonals Delta <= I, so
  ``slash = sum_{Delta in set} max(0, i1 - max(i0, Delta))`` -- the tile
  count of MTraining's kernels (arXiv 2510.18830) without its factor 2, because a token slash is stored as the (at most
  2) block diagonals it touches, deduplicated.
- bar tiles (B x chunk gathered columns): query block I visits the verticals with
  c // B <= I - run (``vert_active``), in chunks: ``bars = sum_I ceil(v(I) / chunk)``,
  a prefix count over the sorted columns, so ``bars(i0, i1) = P(i1) - P(i0)``.

Both are summed over heads and turned into seconds per phase:
``t = a * slash + b * bars + c``. Defaults: our fit of MTraining's
released kernels on an H200 (MTraining: arXiv 2510.18830) (forward a = 10.1 ns, b = 11.1 ns; backward 55.8, 79.5 ns);
``bench/gpu_sparse.py`` fits ours and writes :class:`SparseCoefficients` JSON.

Heavy shared columns (sinks) make no hot spot here: a vertical column is work of
every query block that visits it, and the model charges it there (the prefix
count v(I) includes the sinks for every block past the local band). Each CA-task
carries its own KV prefix, so a sink column is computed by the server of each
query shard, in proportion to the shard's query blocks, never by one server that
"owns" the sink key (the ring-attention hot spot MTraining measured). What the
count does capture is that late query blocks see more verticals than early ones,
so a document's tail costs more bar work than its head.

The planner calls cost models with (a, b) only; this one needs the document
too: ``cost(a, b, doc)`` / ``cost1(a, b, doc)`` with ``doc`` the planner's dense
document index (``PieceTable.doc``). ``per_doc = True`` tells the planner so.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from attnpool.errors import ConfigError
from attnpool.sparse.coefficients import H200_MEASURED, PHASES, SparseCoefficients  # noqa: F401 (re-exported)
from attnpool.sparse.pattern import LENGTH_CLASSES, VerticalSlashPattern


def fit_coefficients(slash, bars, seconds, tasks=None) -> tuple[float, float, float]:
    """Least-squares (a, b, c) >= 0 of ``seconds ~ a * slash + b * bars + c * tasks``.

    ``tasks`` (kernel calls' task counts) defaults to 1 per sample. Coefficients
    that come out negative are dropped and the rest refitted.
    """
    slash, bars, seconds = (np.asarray(x, dtype=np.float64) for x in (slash, bars, seconds))
    tasks = np.ones_like(seconds) if tasks is None else np.asarray(tasks, dtype=np.float64)
    cols = [slash, bars, tasks]
    keep = [0, 1, 2]
    while keep:
        x = np.stack([cols[i] for i in keep], 1)
        sol, *_ = np.linalg.lstsq(x, seconds, rcond=None)
        if (sol >= 0).all():
            out = [0.0, 0.0, 0.0]
            for i, value in zip(keep, sol):
                out[i] = float(value)
            return tuple(out)
        keep = [i for i, value in zip(keep, sol) if value >= 0] if (sol >= 0).any() else keep[:-1]
    return 0.0, 0.0, 0.0


class SparseCost:
    """Per-document sparse cost model: ``cost(a, b, doc)`` seconds of CA-task [a, b) of ``doc``.

    Holds, per document, prefix sums over block diagonals (head counts and head
    counts times Delta) and over query blocks (bar tiles), flat with offsets.
    """

    name = "sparse"
    unit = "s"
    per_doc = True

    def __init__(self, doc_len, cnt, bars, block: int, chunk: int,
                 coefficients: SparseCoefficients | None = None, phase: str = "fwd+bwd"):
        """``cnt[d]``: heads with each diagonal 0..nb-1; ``bars[d]``: bar tiles of each query block."""
        self.doc_len = np.asarray(doc_len, dtype=np.int64)
        self.block, self.chunk = int(block), int(chunk)
        self.coefficients = coefficients or SparseCoefficients()
        self.phase = phase
        self.a, self.b, self.c = self.coefficients.phase(phase)
        nb = -(-self.doc_len // self.block)
        self.nb = nb
        # Each document's prefixes occupy nb + 1 slots starting at off[d].
        self.off = np.concatenate([[0], np.cumsum(nb + 1)])[:-1]
        c0, c1, pb = [], [], []
        for counts, bar in zip(cnt, bars):
            counts = np.asarray(counts, dtype=np.float64)
            delta = np.arange(counts.size, dtype=np.float64)
            c0.append(np.concatenate([[0.0], np.cumsum(counts)]))
            c1.append(np.concatenate([[0.0], np.cumsum(counts * delta)]))
            pb.append(np.concatenate([[0.0], np.cumsum(np.asarray(bar, dtype=np.float64))]))
        empty = np.zeros(0)
        self.C0 = np.concatenate(c0) if c0 else empty
        self.C1 = np.concatenate(c1) if c1 else empty
        self.PB = np.concatenate(pb) if pb else empty

    # --- construction ---

    @classmethod
    def from_pattern(cls, pattern: VerticalSlashPattern, coefficients: SparseCoefficients | None = None,
                     phase: str = "fwd+bwd", chunk: int = 64) -> "SparseCost":
        """Exact tile counts of a known pattern (one host copy of small per-block arrays)."""
        cnt = torch.where(pattern.blk_doc < pattern.num_docs, pattern.slash.sum(0), 0)  # heads per diagonal
        cnt, bars = cnt.cpu().numpy(), pattern.block_tiles(chunk)[1].cpu().numpy()
        off = pattern.blk_off.cpu().numpy()
        doc_len = pattern.doc_len.cpu().numpy()
        split = lambda x: [x[off[i]:off[i + 1]] for i in range(len(doc_len))]
        return cls(doc_len, split(cnt), split(bars), pattern.block, chunk, coefficients, phase)

    @classmethod
    def uniform(cls, doc_len, num_heads: int, diagonals, verticals, *, block: int = 128, chunk: int = 64,
                local_blocks: int = 2, sinks: int = 64, min_doc_len: int = 8192,
                coefficients: SparseCoefficients | None = None, phase: str = "fwd+bwd") -> "SparseCost":
        """A prior for planning before patterns exist: per head, the local diagonals plus
        ``diagonals`` others spread evenly, ``verticals`` columns spread evenly plus
        the sinks (each one number, or one per document); documents shorter than ``min_doc_len``
        dense. Expected tile counts."""
        lengths = np.asarray(doc_len, dtype=np.int64)
        per_doc = zip(lengths.tolist(), np.broadcast_to(np.asarray(diagonals, dtype=np.float64), lengths.shape).tolist(),
                      np.broadcast_to(np.asarray(verticals, dtype=np.float64), lengths.shape).tolist())
        cnt, bars = [], []
        for L, doc_diagonals, doc_verticals in per_doc:
            nb = -(-L // block)
            if L < min_doc_len:
                cnt.append(np.full(nb, float(num_heads)))
                bars.append(np.zeros(nb))
                continue
            c = np.zeros(nb)
            c[:min(local_blocks, nb)] = num_heads
            rest = nb - min(local_blocks, nb)
            if rest:
                c[min(local_blocks, nb):] = num_heads * min(1.0, doc_diagonals / rest)
            cnt.append(c)
            run = min(local_blocks, nb)
            before = np.clip(np.arange(nb) - run + 1, 0, None)  # key blocks visited as verticals
            v = np.minimum(sinks, before * block) + doc_verticals * before / max(nb, 1)
            bars.append(num_heads * np.ceil(v / chunk))
        return cls(doc_len, cnt, bars, block, chunk, coefficients, phase)

    def with_phase(self, phase: str) -> "SparseCost":
        other = object.__new__(SparseCost)
        other.__dict__.update(self.__dict__)
        other.phase = phase
        other.a, other.b, other.c = self.coefficients.phase(phase)
        return other

    # --- tile counts ---

    def tiles(self, a, b, doc) -> tuple[np.ndarray, np.ndarray]:
        """(slash tiles, bar tiles) of tasks [a, b) of ``doc``, summed over heads (vectorised)."""
        a = np.asarray(a, dtype=np.int64)
        b = np.asarray(b, dtype=np.int64)
        doc = np.asarray(doc, dtype=np.int64)
        B = self.block
        nb = self.nb[doc]
        i0 = np.minimum(a // B, nb)
        i1 = np.where(b > a, np.minimum(-(-b // B), nb), i0)
        i1 = np.maximum(i1, i0)
        off = self.off[doc]
        x0 = off + np.minimum(i0 + 1, nb)  # prefix up to Delta <= i0
        x1 = off + i1
        c0_i0, c0_i1 = self.C0[x0] - self.C0[off], self.C0[x1] - self.C0[off]
        c1_i0, c1_i1 = self.C1[x0] - self.C1[off], self.C1[x1] - self.C1[off]
        slash = (i1 - i0) * c0_i0 + np.where(i1 > i0 + 1, i1 * (c0_i1 - c0_i0) - (c1_i1 - c1_i0), 0.0)
        bars = self.PB[off + i1] - self.PB[off + i0]
        return slash, bars

    def cost(self, a, b, doc) -> np.ndarray:
        slash, bars = self.tiles(a, b, doc)
        tasks = (np.asarray(b) > np.asarray(a)).astype(np.float64)
        return self.a * slash + self.b * bars + self.c * tasks

    def cost1(self, a: int, b: int, doc: int) -> float:
        return float(self.cost(np.array([a]), np.array([b]), np.array([doc]))[0])

    def density(self, doc) -> np.ndarray:
        """Slash-tile fraction of each whole document against its dense causal tiles."""
        doc = np.asarray(doc, dtype=np.int64)
        L = self.doc_len[doc]
        slash, _ = self.tiles(np.zeros_like(L), L, doc)
        nb = self.nb[doc]
        heads = (self.C0[self.off[doc] + 1] - self.C0[self.off[doc]])  # every head has diagonal 0
        return slash / np.maximum(heads * nb * (nb + 1) / 2, 1)


def pairs_coefficients(block: int, chunk: int, num_heads: int) -> SparseCoefficients:
    """Coefficients that count (query, key) pairs of one head instead of seconds, to mix with the ``pairs``
    dense model (which counts one head's pairs): tile counts are summed over heads, so each head's tile
    weighs 1 / num_heads of its pairs."""
    return SparseCoefficients(block * block / num_heads, block * chunk / num_heads, 0.0, 0.0, 0.0, 0.0,
                              source="pairs of one head: B x B per slash tile, B x chunk per bar tile, / heads")


class LayerMixCost:
    """Cost of a CA-task in the average layer: dense layers at one model, sparse layers at another.

    The plan serves every layer, so with ``--dense-layers`` it balances
    ``(dense_layers * dense.cost(a, b) + sparse_layers * s(a, b, doc)) / layers``
    (per layer, like every other cost model), where ``s`` is ``sparse.cost`` for
    a sparse document and ``dense.cost`` for one below the sparse length threshold
    (those run through the dense kernel in every layer). Both models must count in
    one unit (seconds with the measured table, pairs with ``pairs``).
    """

    per_doc = True

    def __init__(self, dense, sparse: SparseCost, dense_layers: int, sparse_layers: int, sparse_docs):
        self.dense, self.sparse = dense, sparse
        self.dense_layers, self.sparse_layers = int(dense_layers), int(sparse_layers)
        self.sparse_docs = np.asarray(sparse_docs, dtype=bool)
        self.name = f"{getattr(dense, 'name', 'dense')}+sparse"
        self.unit = getattr(dense, "unit", "work")

    def cost(self, a, b, doc) -> np.ndarray:
        dense = self.dense.cost(a, b)
        sparse = np.where(self.sparse_docs[doc], self.sparse.cost(a, b, doc), dense)
        return (self.dense_layers * dense + self.sparse_layers * sparse) / (self.dense_layers + self.sparse_layers)

    def cost1(self, a: int, b: int, doc: int) -> float:
        dense = self.dense.cost1(a, b)
        sparse = self.sparse.cost1(a, b, doc) if self.sparse_docs[doc] else dense
        return (self.dense_layers * dense + self.sparse_layers * sparse) / (self.dense_layers + self.sparse_layers)


class ServedPrice:
    """What the planner charges for the work a server ran, to price what its kernels measured in the planner's unit
    (runtime.sparse.SparseStats' ``served_work``): per (tile, head) of the sparse kernels, forward and backward
    (``slash``, ``bar``), and a dense document's query span [start, end) by the dense model (``dense_cost``), as
    :class:`LayerMixCost` prices a sparse layer's tasks. A per-task constant has no place in it (served spans are
    not the planner's tasks), and the planning prices have none (:meth:`SparsePrior._pricing`)."""

    def __init__(self, dense, coefficients: SparseCoefficients, phase: str = "fwd+bwd", sparse_scale: float = 1.0):
        """``sparse_scale``: what the plans multiply the tiles' prices by (:attr:`SparsePrior.kernel_scale`);
        ``slash`` and ``bar`` are the prices before it, what :meth:`SparsePrior.update_kernel_scale` fits against."""
        self.dense = dense
        self.slash, self.bar, task = coefficients.phase(phase)
        self.sparse_scale = float(sparse_scale)
        if task:
            raise ConfigError("sparse_cost.task", task, "a per-task constant cannot price served spans: use 0")

    def dense_cost(self, start, end) -> float:
        return float(np.sum(self.dense.cost(np.asarray(start, dtype=np.int64), np.asarray(end, dtype=np.int64))))

    def tiles_cost(self, slash: float, bars: float) -> float:
        """Slash tiles and bars (x heads) at the calibration's prices, before ``sparse_scale``."""
        return self.slash * slash + self.bar * bars


class SparsePrior:
    """The expected pattern size of the next step, for planning it before its patterns exist.

    A step's plan is made before its forward pass estimates the patterns, so cad
    balances :meth:`SparseCost.uniform` tile counts: per (sparse document, head),
    the local band plus ``diagonals`` block diagonals, the sinks plus
    ``verticals`` columns. They start from the caps (diagonals: the slash cap in
    blocks; verticals: half the column cap) and then follow the patterns
    actually estimated (:meth:`update` with the step's ``SparseStats`` sums, an
    exponential average with weight ``smoothing`` on the newest step), by the documents'
    length class (``sparse.pattern.length_class``, half an octave each): a pattern's size
    depends on its length (an untrained model's 192 slash offsets cover 84% of a 9K
    document's block diagonals and 9% of a 185K one's), and one size for every length
    left cad's plans at a measured 1.2-1.4 max/mean on prolong 256K (bench/results/
    2026-11-28-h200x4-sparse-balance-measured.md). A document is priced with its class's
    sizes, interpolated between the classes seen (in log length; the nearest seen beyond
    them), and with the overall sizes before any class is seen.

    Where the plans are in seconds (a measured dense table) and ``config.price_from_kernels`` (off by default), the
    tiles' prices also follow the kernels: :meth:`update_kernel_scale` fits every rank's measured kernel seconds to
    its served work priced by the calibration (sparse tiles) and by the dense table (short documents), and the
    plans multiply the tiles' prices by the fitted :attr:`kernel_scale`. On one H200 the sparse kernel ran 1.07x its
    calibrated price at caps 192 / 1024 and 1.81x at 128 / 512, where the dense table's price held to 3%
    (bench/results/2026-12-01-h200-sparse-served-balance.md): the calibration alone left those plans 1.035 in
    kernel seconds where they were 1.006 in price. Over those runs' rows, step by step, the fit gives 0.94-1.14 and
    1.28-1.71.
    """

    # kernel_scale's bounds: a fit outside them is taken as noise or a mismatched table, not as the kernels
    KERNEL_SCALE_RANGE = (0.25, 4.0)
    # the ranks' sparse work spread less than this (its deviations' squares against its squares) tells nothing
    KERNEL_FIT_MIN_SPREAD = 1e-3

    def __init__(self, config, num_heads: int, head_dim: int, n_layers: int, smoothing: float = 0.5):
        self.config, self.num_heads, self.head_dim, self.smoothing = config, int(num_heads), int(head_dim), float(smoothing)
        self.dense_layers = min(config.dense_layers, n_layers)
        self.sparse_layers = n_layers - self.dense_layers
        self.local_blocks = -(-(config.local_window - 1) // config.block) + 1  # diagonals of offsets < window
        self.diagonals = float(config.slash_cap) / config.block
        self.verticals = float(max(config.vertical_cap - config.sink_tokens, 0)) / 2
        # per length class: whether seen, then its diagonals and verticals (as the overall two)
        self.by_length = np.zeros((LENGTH_CLASSES, 3))
        self._priced: dict = {}  # id(dense model) -> (it, it for this model's heads, sparse coefficients)
        self.kernel_scale = 1.0
        # the kernel fit's sums (covariance, spread, squares: update_kernel_scale), averaged over the steps as the
        # sizes are
        self.kernel_fit = np.zeros(3)
        self.kernel_steps = 0

    def state_dict(self) -> dict:
        return {"diagonals": float(self.diagonals), "verticals": float(self.verticals),
                "by_length": self.by_length.tolist(), "kernel_scale": float(self.kernel_scale),
                "kernel_fit": self.kernel_fit.tolist(), "kernel_steps": int(self.kernel_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.diagonals, self.verticals = float(state["diagonals"]), float(state["verticals"])
        # (checkpoints written before the sizes were kept by length, or before the kernel fit, have none)
        by_length = np.array(state.get("by_length", np.zeros((LENGTH_CLASSES, 3))), dtype=np.float64)
        if by_length.shape != (LENGTH_CLASSES, 3):
            raise ValueError(f"sparse prior by_length of shape {by_length.shape}: expected ({LENGTH_CLASSES}, 3)")
        self.by_length = by_length
        self.kernel_scale = float(state.get("kernel_scale", 1.0))
        self.kernel_fit = np.array(state.get("kernel_fit", np.zeros(3)), dtype=np.float64).reshape(3)
        self.kernel_steps = int(state.get("kernel_steps", 0))

    def update_kernel_scale(self, kernel_s, sparse_work, dense_work, groups=None) -> None:
        """Fold in one step's every rank's sparse-layer kernel seconds and its served work, the tiles at the
        calibration's prices (``ServedPrice.tiles_cost``) and the short documents by the dense table, and refit
        :attr:`kernel_scale`, the seconds per priced second of tiles: least squares of the ranks' deviations from
        their group's mean, ``kernel_s - dense_work ~ kernel_scale * sparse_work``, over the steps (each step's sums
        weighted as the sizes' are), within ``KERNEL_SCALE_RANGE``.

        ``groups``: each rank's group of the ranks a plan balances together (a pipeline stage's, whose layers other
        stages do not run; default one group). Deviations within them, because what every rank of a group pays alike
        (a call's fixed costs, its copies, a stage's number of layers) prices nothing a plan can move, and would pull
        the fit towards it. The dense table's prices are taken as they are (the dense kernel matched them within 3%
        on an H200). The ranks' different mixes of long and short documents tell the tiles' price apart: the scale
        changes once two steps are in and their sparse work spreads within the groups. Ranks that ran no sparse
        layer's kernels, or whose clock read no finite time, are left out."""
        k, x, d = (np.asarray(v, dtype=np.float64).reshape(-1) for v in (kernel_s, sparse_work, dense_work))
        g = np.zeros(len(k), dtype=np.int64) if groups is None else np.asarray(groups).reshape(-1)
        ran = np.isfinite(k) & np.isfinite(x) & np.isfinite(d) & (k > 0) & (x + d > 0)
        dx, dy = np.zeros(len(k)), np.zeros(len(k))
        for group in np.unique(g[ran]):
            members = ran & (g == group)
            if members.sum() >= 2:
                y = k[members] - d[members]
                dx[members], dy[members] = x[members] - x[members].mean(), y - y.mean()
        if not dx.any():
            return
        w = 1.0 if self.kernel_steps == 0 else self.smoothing
        self.kernel_fit = (1 - w) * self.kernel_fit + w * np.array([dx @ dy, dx @ dx, x[ran] @ x[ran]])
        self.kernel_steps += 1
        covariance, spread, size = self.kernel_fit
        if self.kernel_steps >= 2 and spread > self.KERNEL_FIT_MIN_SPREAD * size and covariance > 0:
            self.kernel_scale = float(np.clip(covariance / spread, *self.KERNEL_SCALE_RANGE))

    def update(self, sparse_heads: float, diagonals: float, verticals: float, by_length=None) -> None:
        """Fold in one step's sums over its sparse (document, head) pairs (all layers, all ranks), overall and, where
        given, by length class ((LENGTH_CLASSES, 3): sparse heads, diagonals, verticals)."""
        if sparse_heads > 0:
            self.diagonals, self.verticals = self._folded(self.diagonals, self.verticals, sparse_heads, diagonals,
                                                          verticals)
        by_length = np.zeros((0, 3)) if by_length is None else np.asarray(by_length)
        for c in np.flatnonzero(by_length[:, 0] > 0):
            seen, old_d, old_v = self.by_length[c]
            # a class seen for the first time takes its sizes as they are
            self.by_length[c] = (1.0, *self._folded(old_d, old_v, *by_length[c], w=None if seen else 1.0))

    def _folded(self, old_diagonals, old_verticals, heads, diagonals, verticals, w=None):
        """Sizes after one step's sums: the local band and the sinks taken out, averaged in with weight ``w``."""
        w = self.smoothing if w is None else w
        seen_diagonals = max(diagonals / heads - self.local_blocks, 0.0)
        seen_verticals = max(verticals / heads - self.config.sink_tokens, 0.0)
        return (1 - w) * old_diagonals + w * seen_diagonals, (1 - w) * old_verticals + w * seen_verticals

    def sizes(self, doc_len) -> tuple[np.ndarray, np.ndarray]:
        """(diagonals, verticals) the prior gives each document of these lengths."""
        lengths = np.asarray(doc_len, dtype=np.float64)
        seen = np.flatnonzero(self.by_length[:, 0] > 0)
        if not len(seen):
            return np.full(lengths.shape, self.diagonals), np.full(lengths.shape, self.verticals)
        x = 2 * np.log2(np.maximum(lengths, 1))  # the class coordinate, continuous; class c's middle at c + 0.5
        return tuple(np.interp(x, seen + 0.5, self.by_length[seen, i]) for i in (1, 2))

    def _pricing(self, dense_model):
        """(dense model for this model's heads, sparse coefficients) in ``dense_model``'s unit: once per run."""
        if id(dense_model) not in self._priced:
            cfg, scaled = self.config, dense_model
            if getattr(dense_model, "unit", None) == "s":
                # Both models in seconds for this model's heads: the dense table scaled from the
                # shape it was measured with, the sparse kernels' per-(tile, head) cost by head_dim
                # from the 128 they were measured with.
                if hasattr(dense_model, "scaled_to"):
                    scaled = dense_model.scaled_to(self.num_heads, self.head_dim)
                # A calibration's per-call constants (index building, buffers) are the same on every
                # server, so they are left out of task costs, as in H200_MEASURED.
                coefficients = dataclasses.replace(cfg.coefficients(), fwd_task=0.0, bwd_task=0.0).tiles_times(
                    self.head_dim / 128, "for head_dim")
            else:
                coefficients = pairs_coefficients(cfg.block, cfg.vertical_chunk, self.num_heads)
            # The model itself is kept too, so that its id is not reused by another while cached.
            self._priced[id(dense_model)] = (dense_model, scaled, coefficients)
        return self._priced[id(dense_model)][1:]

    def learns_kernel_scale(self, dense_model) -> bool:
        """Whether plans in ``dense_model``'s unit follow the kernels' seconds (:meth:`update_kernel_scale`)."""
        return self.config.price_from_kernels and getattr(dense_model, "unit", None) == "s"

    def _scaled(self, dense_model, coefficients: SparseCoefficients) -> SparseCoefficients:
        """``coefficients``' tile prices as plans in ``dense_model``'s unit use them: times :attr:`kernel_scale`
        where they follow the kernels."""
        if not self.learns_kernel_scale(dense_model) or self.kernel_scale == 1.0:
            return coefficients
        return coefficients.tiles_times(self.kernel_scale, "as the kernels ran")

    def served_price(self, dense_model) -> ServedPrice:
        """How the plans made with ``dense_model`` now price served work (:class:`ServedPrice`)."""
        scale = self.kernel_scale if self.learns_kernel_scale(dense_model) else 1.0
        return ServedPrice(*self._pricing(dense_model), sparse_scale=scale)

    def cost_model(self, doc_len, dense_model) -> LayerMixCost:
        """The planning cost of a batch with these document lengths, in ``dense_model``'s unit."""
        cfg = self.config
        given, (dense_model, coefficients) = dense_model, self._pricing(dense_model)
        coefficients = self._scaled(given, coefficients)
        diagonals, verticals = self.sizes(doc_len)
        sparse = SparseCost.uniform(doc_len, self.num_heads, np.round(diagonals), np.round(verticals),
                                    block=cfg.block, chunk=cfg.vertical_chunk, local_blocks=self.local_blocks,
                                    sinks=cfg.sink_tokens, min_doc_len=cfg.min_doc_len, coefficients=coefficients)
        sparse_docs = np.asarray(doc_len) >= cfg.min_doc_len
        return LayerMixCost(dense_model, sparse, self.dense_layers, self.sparse_layers, sparse_docs)
