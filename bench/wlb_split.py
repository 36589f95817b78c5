#!/usr/bin/env python3
"""wlb's attention balance on the benchmark's own batches: causal pairs per rank under its packing, max over mean,
for each step of each configuration (the planner alone, on CPU).

    PYTHONPATH=src python bench/wlb_split.py [--configs pretrain:256K:2,...] [--steps 4] [--memory-cap 1.1]

The batches are those `attnpool bench` draws (bench/sim_validation.py's ``bench_batches``: the synthetic source, seed
0), steps 1 to ``--steps``. It prints one markdown row per configuration: each step's max/mean, and how many of its
documents wlb had to cut over ranks (those longer than every rank's room).
"""

from __future__ import annotations

import argparse

import numpy as np

from attnpool.plan.documents import causal_pairs
from attnpool.plan.layout import wlb_pieces
from attnpool.sizes import parse_size
from sim_validation import bench_batches

CONFIGS = "pretrain:128K:2,pretrain:256K:2,pretrain:128K:4,pretrain:256K:4,pretrain:128K:8,pretrain:256K:8," \
          "prolong:128K:8,prolong:256K:8"


def balance(lens, ranks: int, tokens_per_rank: int, memory_cap: float) -> tuple[float, int]:
    """wlb's max/mean of causal pairs over the ranks, and how many documents it cut."""
    _, rank, doc, start, length = wlb_pieces(lens, ranks, tokens_per_rank, memory_cap)
    pairs = np.zeros(ranks)
    np.add.at(pairs, rank, causal_pairs(start, start + length))
    return float(pairs.max() / pairs.mean()), len(set(doc[start > 0].tolist()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=CONFIGS, help="dist:tokens_per_gpu:GPUs, comma-separated")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--memory-cap", type=float, default=1.1)
    args = ap.parse_args()
    print("| dist | tokens/GPU | GPUs | " + " | ".join(f"step {s + 1}" for s in range(args.steps)) + " |")
    print("|---|---|---|" + "---|" * args.steps)
    for item in args.configs.split(","):
        dist, tokens, gpus = item.split(":")
        tokens, gpus = parse_size(tokens), int(gpus)
        cells = []
        for lens in bench_batches(dist, tokens, gpus, 0, args.steps):
            imbalance, cut = balance(lens, gpus, tokens, args.memory_cap)
            cells.append(f"{imbalance:.3f}" + (f" ({cut} cut)" if cut else ""))
        print(f"| {dist} | {tokens // 1024}K | {gpus} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
