#!/usr/bin/env python3
"""Where does balancing sparse attention pay? Predicted step times of sparse ``cad`` against sparse ``local``.

The simulator's step model (attnpool.sim.steptime: linear layers at the shipped H200 profile, all-to-alls,
ping-pong overlap for ``cad``) with the attention of every CA-task priced by the sparse planning cost
(attnpool.sparse.cost.SparsePrior: a uniform vertical-slash pattern of a given size in every document of at
least ``min_doc_len`` tokens, dense below; tiles priced by the packaged H200 calibration of our sparse
kernels). Llama-3-8B dimensions, one GPU per attention server (tp 1), batches drawn with the paper's recipe.
Two pattern sizes:

- ``caps``: the caps' prior (32 block diagonals, 2016 columns + 64 sinks per head), what a randomly
  initialised model estimates; the measured 4 x H200 run (prolong 256K per GPU) had attention density 0.31;
- ``trained``: 8 block diagonals and 512 columns per head, about MTraining's 94% sparsity at 128K-512K.

Predictions, not measurements. Writes ``<date>-sim-sparse.{md,json}`` to ``--out``.

    PYTHONPATH=src python3 bench/sim_sparse.py --out bench/results        (a few minutes on one core)
"""

from __future__ import annotations

import argparse
import datetime
import time

import numpy as np

from attnpool.bench.record import write_record
from attnpool.data.lengths import SamplingOptions, sample_batches
from attnpool.model.config import model_config
from attnpool.plan import linear_table, plan_attention
from attnpool.sim.costs import load_sim_costs
from attnpool.sim.steptime import Cluster, StepModel
from attnpool.sparse import SparseConfig
from attnpool.sparse.cost import SparsePrior

PATTERNS = {"caps": None, "trained": (8.0, 512.0)}  # (block diagonals, columns) beyond the forced ones


def sparse_costs(prior: SparsePrior, costs, doc_len):
    """Per-layer (fwd, fwd+bwd) cost models, in seconds, of a batch's documents."""
    fwd_bwd = prior.cost_model(doc_len, costs.attn_fwd_bwd)
    fwd = prior.cost_model(doc_len, costs.attn_fwd)
    fwd.sparse = fwd.sparse.with_phase("fwd")
    return fwd, fwd_bwd


def step_times(model: StepModel, prior: SparsePrior, costs, lens, gpus: int, tokens: int) -> dict:
    table = linear_table(lens, gpus, tokens)
    fwd, fwd_bwd = sparse_costs(prior, costs, table.doc_len)
    out = {}
    for strategy in ("local", "cad"):
        plan = plan_attention(table, strategy, cost_model=fwd_bwd, min_shard_tokens=costs.min_shard_tokens,
                              shape=model.shape)
        f = fwd.cost(plan.task_start, plan.task_end, plan.task_doc)
        fb = fwd_bwd.cost(plan.task_start, plan.task_end, plan.task_doc)
        st = model.plan_step(plan, overlap=strategy == "cad", name=strategy, task_seconds=(f, np.maximum(fb - f, 0)))
        out[strategy] = st
    causal = table.doc_len.astype(np.float64) * (table.doc_len + 1) / 2
    dense = prior.sparse_layers == 0
    out["density"] = 1.0 if dense else float(
        (fwd_bwd.sparse.density(np.arange(len(table.doc_len))) * causal).sum() / causal.sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", default="4,8,16,32,64")
    ap.add_argument("--tokens", default="64K,128K,256K,512K")
    ap.add_argument("--dists", default="prolong,pretrain")
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from attnpool.sizes import parse_size

    gpus_list = [int(g) for g in args.gpus.split(",")]
    tokens_list = [parse_size(t) for t in args.tokens.split(",")]
    cfg = model_config("llama3-8b", max_position=max(tokens_list) * 2)
    costs = load_sim_costs(cfg, "llama3-8b")
    rows = []
    t0 = time.perf_counter()
    for dist in args.dists.split(","):
        for tokens in tokens_list:
            # The paper's recipe: pretrain lengths stretched to the context, documents cut at a GPU's tokens.
            options = SamplingOptions(elongate=tokens / 65536 if dist == "pretrain" else 1.0, max_doc_len=tokens)
            for gpus in gpus_list:
                batches = sample_batches(dist, gpus * tokens, args.batches, args.seed, options)
                model = StepModel(cfg, Cluster(gpus, tp=1, gpus_per_node=8, tokens_per_gpu=tokens), costs, fsdp=True)
                for pattern, size in PATTERNS.items():
                    prior = SparsePrior(SparseConfig(), cfg.n_heads, cfg.head_dim, cfg.n_layers)
                    if size is not None:
                        prior.diagonals, prior.verticals = size
                    per = [step_times(model, prior, costs, lens, gpus, tokens) for lens in batches]
                    local = sum(p["local"].step for p in per)
                    cad = sum(p["cad"].step for p in per)
                    row = {"dist": dist, "tokens_per_gpu": tokens, "gpus": gpus, "pattern": pattern,
                           "density": float(np.mean([p["density"] for p in per])),
                           "speedup_cad_over_local": local / cad,
                           "local_attention_max_over_mean": float(np.mean([p["local"].attention_max_over_mean for p in per])),
                           "cad_attention_max_over_mean": float(np.mean([p["cad"].attention_max_over_mean for p in per])),
                           "attention_share_local": float(np.mean([p["local"].attention / p["local"].step for p in per])),
                           "comm_exposed_share_cad": float(np.mean([p["cad"].comm_exposed / p["cad"].step for p in per]))}
                    rows.append(row)
                    print(f"{dist} {tokens // 1024}K x {gpus:3d} {pattern:8s} density {row['density']:.3f}  "
                          f"local max/mean {row['local_attention_max_over_mean']:.2f}  attention {row['attention_share_local']:.0%} "
                          f"of the step  cad {row['speedup_cad_over_local']:.3f}x", flush=True)
    doc = {"date": str(datetime.date.today()), "command": f"python bench/sim_sparse.py --out {args.out}",
           "model": "llama3-8b (32 layers), tp 1", "costs": costs.sources, "batches": args.batches,
           "patterns": {"caps": "SparsePrior's start: slash_cap / block diagonals, (vertical_cap - sinks) / 2 columns",
                        "trained": "8 block diagonals, 512 columns"}, "rows": rows, "wall_s": time.perf_counter() - t0}
    lines = ["# Where balancing sparse attention pays: sparse `cad` over sparse `local` (simulated)", "",
             f"{doc['date']}. Command: `{doc['command']}`. Predictions of the step model with sparse task costs, "
             f"not measurements: {doc['model']}, {args.batches} batches per point; "
             f"attention: {costs.sources.get('attention', '')}; linear: {costs.sources.get('linear', '')}.", "",
             "| dist | tokens/GPU | GPUs | pattern | density | local attention max/mean | attention share of the "
             "step (local) | cad over local |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dist']} | {r['tokens_per_gpu'] // 1024}K | {r['gpus']} | {r['pattern']} | {r['density']:.3f} | "
                     f"{r['local_attention_max_over_mean']:.2f} | {r['attention_share_local']:.0%} | "
                     f"{r['speedup_cad_over_local']:.3f}x |")
    stem = write_record(args.out, "sim-sparse", doc, lines)
    print(f"wrote {stem}.md ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
