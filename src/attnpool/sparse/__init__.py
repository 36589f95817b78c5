"""Dynamic vertical-slash sparse attention: configuration, online pattern estimation,
the attended set, pattern exchange between servers, and a sparse-aware cost model.

    cfg = SparseConfig(coverage=0.9)
    pattern = estimate_vertical_slash(q, k, cu_q, cu_k, cfg)      # per document and query head
    out, lse = kernels.sparse.forward(q, k, v, cu_q, cu_k, max_q, max_k, pattern=pattern)
    model = SparseCost.from_pattern(pattern)                      # cost(a, b, doc) in seconds
"""

from attnpool.sparse.config import SparseConfig
from attnpool.sparse.cost import H200_MEASURED, SparseCoefficients, SparseCost, fit_coefficients
from attnpool.sparse.pattern import (Selection, VerticalSlashPattern, estimate_vertical_slash, pack_pattern,
                                     packed_sizes, unpack_patterns)

__all__ = ["H200_MEASURED", "Selection", "SparseCoefficients", "SparseConfig", "SparseCost", "VerticalSlashPattern",
           "estimate_vertical_slash", "fit_coefficients", "pack_pattern", "packed_sizes", "unpack_patterns"]
