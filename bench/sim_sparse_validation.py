#!/usr/bin/env python3
"""The simulator against the measured full-depth sparse runs: predicted step times of dense cad + ping-pong and
sparse cad for the exact batches of `2026-11-28-h200x4-full-depth-sparse` (issue 45).

The batches are regenerated as `attnpool bench` drew them (bench/sim_validation.bench_batches). The step model is
attnpool.sim.steptime's (the shipped H200 profile, the run's kernel's attention table, `full` recompute: core
attention's forward runs again in backward; activation offload is not modelled). Sparse tasks are priced by the
sparse kernels' packaged H200 calibration on the patterns of an untrained model, estimated here from random queries
and keys with the run's caps (an untrained model's attention spreads, so the caps set the sizes; their density is
printed beside the measured one), and planned as the run planned them: by the planning prior of one pattern size
for every length, updated after each step (the prior of that run). `--prior by-length` plans with the prior that
keeps sizes per length class instead: what the same run would take now.

    PYTHONPATH=src python3 bench/sim_sparse_validation.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

from attnpool.model.config import model_config
from attnpool.plan import linear_table, plan_attention
from attnpool.runtime.sparse import SparseStats
from attnpool.sim.costs import load_sim_costs
from attnpool.sim.simulate import SimConfig, simulate_config
from attnpool.sim.steptime import Cluster, StepModel
from attnpool.sparse import SparseConfig
from attnpool.sparse.pattern import estimate_untrained
from attnpool.sparse.cost import SparseCost, SparsePrior
from sim_validation import bench_batches

MEASURED = "bench/results/2026-11-28-h200x4-full-depth-sparse.json"
ESTIMATING_HEADS = 2  # heads of random queries and keys per document: the sizes are per head, the heads alike


def sparse_steps(model: StepModel, costs, batches: list[list[int]], sparse: SparseConfig, by_length: bool, seed: int):
    """Per measured batch: (predicted step seconds, density of the estimated patterns), after the warm-up batch."""
    cfg = model.cfg
    prior = SparsePrior(sparse, cfg.n_heads, cfg.head_dim, cfg.n_layers)
    out = []
    for i, lens in enumerate(batches):
        lens = np.asarray(lens)
        tokens = model.cluster.tokens_per_gpu
        table = linear_table(lens, model.cluster.gpus, tokens)
        fwd_bwd = prior.cost_model(table.doc_len, costs.attn_fwd_bwd)
        plan = plan_attention(table, "cad", cost_model=fwd_bwd, min_shard_tokens=costs.min_shard_tokens,
                              shape=model.shape)
        pattern = estimate_untrained(lens, ESTIMATING_HEADS, cfg.head_dim, sparse, seed=seed + i)
        _, coefficients = prior._pricing(costs.attn_fwd_bwd)
        # the patterns' tiles for every head of the model (the estimated heads stand for them all), in seconds
        exact = SparseCost.from_pattern(pattern, coefficients, chunk=sparse.vertical_chunk)
        scale = cfg.n_heads / ESTIMATING_HEADS
        sparse_doc = (lens >= sparse.min_doc_len)[plan.task_doc]
        dense_f, dense_b = model.task_attention(plan.task_start, plan.task_end)
        f = np.where(sparse_doc, scale * exact.with_phase("fwd").cost(plan.task_start, plan.task_end, plan.task_doc),
                     dense_f)
        fb = np.where(sparse_doc, scale * exact.cost(plan.task_start, plan.task_end, plan.task_doc), 0.0)
        b = np.where(sparse_doc, np.maximum(fb - f, 0), dense_b - (f if model.attention_again else 0))
        step = model.plan_step(plan, overlap=False, name="cad+sparse", task_seconds=(f, b))
        sums, classes = SparseStats.of_pattern(pattern)
        prior.update(*sums[:3], by_length=classes if by_length else None)
        out.append((step.step, float(sums[3] / sums[4])))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", default=MEASURED)
    ap.add_argument("--out", default=None)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    data = json.load(open(args.measured))
    meta, records = data["meta"], data["records"]
    world, layers = 4, int(meta["model"].split(" x ")[1].split()[0])
    warmup, steps = meta["warmup"], meta["measured_steps"]
    backend = meta["attention_backend"]
    cfg = model_config("llama3-8b", n_layers=layers)
    costs = load_sim_costs(cfg, "llama3-8b", attention_backend=backend)
    rows = []
    for rec in records:
        tokens = rec["tokens_per_gpu"]
        batches = bench_batches(rec["dist"], tokens, world, 0, warmup + steps)
        model = StepModel(cfg, Cluster(world, tp=1, gpus_per_node=world, tokens_per_gpu=tokens), costs, recompute="full",
                          fsdp=True)
        if "sparse" in rec["strategy"]:
            caps = dict(kv.split("=") for kv in rec["sparse_args"].split(","))
            sparse = SparseConfig(**{k: int(v) for k, v in caps.items()})
            run = {name: sparse_steps(model, costs, batches, sparse, name == "by length", args.seed)[warmup:]
                   for name in ("one size", "by length")}
            predicted = [s for s, _ in run["one size"]]
            density = float(np.mean([d for _, d in run["one size"]]))
            by_length = [s for s, _ in run["by length"]]
        else:
            config = SimConfig(model="llama3-8b", layers=layers, gpus=world, tp=1, gpus_per_node=world,
                               tokens_per_gpu=tokens, dist=rec["dist"], strategies=("cad",), batches=len(batches),
                               recompute="full")
            sim = simulate_config(config, costs, doc_batches=batches)["strategies"]
            predicted = sim["cad" if "pingpong" in rec["strategy"] else "cad-serial"]["per_batch_step_s"][warmup:]
            density, by_length = 1.0, None
        measured = rec["step_times_s"]
        row = {"strategy": rec["strategy"], "sparse_args": rec.get("sparse_args"), "measured_s": measured,
               "predicted_s": predicted, "measured_density": rec.get("attention_density"),
               "estimated_density": density, "predicted_by_length_s": by_length,
               "error_total": sum(predicted) / sum(measured) - 1}
        rows.append(row)
        print(f"{rec['strategy']:14s} {rec.get('sparse_args') or '':32s} measured {sum(measured):7.2f} s predicted "
              f"{sum(predicted):7.2f} s ({row['error_total']:+.1%}); per step "
              + ", ".join(f"{p:.1f}/{m:.1f}" for p, m in zip(predicted, measured))
              + (f"; density {rec.get('attention_density'):.3f} measured, {density:.3f} estimated here" if by_length
                 else "") + (f"; by-length prior {sum(by_length):.2f} s" if by_length else ""), flush=True)
    if args.out:
        stem = os.path.join(args.out, f"{datetime.date.today()}-sim-sparse-validation")
        json.dump({"command": "PYTHONPATH=src python3 bench/sim_sparse_validation.py " + " ".join(sys.argv[1:]),
                   "measured": args.measured, "rows": rows}, open(stem + ".json", "w"), indent=1)
        print(f"wrote {stem}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
