#!/usr/bin/env python3
"""cad over the balanced layout against the linear one, on the benchmark's own batches: balance before planning,
balance after, and the bytes cad moves to reach it (the planner alone, on CPU; no step time).

    PYTHONPATH=src python bench/balanced_layout.py --out bench/results

The batches are those `attnpool bench` draws (bench/sim_validation.py's ``bench_batches``: the synthetic source,
seed 0, 1 warm-up and 2 measured steps), for each configuration of ``--configs`` (dist:tokens_per_gpu:GPUs);
Llama-3-8B's heads, a kernel table of the shipped H200 profile (fa4's by default, as the simulator prices fa4 runs),
cad's default tolerance; each batch whole and as its ping-pong nano-batches. Bytes are one layer's forward exchange
per GPU (Q out, KV prefixes, O back), the mean over the GPUs.
"""

from __future__ import annotations

import argparse
import sys

from attnpool.bench.record import write_record
from attnpool.model.config import model_config
from attnpool.plan import AttentionShape, balanced_table, linear_table, plan_attention
from attnpool.plan.layout import nano_batch_bounds
from attnpool.plan.metrics import PlanMetrics
from attnpool.sim.costs import load_sim_costs
from attnpool.sizes import parse_size
from sim_validation import bench_batches

CONFIGS = ("prolong:128K:2,prolong:256K:2,pretrain:128K:2,prolong:128K:4,prolong:256K:4,prolong:128K:8,"
           "pretrain:128K:8,prolong:256K:16")


def compare(dist: str, tokens: int, gpus: int, shape: AttentionShape, cost_model, min_shard: int | None) -> list[dict]:
    """Each measured step's batch whole, then its ping-pong nano-batches (as the runtime cuts them, each laid out
    over every GPU with its own budget)."""
    rows = []
    for step, lens in enumerate(bench_batches(dist, tokens, gpus, 1, 2)):
        parts = [("whole", lens, tokens)]
        parts += [(f"nano-batch {k + 1}", lens[d0:d1], -(-sum(lens[d0:d1]) // gpus))
                  for k, (d0, d1) in enumerate(nano_batch_bounds(lens, 2, gpus)) if (d0, d1) != (0, len(lens))]
        for part, part_lens, budget in parts:
            row = {"dist": dist, "tokens_per_gpu": tokens, "gpus": gpus, "step": step, "part": part,
                   "documents": len(part_lens), "longest": max(part_lens)}
            for layout, table in (("linear", linear_table(part_lens, gpus, budget)),
                                  ("balanced", balanced_table(part_lens, gpus, budget))):
                plan = plan_attention(table, "cad", cost_model=cost_model, min_shard_tokens=min_shard, shape=shape)
                m = PlanMetrics.of(plan, cost_model, shape)
                # (PlanMetrics' "before" is the table's own home loads: the layout's balance with nothing moved)
                row[layout] = {"imbalance_before": m.imbalance_before, "imbalance_after": m.imbalance_after,
                               "mib_per_gpu": m.bytes_moved / gpus / 2**20}
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--configs", default=CONFIGS, help="dist:tokens_per_gpu:GPUs, comma-separated")
    parser.add_argument("--attention-backend", default="fa4",
                        help="the kernel whose table of the shipped H200 profile prices attention (the simulator's, "
                             "as bench/sim_validation.py takes it for fa4 runs; default fa4)")
    args = parser.parse_args()
    costs = load_sim_costs(model_config("llama3-8b"), "llama3-8b", attention_backend=args.attention_backend)
    shape = AttentionShape(32, 8, 128, 2)
    rows = []
    for item in args.configs.split(","):
        dist, size, gpus = item.split(":")
        rows += compare(dist, parse_size(size), int(gpus), shape, costs.attn_fwd_bwd, costs.min_shard_tokens)
        print(f"{item}: done", file=sys.stderr, flush=True)
    command = "PYTHONPATH=src python bench/balanced_layout.py " + " ".join(sys.argv[1:])
    lines = ["# cad over the balanced layout and over the linear one: the planner on the benchmark's batches", "",
             "Balance before planning, cad's balance after, and the bytes it moves to reach it, per GPU and layer (one "
             "forward exchange: Q out, KV prefixes, O back), on the batches `attnpool bench` draws (synthetic, seed 0, "
             "the 2 measured steps after 1 warm-up; each whole, then its two ping-pong nano-batches as the runtime "
             f"cuts them), Llama-3-8B's heads, the {args.attention_backend} kernel's table of the shipped H200 profile "
             f"(as the simulator prices such runs). The planner alone, on CPU: no step time. Command: `{command}`.", "",
             "| dist | tokens/GPU | GPUs | step | part | documents (longest) | linear: max/mean before | balanced: before | "
             "cad's max/mean after (linear / balanced) | cad's MiB per GPU a layer (linear / balanced) | fewer bytes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lin, bal = r["linear"], r["balanced"]
        ratio = lin["mib_per_gpu"] / bal["mib_per_gpu"] if bal["mib_per_gpu"] else float("inf")
        lines.append(f"| {r['dist']} | {r['tokens_per_gpu'] // 1024}K | {r['gpus']} | {r['step'] + 1} | {r['part']} | "
                     f"{r['documents']} ({r['longest']:,}) | {lin['imbalance_before']:.3f} | {bal['imbalance_before']:.3f} | "
                     f"{lin['imbalance_after']:.3f} / {bal['imbalance_after']:.3f} | "
                     f"{lin['mib_per_gpu']:.1f} / {bal['mib_per_gpu']:.1f} | {ratio:.2f}x |")
    write_record(args.out, "cpu-balanced-layout-plans", {"command": command, "rows": rows}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
