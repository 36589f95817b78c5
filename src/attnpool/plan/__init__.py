"""Planning: documents, layouts, CA-tasks, cost models and schedulers. Pure NumPy."""

from attnpool.plan.api import (KV_EXCHANGING, SHARD_SERVING, STRATEGIES, head_chunks_problem, head_group_heads,
                               plan_attention)
from attnpool.plan.cost import PairsCost, TableCost, default_cost_model, default_min_shard_tokens, load_cost_model
from attnpool.plan.documents import DocPiece, PieceTable, causal_pairs
from attnpool.plan.layout import (LAYOUTS, balanced_table, layout_table, linear_layout, linear_table, pad_ranks, wlb_layout,
                                  wlb_table)
from attnpool.plan.plan import AttentionShape, KVTransfers, Plan

__all__ = [
    "KV_EXCHANGING", "SHARD_SERVING", "STRATEGIES", "head_chunks_problem", "head_group_heads", "plan_attention", "PairsCost", "TableCost", "default_cost_model", "default_min_shard_tokens",
    "load_cost_model", "DocPiece", "PieceTable", "causal_pairs", "LAYOUTS", "balanced_table", "layout_table", "linear_layout", "linear_table", "pad_ranks", "wlb_layout", "wlb_table",
    "AttentionShape", "KVTransfers", "Plan",
]
