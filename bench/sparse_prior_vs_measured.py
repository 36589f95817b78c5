#!/usr/bin/env python3
"""Sparse balance by the planning prior against the patterns a trained model actually has (issue 26).

``cad`` plans a step before its patterns exist, with the uniform prior of attnpool.sparse.cost.SparsePrior.
This script takes a sparse run's checkpoint, replays its batches on one process, estimates every layer's real
vertical-slash patterns (the run's options), prices each CA-task by their exact tile counts (SparseCost.from_pattern,
in the prior's unit; documents below the sparse length dense), and reports for the ``local`` and the ``cad`` plan
the attention max/mean by the prior (what the run logs) and by the real patterns, summed over the sparse layers.

    PYTHONPATH=src python3 bench/sparse_prior_vs_measured.py --run runs/sparse-demo --steps 20 --out DIR
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch

from attnpool.bench.record import write_record
from attnpool.data import DocumentStream
from attnpool.plan import linear_table, load_cost_model, plan_attention
from attnpool.plan.metrics import imbalance
from attnpool.runtime import CoreAttention
from attnpool.sparse import estimate_vertical_slash
from attnpool.sparse.cost import LayerMixCost, SparseCost, SparsePrior
from attnpool.train.config import KEYS, TrainConfig
from attnpool.train.export import read_checkpoint_model
from attnpool.train.data_source import build_source


class Recorder:
    """Dense core attention of one process that keeps each layer's q and k (for estimating patterns)."""

    def __init__(self, plan):
        self.inner = CoreAttention(plan, None)
        self.qk = {}

    def __call__(self, q, k, v, *, layer=None):
        self.qk[layer] = (q.detach(), k.detach())
        return self.inner(q, k, v, layer=layer)


def loads(model_cost, doc, a, b, server, W):
    return np.bincount(server, weights=model_cost.cost(a, b, doc), minlength=W)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="a run directory trained with --sparse vertical-slash")
    ap.add_argument("--steps", type=int, default=20, help="batches replayed from the run's first step")
    ap.add_argument("--out", help="write <date>-cpu-sparse-prior-vs-measured.{json,md} here")
    args = ap.parse_args()
    model, spec, settings, path, _ = read_checkpoint_model(run_dir=args.run)
    config = TrainConfig(**{k: v for k, v in settings.items() if k in KEYS})
    model_cfg = spec.config
    sparse = config.sparse.sparse_config()
    if sparse is None:
        raise SystemExit(f"{args.run} trained dense: give a run of --sparse vertical-slash")
    W, tp = config.run.nproc, config.parallel.tp
    dense_cost = load_cost_model(config.attention.cost_model)
    prior = SparsePrior(sparse, model_cfg.n_heads, model_cfg.head_dim, model_cfg.n_layers)
    stream = DocumentStream(build_source(config, spec), W // tp, config.data.tokens_per_rank, config.data.seed,
                            config.data.max_doc_len)
    model.eval()
    rows = []
    for step in range(1, args.steps + 1):
        batch = stream.next_batch()
        table = linear_table(batch.doc_lens, W // tp, batch.tokens_per_rank)
        predicted = prior.cost_model(table.doc_len, dense_cost)
        plans = {s: plan_attention(table, s, cost_model=predicted, min_shard_tokens=config.attention.min_shard,
                                   eps=config.attention.eps)
                 for s in ("local", "cad")}
        one = plan_attention(linear_table(batch.doc_lens, 1), "local", cost_model="pairs")
        recorder = Recorder(one)
        with torch.no_grad():
            model(torch.from_numpy(batch.tokens), torch.from_numpy(batch.positions), recorder, return_hidden=True)
        lens = batch.doc_lens
        offsets = batch.doc_offsets
        m = np.minimum(lens, sparse.last_queries)
        q_rows = np.concatenate([np.arange(o + n - k, o + n) for o, n, k in zip(offsets[:-1], lens, m)])
        cu_q = torch.tensor(np.r_[0, np.cumsum(m)], dtype=torch.int32)
        cu_k = torch.tensor(offsets, dtype=torch.int32)
        _, coefficients = prior._pricing(dense_cost)
        sparse_docs = lens >= sparse.min_doc_len
        measured = {s: np.zeros(W // tp) for s in plans}
        layers = [i for i in sorted(recorder.qk) if i >= prior.dense_layers]
        for layer in layers:
            q, k = recorder.qk[layer]
            pattern = estimate_vertical_slash(q[torch.from_numpy(q_rows)], k, cu_q, cu_k, sparse, k_lens_host=lens)
            exact = LayerMixCost(dense_cost, SparseCost.from_pattern(pattern, coefficients, chunk=sparse.vertical_chunk),
                                 0, 1, sparse_docs)
            for s, plan in plans.items():
                measured[s] += loads(exact, plan.task_doc, plan.task_start, plan.task_end, plan.task_server, W // tp)
        row = {"step": step, "num_docs": int(len(lens)), "longest_doc": int(lens.max())}
        for s, plan in plans.items():
            row[f"{s}_prior"] = imbalance(loads(predicted, plan.task_doc, plan.task_start, plan.task_end,
                                                plan.task_server, W // tp))
            row[f"{s}_measured"] = imbalance(measured[s])
            row[f"{s}_measured_max"] = float(measured[s].max())
        rows.append(row)
        print(f"step {step:3d}: {len(lens):3d} docs (longest {lens.max():5d})  prior local {row['local_prior']:.3f} "
              f"cad {row['cad_prior']:.3f} | measured local {row['local_measured']:.3f} cad {row['cad_measured']:.3f}",
              flush=True)
    mean = {k: float(np.mean([r[k] for r in rows])) for k in ("local_prior", "cad_prior", "local_measured", "cad_measured")}
    worse = sum(r["cad_measured_max"] > r["local_measured_max"] * (1 + 1e-9) for r in rows)
    print(f"mean max/mean: prior local {mean['local_prior']:.3f} cad {mean['cad_prior']:.3f}; measured local "
          f"{mean['local_measured']:.3f} cad {mean['cad_measured']:.3f}; cad's busiest server above local's in "
          f"{worse} of {len(rows)} steps by the real patterns")
    if args.out:
        doc = {"command": f"python bench/sparse_prior_vs_measured.py --run {args.run} --steps {args.steps}",
               "checkpoint": path, "sparse": {k: getattr(sparse, k) for k in ("coverage", "min_doc_len", "block",
                                                                               "slash_cap", "vertical_cap")},
               "mean": mean, "cad_above_local_measured_steps": worse, "rows": rows}
        lines = ["# Sparse balance: the planning prior against a trained model's patterns", "",
                 f"Command: `{doc['command']}` (checkpoint `{os.path.basename(path)}`; the batches of the run's first "
                 f"{args.steps} steps, every sparse layer's real patterns estimated as training does).", "",
                 "| step | docs | longest | local, prior | cad, prior | local, measured | cad, measured |",
                 "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['step']} | {r['num_docs']} | {r['longest_doc']} | {r['local_prior']:.3f} | {r['cad_prior']:.3f} | "
                  f"{r['local_measured']:.3f} | {r['cad_measured']:.3f} |" for r in rows]
        lines += ["", f"Means: prior local {mean['local_prior']:.3f}, cad {mean['cad_prior']:.3f}; measured local "
                      f"{mean['local_measured']:.3f}, cad {mean['cad_measured']:.3f}. By the real patterns cad's busiest "
                      f"server carries more than local's in {worse} of {len(rows)} steps."]
        write_record(args.out, "cpu-sparse-prior-vs-measured", doc, lines)


if __name__ == "__main__":
    main()
