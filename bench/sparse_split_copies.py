"""A sparse server's split call (long documents' segments to the sparse kernel, short ones' to the dense kernel): its
rows copied run by run (runtime.dispatch.Rows, today's) against through an index (MAX_ROW_RUNS = 0, as before
2026-12-01), on the same plans and patterns, alternating in one run, on one device (issue 45).

Batches of synthetic prolong at 256K tokens per rank over 4 ranks; patterns estimated from random queries and keys
(32 query heads, 8 key and value heads of 128); cad planned as training plans (bench/sparse_prior_by_length.py, whose
``served_by_rank`` runs every rank's kernel call and times its parts). Per step and variant, each rank's kernel
seconds and its split copies' seconds (the call's seconds outside its two kernels), forward and backward. The index
variant is today's call with the copies through the index, not the code before: that also filled the outputs first.

    PYTHONPATH=src python3 bench/sparse_split_copies.py --steps 8 --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np
import torch

import attnpool.runtime.dispatch as dispatch
from attnpool.kernels.registry import get_backend
from attnpool.plan import linear_table, load_cost_model, plan_attention
from attnpool.runtime.sparse import SparseStats
from attnpool.sparse import SparseConfig
from attnpool.sparse.cost import SparsePrior
from attnpool.sparse.pattern import estimate_untrained
from sparse_prior_by_length import prolong_stream, served_by_rank

RANKS, TOKENS, HEADS, KV_HEADS = 4, 256 * 1024, 32, 8
# each twice, alternating, so that a drift of the clocks shows as a difference between the repeats
VARIANTS = (("index", 0), ("runs", dispatch.MAX_ROW_RUNS), ("index again", 0), ("runs again", dispatch.MAX_ROW_RUNS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slash-cap", type=int, default=192)
    ap.add_argument("--vertical-cap", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", help="write <date>-<machine>-sparse-split-copies-<caps>.json here")
    args = ap.parse_args()
    sparse = SparseConfig(slash_cap=args.slash_cap, vertical_cap=args.vertical_cap)
    stream = prolong_stream(RANKS, TOKENS)
    planning = load_cost_model("table", backend="flash")
    prior = SparsePrior(sparse, HEADS, 128, 1)
    price = prior.served_price(planning)
    dense = get_backend("auto", args.device, torch.bfloat16)
    rows = []
    for step in range(1, args.steps + 1):
        lens = stream.next_batch().doc_lens
        table = linear_table(lens, RANKS, TOKENS)
        pattern = estimate_untrained(lens, HEADS, 128, sparse, seed=step, num_kv_heads=KV_HEADS, device=args.device,
                                     dtype=torch.bfloat16)
        row = {"step": step}
        try:
            for variant, runs in VARIANTS:
                dispatch.MAX_ROW_RUNS = runs  # read when a plan's routes are built: a fresh plan per variant
                plan = plan_attention(table, "cad", cost_model=prior.cost_model(table.doc_len, planning))
                served = served_by_rank(plan, pattern, sparse, price, dense, 128, KV_HEADS, 3, args.device,
                                        first=step % RANKS)
                row[variant] = {k: v.tolist() for k, v in served.items()}
        finally:
            dispatch.MAX_ROW_RUNS = VARIANTS[1][1]
        sums, by_length = SparseStats.of_pattern(pattern.to("cpu"))
        prior.update(*sums[:3], by_length=by_length)
        rows.append(row)
        print(f"step {step}: per rank, split copies / kernel ms: " + ", ".join(
            f"{v} {1e3 * np.mean(row[v]['split copies s']):.2f} / {1e3 * np.mean(row[v]['kernel s']):.1f}"
            for v, _ in VARIANTS), flush=True)
    if args.out:
        machine = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
        command = (f"PYTHONPATH=src python3 bench/sparse_split_copies.py --slash-cap {args.slash_cap} "
                   f"--vertical-cap {args.vertical_cap} --steps {args.steps} --device {args.device}")
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"{datetime.date.today()}-{machine.split()[-1].lower()}-sparse-split-copies-"
                                      f"{args.slash_cap}-{args.vertical_cap}.json")
        with open(path, "w") as fh:
            json.dump({"command": command, "machine": machine, "torch": torch.__version__, "rows": rows}, fh, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
