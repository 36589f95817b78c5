"""What fitting the sparse tiles' price to the kernels' seconds does to cad's plans, on the CPU, against an assumed
kernel (issue 45): a simulation, not a measurement.

Batches of synthetic prolong at 256K tokens per rank over 4 ranks, patterns estimated from random queries and keys
(2 heads of 128), cad planned as training plans (the shipped H200 flash table, the sparse calibration, the prior by
length), once with the calibration's tile prices (price_from_kernels off) and once with the fitted scale
(sparse.cost.SparsePrior.update_kernel_scale, as training fits it). Each rank's served work is priced by the step's
real patterns, its tiles' part s and its short documents' part d, and its kernel seconds are taken to be
``A * s + B * d + C`` (C on every rank that serves tiles): the assumed kernel, whose A and B one H200's runs suggest
(bench/results/2026-12-01-h200-sparse-served-balance.md: the sparse kernel at 1.07x its calibrated price at caps
192 / 1024 and 1.81x at 128 / 512, the dense at 0.98-1.03x). Reported per step: that kernel's max/mean over the ranks
under each plan, and the fitted scale.

    PYTHONPATH=src python3 bench/sparse_price_scale_sim.py --slash-cap 128 --vertical-cap 512 --a 1.75 --b 0.98 --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np

from attnpool.plan import linear_table, load_cost_model, plan_attention
from attnpool.plan.metrics import imbalance
from attnpool.runtime.sparse import SparseStats
from attnpool.sparse import SparseConfig
from attnpool.sparse.cost import LayerMixCost, SparseCost, SparsePrior
from attnpool.sparse.pattern import estimate_untrained
from sparse_prior_by_length import prolong_stream

RANKS, TOKENS, HEADS = 4, 256 * 1024, 2
PLANS = ("calibration", "fitted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slash-cap", type=int, default=128)
    ap.add_argument("--vertical-cap", type=int, default=512)
    ap.add_argument("--a", type=float, default=1.75, help="the assumed kernel's seconds per priced second of tiles")
    ap.add_argument("--b", type=float, default=0.98, help="... per priced second of short documents")
    ap.add_argument("--c", type=float, default=0.010 * HEADS / 32,
                    help="... seconds every rank with tiles pays (default: 10 ms at 32 heads, for these 2)")
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--out", help="write <date>-cpu-sparse-price-scale-sim-<caps>.json here")
    args = ap.parse_args()
    caps = dict(slash_cap=args.slash_cap, vertical_cap=args.vertical_cap)
    sparse = SparseConfig(**caps)
    stream = prolong_stream(RANKS, TOKENS)
    table = load_cost_model("table", backend="flash")
    priors = {"calibration": SparsePrior(SparseConfig(**caps, price_from_kernels=False), HEADS, 128, 1),
              "fitted": SparsePrior(SparseConfig(**caps, price_from_kernels=True), HEADS, 128, 1)}
    rows = []
    for step in range(1, args.steps + 1):
        lens = stream.next_batch().doc_lens
        pieces = linear_table(lens, RANKS, TOKENS)
        pattern = estimate_untrained(lens, HEADS, 128, sparse, seed=step)
        sums, by_length = SparseStats.of_pattern(pattern)
        dense, coefficients = priors["calibration"]._pricing(table)
        long = lens >= sparse.min_doc_len
        exact = LayerMixCost(dense, SparseCost.from_pattern(pattern, coefficients, chunk=sparse.vertical_chunk), 0, 1,
                             long)
        row = {"step": step, "longest": int(lens.max())}
        for name, prior in priors.items():
            plan = plan_attention(pieces, "cad", cost_model=prior.cost_model(pieces.doc_len, table))
            cost = exact.cost(plan.task_start, plan.task_end, plan.task_doc)
            tiles = np.bincount(plan.task_server, weights=cost * long[plan.task_doc], minlength=RANKS)
            short = np.bincount(plan.task_server, weights=cost * ~long[plan.task_doc], minlength=RANKS)
            kernel = args.a * tiles + args.b * short + args.c * (tiles > 0)
            row[name] = {"kernel max/mean": imbalance(kernel), "scale": prior.kernel_scale}
            prior.update(*sums[:3], by_length=by_length)
            if prior.learns_kernel_scale(table):
                prior.update_kernel_scale(kernel, tiles, short)
        rows.append(row)
        print(f"step {step:3d}: " + ", ".join(f"{n} {row[n]['kernel max/mean']:.4f} (scale {row[n]['scale']:.3f})"
                                             for n in PLANS), flush=True)
    mean = {n: float(np.mean([r[n]["kernel max/mean"] for r in rows[2:]])) for n in PLANS}
    print("mean from step 3: " + ", ".join(f"{n} {v:.4f}" for n, v in mean.items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        command = (f"PYTHONPATH=src python3 bench/sparse_price_scale_sim.py --slash-cap {args.slash_cap} "
                   f"--vertical-cap {args.vertical_cap} --a {args.a} --b {args.b} --c {args.c} --steps {args.steps}")
        path = os.path.join(args.out, f"{datetime.date.today()}-cpu-sparse-price-scale-sim-{args.slash_cap}-"
                                      f"{args.vertical_cap}.json")
        with open(path, "w") as fh:
            json.dump({"command": command, "mean_from_step_3": mean, "rows": rows}, fh, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
