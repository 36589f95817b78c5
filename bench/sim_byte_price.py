#!/usr/bin/env python3
"""What cad's priced bytes (attnpool train's exchange_gibps) change, by the simulator: on the 2 x H200 full-depth
benchmark's batches at the emulated network's rates and on NVLink, and across nodes (two runs of
bench/sim_hierarchical.py, without and with ``--price-bytes``).

    PYTHONPATH=src python3 bench/sim_byte_price.py --out bench/results

Every figure is a prediction. The 2-GPU cells are the batches the benchmark measured (regenerated from its seed:
``sim_validation.bench_batches``), all 32 layers of Llama-3-8B, full recompute as the runs' checkpointing, fa4's
table, the link inside the node at the rate given (the emulated network's loopback as one fabric the GPUs share,
``--shared-link`` as sim_validation runs it). cad and cad+pingpong are planned twice: balancing whatever the bytes,
and with their bytes priced at that rate (``SimConfig.price_bytes``).
"""

from __future__ import annotations

import argparse
import json
import sys

from attnpool.bench.record import write_record
from sim_validation import bench_batches, sim_costs, simulate_bench

# (dist, tokens per GPU, warm-up steps, measured steps, the emulated rate of the run it mirrors, that run)
CELLS = [("prolong", 128 * 1024, 1, 2, 5.47, 18), ("prolong", 256 * 1024, 1, 2, 4.46, 39),
         ("pretrain", 128 * 1024, 1, 2, 5.42, 47), ("pretrain", 256 * 1024, 2, 1, 5.65, 46)]
BASELINES = ("local", "wlb", "percp-plan", "ulysses-u2")


def two_gpu_rows(slow_gibps: float) -> list[dict]:
    rows = []
    for dist, tokens, warmup, steps, gibps, run in CELLS:
        batches = bench_batches(dist, tokens, 2, warmup, steps)
        for link in (gibps, slow_gibps, None):
            args = argparse.Namespace(intra_gibps=link, inter_gibps=None, shared_link=link is not None)
            costs = sim_costs(32, args, "fa4")
            plain, priced = (simulate_bench(dist, tokens, 2, 1, 2, 32, "full", False, batches, costs,
                                            price_bytes=p)[0] for p in (False, True))
            total = lambda result, name: sum(result[name]["per_batch_step_s"])  # noqa: E731
            best = min(BASELINES, key=lambda name: total(plain, name))
            rows.append({"dist": dist, "tokens_per_gpu": tokens, "steps": f"{warmup}+{steps}", "run": run,
                         "link_gibps": link, "best_baseline": best, "best_baseline_s": total(plain, best),
                         "local_s": total(plain, "local"),
                         **{f"{key}_s": total(plain, name) for key, name in (("cad", "cad-serial"),
                                                                              ("cad_pingpong", "cad"))},
                         **{f"{key}_priced_s": total(priced, name) for key, name in (("cad", "cad-serial"),
                                                                                     ("cad_pingpong", "cad"))}})
    return rows


