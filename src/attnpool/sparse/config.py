"""``SparseConfig``: the options of dynamic vertical-slash sparse attention, validated.

Training flags map one to one (train/config.py):
``--sparse vertical-slash`` -> ``mode``, ``--sparse-coverage`` -> ``coverage``,
``--sparse-min-doc-len`` -> ``min_doc_len``, ``--dense-layers N`` -> ``dense_layers``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from attnpool.errors import ConfigError
from attnpool.sparse.coefficients import H200_MEASURED, SparseCoefficients

MODES = ("none", "vertical-slash")
KV_TRANSFERS = ("prefix", "read")


@dataclass(frozen=True)
class SparseConfig:
    """Vertical-slash pattern estimation and kernel granularity.

    - ``coverage``: greedy selection stops once the chosen verticals hold this share
      of the estimating queries' column mass, and (separately) once the chosen
      slashes hold this share of their diagonal mass, so the union holds at least it.
    - ``vertical_cap`` / ``slash_cap``: at most this many vertical columns / slash
      offsets per (document, head), forced ones included.
    - ``min_doc_len``: documents shorter than this stay dense.
    - ``last_queries``: the estimating queries are each document's last this many
      (fewer for shorter documents).
    - ``sink_tokens``: the first this many keys are always vertical columns.
    - ``local_window``: slash offsets 0 .. local_window-1 are always kept (with
      ``block`` 128 and window 128: block diagonals 0 and 1).
    - ``block``: query/key block of the slash tiles (128 on GPUs; tests use less).
    - ``vertical_chunk``: vertical columns gathered per kernel step; the cost model counts in it too.
    - ``dense_layers``: the first this many transformer layers stay dense.
    - ``kv_transfer``: ``"prefix"`` sends every sparse CA-task its whole KV prefix with the
      queries; ``"read"`` sends a server other than a document's estimating one only the KV
      rows its tasks' patterns read, after estimation (runtime.sparse_kv): fewer bytes, one
      more exchange and one host read per sparse layer.
    - ``cost_coefficients``: a :class:`~attnpool.sparse.coefficients.SparseCoefficients` JSON file, the
      calibration of the sparse kernels on the GPU in use (``bench/gpu_sparse.py --out DIR`` writes
      ``DIR/sparse_cost_coefficients.json``); ``cad`` prices sparse work with its per-tile costs.
      Empty: the packaged H200 fit (``sparse.coefficients.H200_MEASURED``). Seconds are weighed against the
      dense cost table's, so give the same GPU's (``attnpool profile``); with the ``pairs`` cost model
      the file is checked but unused.
    - ``price_from_kernels``: with a dense cost table in seconds, ``cad`` multiplies the tiles' prices by what the
      kernels' measured seconds say they cost against the dense table's (``sparse.cost.SparsePrior.kernel_scale``,
      fitted every step; the metric ``sparse_kernel_price_scale``). Off by default until a GPU run shows its plans
      balance better (it is checked in a CPU simulation only): the calibration's prices as they are, and plans that
      do not depend on timings.
    """

    mode: str = "vertical-slash"
    coverage: float = 0.9
    vertical_cap: int = 4096
    slash_cap: int = 4096
    min_doc_len: int = 8192
    last_queries: int = 64
    sink_tokens: int = 64
    local_window: int = 128
    block: int = 128
    vertical_chunk: int = 64
    dense_layers: int = 0
    kv_transfer: str = "prefix"
    cost_coefficients: str = ""
    price_from_kernels: bool = False
    # The file's coefficients, read once, when the config is made (not an option: no init, repr or compare).
    _coefficients: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ConfigError("sparse", self.mode, f"unknown sparse mode; choose one of {', '.join(MODES)}")
        if self.kv_transfer not in KV_TRANSFERS:
            raise ConfigError("sparse_kv_transfer", self.kv_transfer, f"choose one of {', '.join(KV_TRANSFERS)}")
        if not isinstance(self.coverage, (int, float)) or isinstance(self.coverage, bool) \
                or not math.isfinite(self.coverage) or not (0.0 < self.coverage <= 1.0):
            raise ConfigError("sparse_coverage", self.coverage, "must be a number in (0, 1]")
        for name in ("vertical_cap", "slash_cap", "last_queries", "local_window", "block", "vertical_chunk"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"sparse_{name}", value, "must be an integer >= 1")
        for name in ("min_doc_len", "sink_tokens", "dense_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"sparse_{name}" if name != "dense_layers" else name, value,
                                  "must be an integer >= 0")
        for name in ("block", "vertical_chunk"):
            value = getattr(self, name)
            if value & (value - 1) or value < 16:
                raise ConfigError(f"sparse_{name}", value, "must be a power of two >= 16 (a Triton tile size)")
        if not isinstance(self.price_from_kernels, bool):
            raise ConfigError("sparse_price_from_kernels", self.price_from_kernels, "must be true or false")
        if self.sink_tokens > self.vertical_cap:
            raise ConfigError("sparse_sink_tokens", self.sink_tokens,
                              f"exceeds vertical_cap={self.vertical_cap}: the forced sinks must fit in the cap")
        if self.local_window > self.slash_cap:
            raise ConfigError("sparse_local_window", self.local_window,
                              f"exceeds slash_cap={self.slash_cap}: the forced local band must fit in the cap")
        if self.cost_coefficients:  # a missing or malformed file is refused here, before training
            try:
                object.__setattr__(self, "_coefficients", SparseCoefficients.load(self.cost_coefficients))
            except ConfigError as error:
                raise ConfigError("sparse_cost_coefficients", self.cost_coefficients, error.problem) from None

    def coefficients(self):
        """The sparse kernels' cost per (tile, head): ``cost_coefficients``' file, or the packaged H200 fit."""
        return self._coefficients or H200_MEASURED

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether transformer layer ``layer`` (0-based) runs sparse."""
        return self.enabled and layer >= self.dense_layers
