"""Dynamic vertical-slash sparse attention: configuration, online pattern estimation,
the attended set, pattern exchange between servers, and a sparse-aware cost model.

    cfg = SparseConfig(coverage=0.9)
    pattern = estimate_vertical_slash(q, k, cu_q, cu_k, cfg)      # per document and query head
    out, lse = kernels.sparse.forward(q, k, v, cu_q, cu_k, max_q, max_k, pattern=pattern)
    model = SparseCost.from_pattern(pattern)                      # cost(a, b, doc) in seconds

The configuration and the coefficients load without torch; the rest on first use (PEP 562).
"""

from attnpool.sparse.coefficients import H200_MEASURED, SparseCoefficients
from attnpool.sparse.config import SparseConfig

__all__ = ["H200_MEASURED", "Selection", "SparseCoefficients", "SparseConfig", "SparseCost", "VerticalSlashPattern",
           "estimate_vertical_slash", "fit_coefficients", "pack_pattern", "packed_sizes", "unpack_patterns"]

_LAZY = {"SparseCost": "cost", "fit_coefficients": "cost", "Selection": "pattern", "VerticalSlashPattern": "pattern",
         "estimate_vertical_slash": "pattern", "pack_pattern": "pattern", "packed_sizes": "pattern",
         "unpack_patterns": "pattern"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"attnpool.sparse.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'attnpool.sparse' has no attribute {name!r}")
