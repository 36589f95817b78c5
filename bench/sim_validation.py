#!/usr/bin/env python3
"""Simulator vs measurement: predicted step times for the exact batches of the 4 x H200 benchmark.

Regenerates the benchmark's batches (same synthetic source, seed and stream as
`attnpool bench`), simulates them at 4 GPUs, TP = 1, one node, Llama-3-8B with 4
layers, and compares with the measured step times of a results file, per strategy
and per step: one run's `e2e.json`, or a merged file whose records name their run
(`run`, with warm-up and step counts under `runs`); where a configuration and
strategy were measured twice, the later record is used.

    python bench/sim_validation.py --out bench/results
    python bench/sim_validation.py --measured bench/results/2026-11-21-h200x4-e2e-short.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np

from attnpool.data import DocumentStream, make_source
from attnpool.sim.simulate import SimConfig, simulate_config

MEASURED = "bench/results/2026-11-22-h200x4-e2e.json"  # 3 + 10 steps
# simulator strategy -> benchmark strategy
PAIRS = {"local": "local", "wlb": "wlb", "cad-serial": "cad", "cad": "cad+pingpong"}
TARGET = 0.15


def bench_batches(dist: str, tokens: int, world: int, warmup: int, steps: int) -> list[list[int]]:
    """The document lengths of the benchmark's measured steps (same recipe as attnpool.bench.e2e)."""
    options = {"elongate": max(1.0, tokens * world / 65536)} if dist == "pretrain" else {}
    source = make_source("synthetic", dist=dist, vocab_size=128256, seed=0, options=options)
    stream = DocumentStream(source, world, tokens, 0)
    lens = [stream.next_batch().doc_lens.tolist() for _ in range(warmup + steps)]
    return lens[warmup:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--measured", default=MEASURED)
    args = parser.parse_args()
    data = json.load(open(args.measured))
    meta, records = data["meta"], data["records"]
    runs = {run["name"]: run for run in data.get("runs", [])}
    world = int(meta["machine"].split(" x ")[0])
    rows = []
    for dist, tokens in sorted({(r["dist"], r["tokens_per_gpu"]) for r in records}):
        measured = {r["strategy"]: r for r in records if (r["dist"], r["tokens_per_gpu"]) == (dist, tokens)}
        steps = {(runs.get(r.get("run"), meta)["warmup"], runs.get(r.get("run"), meta)["measured_steps"])
                 for r in measured.values()}
        if len(steps) != 1:
            raise SystemExit(f"{dist} {tokens}: runs with different warm-up or step counts {sorted(steps)}")
        batches = bench_batches(dist, tokens, world, *steps.pop())
        config = SimConfig(model="llama3-8b", layers=4, gpus=world, tp=1, gpus_per_node=world, tokens_per_gpu=tokens,
                           dist=dist, strategies=("local", "wlb", "cad"), batches=len(batches),
                           recompute="linear")  # the benchmark's keep_attention checkpointing and chunked loss
        sim = simulate_config(config, doc_batches=batches)["strategies"]
        for sim_name, bench_name in PAIRS.items():
            if bench_name not in measured or sim_name not in sim:
                continue
            pred = np.asarray(sim[sim_name]["per_batch_step_s"])
            meas = np.asarray(measured[bench_name]["step_times_s"])
            rows.append({"dist": dist, "tokens_per_gpu": tokens, "strategy": bench_name,
                         "measured_total_s": float(meas.sum()), "predicted_total_s": float(pred.sum()),
                         "error_total": float(pred.sum() / meas.sum() - 1),
                         "error_per_step_mean_abs": float(np.mean(np.abs(pred / meas - 1))),
                         "measured_s": meas.tolist(), "predicted_s": pred.tolist()})
    lines = ["# Simulator against measured step times (issue 7 validation)", "",
             f"Date {datetime.date.today()}. Measured: `{args.measured}` ({meta['machine']}, {meta['model']}). "
             "Predicted: `attnpool.sim` with the shipped H200 profile, the same batches (regenerated from the "
             f"benchmark's seed), {world} GPUs, TP 1, one node, recompute of the linear parts as the benchmark ran. Command: `python bench/sim_validation.py --out {args.out}`.", "",
             "Error = predicted / measured - 1 over the total of the measured steps, and the mean absolute per-step error. "
             f"Target: |error| <= {TARGET:.0%}.", "",
             "| dist | tokens/GPU | strategy | measured (s) | predicted (s) | error (total) | per-step mean abs error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dist']} | {r['tokens_per_gpu'] // 1024}K | {r['strategy']} | {r['measured_total_s']:.2f} | "
                     f"{r['predicted_total_s']:.2f} | {r['error_total']:+.1%} | {r['error_per_step_mean_abs']:.1%} |")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{datetime.date.today()}-sim-validation")
    json.dump({"measured": args.measured, "target": TARGET, "rows": rows}, open(stem + ".json", "w"), indent=1)
    open(stem + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
