#!/usr/bin/env python3
"""cad over the balanced layout against the linear one, on the benchmark's own batches: balance before planning,
balance after, and the bytes cad moves to reach it (the planner alone, on CPU; no step time).

    PYTHONPATH=src python bench/balanced_layout.py --out bench/results

The batches are those `attnpool bench` draws (bench/sim_validation.py's ``bench_batches``: the synthetic source,
seed 0, 1 warm-up and 2 measured steps), for each configuration of ``--configs`` (dist:tokens_per_gpu:GPUs);
Llama-3-8B's heads, the shipped H200 kernel table, cad's default tolerance. Bytes are one layer's forward exchange
per GPU (Q out, KV prefixes, O back), the mean over the GPUs.
"""

from __future__ import annotations

import argparse
import sys

from attnpool.bench.record import write_record
from attnpool.plan import AttentionShape, balanced_table, linear_table, load_cost_model, plan_attention
from attnpool.plan.metrics import PlanMetrics
from attnpool.sizes import parse_size
from sim_validation import bench_batches

CONFIGS = ("prolong:128K:2,prolong:256K:2,pretrain:128K:2,prolong:128K:4,prolong:256K:4,prolong:128K:8,"
           "pretrain:128K:8,prolong:256K:16")


def compare(dist: str, tokens: int, gpus: int, shape: AttentionShape, cost_model) -> list[dict]:
    rows = []
    for step, lens in enumerate(bench_batches(dist, tokens, gpus, 1, 2)):
        row = {"dist": dist, "tokens_per_gpu": tokens, "gpus": gpus, "step": step, "documents": len(lens),
               "longest": max(lens)}
        for layout, table in (("linear", linear_table(lens, gpus, tokens)), ("balanced", balanced_table(lens, gpus, tokens))):
            m = PlanMetrics.of(plan_attention(table, "cad", cost_model=cost_model, shape=shape), cost_model, shape)
            # (PlanMetrics' "before" is the table's own home loads: the layout's balance with nothing moved)
            row[layout] = {"imbalance_before": m.imbalance_before, "imbalance_after": m.imbalance_after,
                           "mib_per_gpu": m.bytes_moved / gpus / 2**20}
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--configs", default=CONFIGS, help="dist:tokens_per_gpu:GPUs, comma-separated")
    args = parser.parse_args()
    shape, cost_model = AttentionShape(32, 8, 128, 2), load_cost_model(None)
    rows = []
    for item in args.configs.split(","):
        dist, size, gpus = item.split(":")
        rows += compare(dist, parse_size(size), int(gpus), shape, cost_model)
        print(f"{item}: done", file=sys.stderr, flush=True)
    command = "PYTHONPATH=src python bench/balanced_layout.py " + " ".join(sys.argv[1:])
    lines = ["# cad over the balanced layout and over the linear one: the planner on the benchmark's batches", "",
             "Balance before planning, cad's balance after, and the bytes it moves to reach it, per GPU and layer (one "
             "forward exchange: Q out, KV prefixes, O back), on the batches `attnpool bench` draws (synthetic, seed 0, "
             "the 2 measured steps after 1 warm-up), Llama-3-8B's heads, the shipped H200 kernel table. The planner "
             f"alone, on CPU: no step time. Command: `{command}`.", "",
             "| dist | tokens/GPU | GPUs | step | documents (longest) | linear: max/mean before | balanced: before | "
             "cad's max/mean after (linear / balanced) | cad's MiB per GPU a layer (linear / balanced) | fewer bytes |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lin, bal = r["linear"], r["balanced"]
        ratio = lin["mib_per_gpu"] / bal["mib_per_gpu"] if bal["mib_per_gpu"] else float("inf")
        lines.append(f"| {r['dist']} | {r['tokens_per_gpu'] // 1024}K | {r['gpus']} | {r['step'] + 1} | "
                     f"{r['documents']} ({r['longest']:,}) | {lin['imbalance_before']:.3f} | {bal['imbalance_before']:.3f} | "
                     f"{lin['imbalance_after']:.3f} / {bal['imbalance_after']:.3f} | "
                     f"{lin['mib_per_gpu']:.1f} / {bal['mib_per_gpu']:.1f} | {ratio:.2f}x |")
    write_record(args.out, "cpu-balanced-layout-plans", {"command": command, "rows": rows}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
