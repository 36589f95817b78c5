"""attnpool: core attention disaggregation for long-context training on packed documents.

    from attnpool import DocPiece, plan_attention, core_attention
    plan = plan_attention(pieces_per_rank, strategy="cad")     # identical on every rank
    out = core_attention(q, k, v, plan, group)                 # this rank's tokens
"""

from attnpool.errors import ConfigError
from attnpool.plan import DocPiece, Plan, plan_attention
from attnpool.runtime import core_attention

__all__ = ["ConfigError", "DocPiece", "Plan", "plan_attention", "core_attention"]
__version__ = "0.1.0"
