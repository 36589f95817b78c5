#!/usr/bin/env python3
"""Pipeline parallelism at cluster scale, simulated: bubbles, cad against WLB-ideal with PP, and what
DistCA's bubble reuse would gain (issue 22's question: is it worth >= 5% of the step?).

For each model, GPU count, distribution and micro-batch count: attnpool.sim.pipeline.simulate_pipeline
(TP 8 in a node, pp stages of gpus / pp GPUs, 1F1B), per strategy the step, its bubble, the predicted gain
of pooling the ramp's core attention over all stages (DistCA's bubble reuse) and an upper bound on any
reuse. Predictions, not measurements.

    PYTHONPATH=src python3 bench/sim_pipeline.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

from attnpool.bench.record import write_record
from attnpool.sim.pipeline import simulate_pipeline
from attnpool.sim.simulate import SimConfig

PAPER_WITH_PP = "8B 1.15-1.30x (Pretrain), 1.10-1.35x (ProLong); 34B up to 1.15x and 1.25x (DistCA, with PP)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--models", default="llama3-8b,llama-34b")
    parser.add_argument("--gpus", default="64,128,256,512")
    parser.add_argument("--dists", default="pretrain,prolong")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", default="8,16", help="micro-batches per step (comma list)")
    parser.add_argument("--tokens-per-gpu", type=int, default=65536)
    parser.add_argument("--max-doc-len", type=int, default=524288)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--suffix", default="", help="appended to the results' file name")
    args = parser.parse_args()
    rows = []
    t0 = time.perf_counter()
    for model in args.models.split(","):
        for gpus in (int(g) for g in args.gpus.split(",")):
            for dist in args.dists.split(","):
                for m in (int(x) for x in args.microbatches.split(",")):
                    config = SimConfig(model=model, gpus=gpus, tp=8, gpus_per_node=8, tokens_per_gpu=args.tokens_per_gpu,
                                       dist=dist, max_doc_len=args.max_doc_len, strategies=("wlb", "percp", "cad"),
                                       recompute="linear")
                    r = simulate_pipeline(config, args.pp, m, args.steps)
                    # (pipeline stages run without ping-pong: attnpool refuses it with pp > 1)
                    cad = r["strategies"]["cad-serial"]
                    rows.append({"model": model, "gpus": gpus, "dist": dist, "pp": args.pp, "microbatches": m,
                                 "speedup": r["strategies"][r["wlb_ideal"]]["step_s"] / cad["step_s"],
                                 "wlb_ideal": r.get("wlb_ideal"), **cad, "pooled_step_s": r["pooled"]["step_s"],
                                 "strategies": r["strategies"]})
                    print(model, gpus, dist, m, {k: round(v, 3) for k, v in cad.items() if isinstance(v, float)},
                          round(rows[-1]["speedup"], 3),
                          file=sys.stderr, flush=True)
    command = "PYTHONPATH=src python3 bench/sim_pipeline.py " + " ".join(sys.argv[1:])
    lines = ["# Pipeline parallelism at cluster scale (simulated): bubbles, bubble reuse and the pooled schedule", "",
             f"Date {datetime.date.today()}. `attnpool.sim.pipeline` with the shipped H200 profile: TP 8 in a node, "
             f"pp {args.pp} stages (1F1B), {args.tokens_per_gpu // 1024}K tokens per GPU per micro-batch, documents up "
             f"to {args.max_doc_len // 1024}K, {args.steps} steps per row, keep_attention's recompute. Predictions, not "
             f"measurements. Command: `{command}` ({time.perf_counter() - t0:.0f} s on one CPU core).", "",
             "cad's step under 1F1B (stages split with the output projection counted, no ping-pong: attnpool "
             "refuses it with pp > 1): `bubble` is the share of the step the ranks wait; `reuse` the predicted gain of "
             "DistCA's bubble reuse (the ramp's core attention pooled over all stages: half of it saved); `bound` an "
             "upper bound on any reuse; `attention` core attention's share of the stage-times; `vs WLB-ideal` cad "
             "against the best of WLB and per-document CP, both pipelined.", "",
             "`pooled`: the step of the schedule attnpool builds for it (`pp_schedule: pooled`: lock-step GPipe ticks, "
             "stages split as 1F1B's, each layer slot's core attention planned by cad over every stage's ranks and its "
             "exchanges timed, the output projection hidden in the spare slots where another stage runs a layer; "
             "checked against 4 x H200 runs in bench/results/2026-11-28-sim-pooled-validation.md), and its gain "
             "over 1F1B.", "",
             "| model | GPUs | dist | micro-batches | step (s) | bubble | attention | reuse | bound | pooled step (s) | "
             "pooled gain | vs WLB-ideal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['gpus']} | {r['dist']} | {r['microbatches']} | {r['step_s']:.2f} | "
                     f"{r['bubble_fraction']:.1%} | {r['attention_share']:.1%} | {r['reuse_gain']:.1%} | "
                     f"{r['reuse_gain_bound']:.1%} | {r['pooled_step_s']:.2f} | {r['pooled_gain']:.1%} | "
                     f"{r['speedup']:.2f}x |")
    gains = [r["reuse_gain"] for r in rows]
    pooled = [r["pooled_gain"] for r in rows]
    lines += ["", f"Predicted bubble reuse gain: {min(gains):.1%} to {max(gains):.1%} of the step "
                  f"(mean {sum(gains) / len(gains):.1%}); the paper reports {PAPER_WITH_PP}.",
              f"The pooled schedule against 1F1B: {min(pooled):.1%} to {max(pooled):.1%} of the step "
              f"(mean {sum(pooled) / len(pooled):.1%}).", ""]
    write_record(args.out, f"sim-pipeline{args.suffix}", {"command": command, "rows": rows}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
