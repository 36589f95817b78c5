"""How well cad balances sparse work when the planning prior keeps one pattern size for every document length
against one size per length class (attnpool.sparse.cost.SparsePrior), on the CPU (issue 45).

Batches of synthetic prolong at TOKENS per rank over RANKS ranks; each step's vertical-slash patterns estimated from
random queries and keys (an untrained model's: attention spreads, so the caps set the sizes), HEADS heads of 128
dimensions; cad planned by each prior (with --cost-model pairs, the default: the `pairs` dense model and the sparse
kernels' pair coefficients; with `table`, seconds: the shipped H200 table of the flash kernel and the sparse kernels'
H200 calibration, as training plans), its busiest server measured by the step's real patterns
(SparseCost.from_pattern) in the planning unit and in (query, key) pairs, what training's `sparse_imbalance_measured`
and `sparse_imbalance_measured_pairs` report, and each prior updated with the step's statistics as training updates it.

    PYTHONPATH=src python3 bench/sparse_prior_by_length.py --slash-cap 192 --vertical-cap 1024 --steps 10 --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np

from attnpool.data import DocumentStream
from attnpool.plan import linear_table, load_cost_model, plan_attention
from attnpool.plan.metrics import imbalance
from attnpool.runtime.sparse import SparseStats
from attnpool.sparse import SparseConfig
from attnpool.sparse.cost import LayerMixCost, SparseCost, SparsePrior
from attnpool.sparse.pattern import estimate_untrained
from attnpool.train.config import TrainConfig
from attnpool.train.data_source import build_source
from attnpool.train.spec import model_spec

PRIORS = ("one size", "by length")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slash-cap", type=int, default=192)
    ap.add_argument("--vertical-cap", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256 * 1024, help="tokens per rank")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--cost-model", choices=("pairs", "table"), default="pairs",
                    help="the planning unit: pairs, or seconds by the shipped H200 table (flash kernel)")
    ap.add_argument("--out", help="write <date>-cpu-sparse-prior-by-length-<caps>[-table][-<ranks>ranks].json here")
    args = ap.parse_args()
    sparse = SparseConfig(slash_cap=args.slash_cap, vertical_cap=args.vertical_cap)
    config = TrainConfig(model="llama3-8b", data="synthetic", data_args={"dist": "prolong"},
                         tokens_per_rank=args.tokens, nproc=args.ranks)
    stream = DocumentStream(build_source(config, model_spec("llama3-8b")), args.ranks, args.tokens,
                            config.data.seed, config.data.max_doc_len)
    pairs = load_cost_model("pairs")
    planning = pairs if args.cost_model == "pairs" else load_cost_model("table", backend="flash")
    priors = {name: SparsePrior(sparse, args.heads, 128, 1) for name in PRIORS}
    rows = []
    for step in range(1, args.steps + 1):
        lens = stream.next_batch().doc_lens
        table = linear_table(lens, args.ranks, args.tokens)
        pattern = estimate_untrained(lens, args.heads, 128, sparse, seed=step)
        # the step's real patterns, priced in the planning unit and in pairs
        exact = {unit: LayerMixCost(dense, SparseCost.from_pattern(pattern, coefficients, chunk=sparse.vertical_chunk),
                                    0, 1, lens >= sparse.min_doc_len)
                 for unit, (dense, coefficients) in (("measured", priors[PRIORS[0]]._pricing(planning)),
                                                     ("measured pairs", priors[PRIORS[0]]._pricing(pairs)))}
        sums, by_length = SparseStats.of_pattern(pattern)
        row = {"step": step, "docs": int(len(lens)), "longest": int(lens.max()), "density": sums[3] / sums[4]}
        for name, prior in priors.items():
            predicted = prior.cost_model(table.doc_len, planning)
            plan = plan_attention(table, "cad", cost_model=predicted)
            loads = lambda model: np.bincount(plan.task_server, minlength=args.ranks,
                                              weights=model.cost(plan.task_start, plan.task_end, plan.task_doc))
            row[f"{name} planned"] = imbalance(loads(predicted))
            for unit, model in exact.items():
                row[f"{name} {unit}"] = imbalance(loads(model))
            prior.update(*sums[:3], by_length=by_length if name == "by length" else None)
        rows.append(row)
        print(f"step {step:3d}: {row['docs']:3d} docs (longest {row['longest']:6d}), density {row['density']:.3f}  "
              + "  ".join(f"{n}: planned {row[n + ' planned']:.3f} measured {row[n + ' measured']:.3f} "
                          f"(pairs {row[n + ' measured pairs']:.3f})" for n in PRIORS), flush=True)
    later = rows[2:] or rows  # the first two steps: both priors still learning
    mean = {f"{n} {kind}": float(np.mean([r[f'{n} {kind}'] for r in later])) for n in PRIORS
            for kind in ("planned", "measured", "measured pairs")}
    print("mean from step 3: " + ", ".join(f"{k} {v:.3f}" for k, v in mean.items()))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        command = (f"PYTHONPATH=src python3 bench/sparse_prior_by_length.py --slash-cap {args.slash_cap} "
                   f"--vertical-cap {args.vertical_cap} --steps {args.steps} --ranks {args.ranks} --tokens {args.tokens} "
                   f"--heads {args.heads} --cost-model {args.cost_model}")
        stem = os.path.join(args.out, f"{datetime.date.today()}-cpu-sparse-prior-by-length-{args.slash_cap}-"
                                      f"{args.vertical_cap}" + ("-table" if args.cost_model == "table" else "")
                            + (f"-{args.ranks}ranks" if args.ranks != 4 else ""))
        with open(stem + ".json", "w") as fh:
            json.dump({"command": command, "mean_from_step_3": mean, "rows": rows}, fh, indent=1)
        print(f"wrote {stem}.json")


if __name__ == "__main__":
    main()
