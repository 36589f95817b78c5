"""attnpool: core attention disaggregation for long-context training on packed documents.

    from attnpool import DocPiece, plan_attention, core_attention
    plan = plan_attention(pieces_per_rank, strategy="cad")     # identical on every rank
    out = core_attention(q, k, v, plan, group)                 # this rank's tokens
"""

from attnpool.errors import ConfigError

__all__ = ["ConfigError", "DocPiece", "Plan", "plan_attention", "core_attention"]
__version__ = "0.1.0"

# Imported on first use (PEP 562), so that the command line starts without loading torch.
_LAZY = {"DocPiece": "attnpool.plan", "Plan": "attnpool.plan", "plan_attention": "attnpool.plan",
         "core_attention": "attnpool.runtime"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'attnpool' has no attribute {name!r}")