def grid_rows(plain_path: str, priced_path: str) -> list[dict]:
    plain, priced = (json.load(open(path))["rows"] for path in (plain_path, priced_path))
    rows = []
    for a, b in zip(plain, priced):
        if (a["dist"], a["gpus"], a["tp"]) != (b["dist"], b["gpus"], b["tp"]):
            raise SystemExit(f"{plain_path} and {priced_path} hold other cells")
        rows.append({"dist": a["dist"], "gpus": a["gpus"], "tp": a["tp"], "best_baseline": a["best_baseline"],
                     **{f"{key}_s": a[f"{key}_step_s"] for key in ("cad", "cad_hierarchical")},
                     **{f"{key}_priced_s": b[f"{key}_step_s"] for key in ("cad", "cad_hierarchical")},
                     "best_vs_baseline": max(a["cad_vs_best"], a["cad_hierarchical_vs_best"]),
                     "best_vs_baseline_priced": max(b["cad_vs_best"], b["cad_hierarchical_vs_best"])})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--slow-gibps", type=float, default=2.5, help="a slower link for the 2-GPU cells besides")
    ap.add_argument("--grid", default="bench/results/2026-11-30-sim-hierarchical-rerun.json",
                    help="bench/sim_hierarchical.py's record without --price-bytes")
    ap.add_argument("--grid-priced", default="bench/results/2026-11-30-sim-hierarchical-price-bytes.json",
                    help="the same with --price-bytes")
    ap.add_argument("--name", default="sim-cad-byte-price")
    args = ap.parse_args()
    two = two_gpu_rows(args.slow_gibps)
    grid = grid_rows(args.grid, args.grid_priced)
    command = "PYTHONPATH=src python3 bench/sim_byte_price.py " + " ".join(sys.argv[1:])
    gain = lambda plain, priced: f"{plain / priced:.3f}x"  # noqa: E731
    lines = ["# cad pricing its exchanges' bytes against balance (`exchange_gibps`), by the simulator", "",
             f"Command: `{command}`. {__doc__.split(chr(10) + chr(10))[2]}", "",
             "## 2 x H200, the full-depth benchmark's batches (totals of the measured steps, s)", "",
             "| dist | tokens/GPU | warm-up + measured | link | best baseline | `local` | `cad`: balanced / priced "
             "| gain | `cad`+ping-pong: balanced / priced | gain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in two:
        link = "NVLink (profile)" if r["link_gibps"] is None else f"{r['link_gibps']:g} GiB/s"
        lines.append(f"| {r['dist']} | {r['tokens_per_gpu'] // 1024}K | {r['steps']} (run {r['run']}'s) | {link} | "
                     f"{r['best_baseline']} {r['best_baseline_s']:.2f} | {r['local_s']:.2f} | "
                     f"{r['cad_s']:.2f} / {r['cad_priced_s']:.2f} | {gain(r['cad_s'], r['cad_priced_s'])} | "
                     f"{r['cad_pingpong_s']:.2f} / {r['cad_pingpong_priced_s']:.2f} | "
                     f"{gain(r['cad_pingpong_s'], r['cad_pingpong_priced_s'])} |")
    lines += ["", f"## Across nodes: `{args.grid}` against `{args.grid_priced}` (step s, cad with ping-pong)", "",
              "| dist | GPUs | tp | flat `cad`: balanced / priced | gain | hierarchical: balanced / priced | gain "
              "| the faster over the best baseline: balanced / priced |",
              "|---|---|---|---|---|---|---|---|"]
    for r in grid:
        lines.append(f"| {r['dist']} | {r['gpus']} | {r['tp']} | {r['cad_s']:.2f} / {r['cad_priced_s']:.2f} | "
                     f"{gain(r['cad_s'], r['cad_priced_s'])} | {r['cad_hierarchical_s']:.2f} / "
                     f"{r['cad_hierarchical_priced_s']:.2f} | "
                     f"{gain(r['cad_hierarchical_s'], r['cad_hierarchical_priced_s'])} | "
                     f"{r['best_vs_baseline']:.3f}x / {r['best_vs_baseline_priced']:.3f}x ({r['best_baseline']}) |")
    ratios = lambda rows, key: [r[f"{key}_s"] / r[f"{key}_priced_s"] for r in rows]  # noqa: E731
    serial, pingpong = ratios(two, "cad"), ratios(two, "cad_pingpong")
    across = ratios(grid, "cad") + ratios(grid, "cad_hierarchical")
    lines += ["", "## Reading", "",
              f"- 2 GPUs: priced, `cad` without ping-pong is never slower than `local` "
              f"(worst {max(r['cad_priced_s'] / r['local_s'] for r in two):.3f}x its time) and gains up to "
              f"{max(serial):.3f}x over balancing; `cad`+ping-pong gains up to {max(pingpong):.3f}x and loses at most "
              f"{1 - min(pingpong):.1%}. On NVLink's rate every plan is the balanced one.",
              f"- Across nodes (ping-pong): gains up to {max(across):.3f}x, losses at most {1 - min(across):.1%}; "
              "the faster of flat and hierarchical `cad` over the best baseline moves from "
              f"{min(r['best_vs_baseline'] for r in grid):.3f}x to {min(r['best_vs_baseline_priced'] for r in grid):.3f}x "
              "in the worst cell.",
              "- Predictions. The price of a byte under ping-pong (`plan.cost.OVERLAPPED_EXCHANGE_SHARE`) is a fit to "
              "these cells; GPU runs planned with `exchange_gibps` are runs 50-55 of "
              "`2026-11-29-h200x2-full-depth-baselines.md`."]
    stem = write_record(args.out, args.name, {"command": command, "two_gpus": two, "grid": grid}, lines)
    print("\n".join(lines))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
