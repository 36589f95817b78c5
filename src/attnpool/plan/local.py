"""``local``: every piece is one CA-task served by its home rank.

This is what plain packed data parallelism computes; a document split across
ranks still fetches its remote KV prefix.
"""

from __future__ import annotations

import numpy as np

from attnpool.plan.documents import PieceTable


def home_tasks(table: PieceTable):
    """(doc, start, end, piece, server) arrays of one task per piece, at home."""
    return table.doc, table.start, table.end, np.arange(table.num_pieces), table.rank


def schedule_local(table: PieceTable, **_):
    return home_tasks(table)
