#!/usr/bin/env python3
"""Planning a model of mixed attention kinds (issue 42): balance of each kind's plan and the time to plan them all.

A Gemma-3-like model has two kinds of layer, windowed (w keys) and global: a micro-batch gets one plan per window.
Targets: at 64 servers x 512K tokens of prolong documents, cad's max/mean <= 1.03 for each kind, and planning every
kind within 2x one kind's (the causal plan's) time. Medians over batches, each plan timed ``--repeats`` times (the
fastest kept, as a planner's own time); run pinned to one core:

    taskset -c 0 python bench/plan_windows.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

from attnpool.data.lengths import sample_batches
from attnpool.plan import default_cost_model, linear_table, plan_attention
from attnpool.plan.metrics import home_loads, imbalance, server_loads


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--servers", type=int, default=64)
    p.add_argument("--tokens", type=int, default=512 * 1024)
    p.add_argument("--dist", default="prolong")
    p.add_argument("--windows", default="1024,4096", help="the windowed layers' windows, comma-separated")
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="directory for plan_windows.json")
    args = p.parse_args(argv)
    model = default_cost_model()
    kinds = [None] + [int(w) for w in args.windows.split(",")]
    rows = []
    for seed in range(args.batches):
        table = linear_table(sample_batches(args.dist, args.servers * args.tokens, 1, seed)[0], args.servers)
        for window in kinds:
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                plan = plan_attention(table, "cad", cost_model=model, window=window)
                times.append(time.perf_counter() - start)
            x = plan.kv_transfers()
            rows.append(dict(seed=seed, window=window, plan_ms=1e3 * min(times),
                             local=imbalance(home_loads(table, model, window)),
                             cad=imbalance(server_loads(plan, model)),
                             kv_rows_moved=int(x.length[x.src != x.server].sum())))
    summary = []
    for window in kinds:
        mine = [r for r in rows if r["window"] == window]
        summary.append(dict(window=window, plan_ms=statistics.median(r["plan_ms"] for r in mine),
                            local_max=max(r["local"] for r in mine), cad_max=max(r["cad"] for r in mine),
                            kv_rows_moved=statistics.median(r["kv_rows_moved"] for r in mine)))
    causal_ms = summary[0]["plan_ms"]
    for window in kinds[1:]:  # a two-kind model: the causal plan and one windowed plan
        both = causal_ms + next(s["plan_ms"] for s in summary if s["window"] == window)
        print(f"global + window {window}: {both:.1f} ms = {both / causal_ms:.2f}x the causal plan alone")
    print(f"{args.dist}, {args.servers} servers x {args.tokens // 1024}K tokens, {args.batches} batches (cad):")
    print("  window   plan ms (median)  local max/mean  cad max/mean  KV rows moved (median)")
    for s in summary:
        print(f"  {s['window']!s:7s} {s['plan_ms']:12.1f} {s['local_max']:15.3f} {s['cad_max']:13.3f} "
              f"{s['kv_rows_moved']:16,.0f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        out = dict(date=str(datetime.date.today()), machine=platform.processor() or platform.machine(),
                   python=platform.python_version(), command=" ".join(sys.argv), rows=rows, summary=summary)
        with open(os.path.join(args.out, "plan_windows.json"), "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
