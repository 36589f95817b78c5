#!/usr/bin/env python3
"""What the hierarchical exchange (attnpool train's hierarchical_exchange) should buy, by the simulator, before any
multi-node measurement (issue 43): cad with the flat exchange against cad with KV crossing into a node once, on
the DistCA paper's batches, across GPU counts and tensor-parallel sizes (the servers sharing a node: 8 / tp of
them on 8-GPU nodes), beside the best baseline (wlb, per-document CP, Ulysses).

cad-hierarchical's plans are made for the hierarchical exchange (the planner prices KV that a server of the
receiver's node already has as a hop inside the node, plan.cad); cad's are the flat exchange's.

The simulator charges the exchange as the runtime runs it: the all-to-all between nodes, then the relays' forwarding
inside each node, one after the other, the forwarding on the compute path (backward the reverse).
Between nodes it assumes the DistCA paper's 50 GB/s per GPU unless the profile says otherwise.

    PYTHONPATH=src python3 bench/sim_hierarchical.py --out bench/results
"""

from __future__ import annotations

import argparse
import sys

from attnpool.bench.record import write_record
from attnpool.sim.simulate import SimConfig, assumptions, expand, simulate_many
from attnpool.sizes import parse_size

BASELINES = ("wlb", "percp-cp", "ulysses-u")


def best_baseline(strategies: dict) -> tuple[str, float]:
    name = min((k for k in strategies if k.startswith(BASELINES)), key=lambda k: strategies[k]["step_s"])
    return name, strategies[name]["step_s"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--gpus", default="16,64,256")
    ap.add_argument("--tp", default="1,2,8")
    ap.add_argument("--dists", default="prolong,pretrain")
    ap.add_argument("--tokens-per-gpu", default="64K")
    ap.add_argument("--max-doc-len", default="512K")
    ap.add_argument("--batches", type=int, default=10)
    ap.add_argument("--head-chunks", type=int, default=1,
                    help="core attention in this many groups of heads, for the strategies that run it so (not ulysses)")
    ap.add_argument("--price-bytes", action="store_true",
                    help="cad prices its exchanges' bytes against balance at the simulated links (attnpool train's "
                         "exchange_gibps): of the states its greedy passes through, the least work plus priced bytes")
    ap.add_argument("--name", default="sim-hierarchical", help="the record's name (after the date)")
    args = ap.parse_args()
    gpus = [int(g) for g in args.gpus.split(",")]
    configs = [c for tp in (int(t) for t in args.tp.split(","))
               for c in expand(SimConfig(tp=tp, tokens_per_gpu=parse_size(args.tokens_per_gpu),
                                         max_doc_len=parse_size(args.max_doc_len), batches=args.batches,
                                         strategies=("wlb", "percp", "ulysses", "cad"), hierarchical=True,
                                         head_chunks=args.head_chunks, price_bytes=args.price_bytes),
                               dists=args.dists.split(","), gpus=gpus)]
    results = simulate_many(configs, progress=lambda done, total, _: print(f"  {done}/{total}", end="\r", file=sys.stderr))
    network = assumptions(configs[:1])
    rows = []
    for config, r in zip(configs, results):
        s = r["strategies"]
        best, best_s = best_baseline(s)
        flat, hier = s["cad"], s["cad-hierarchical"]
        rows.append({"dist": config.dist, "gpus": config.gpus, "tp": config.tp, "servers_per_node": r["servers_per_node"],
                     "cad_step_s": flat["step_s"], "cad_hierarchical_step_s": hier["step_s"],
                     "hierarchical_speedup": flat["step_s"] / hier["step_s"],
                     "cad_comm_exposed_s": flat["comm_exposed_s"], "cad_hierarchical_comm_exposed_s": hier["comm_exposed_s"],
                     "best_baseline": best, "best_baseline_step_s": best_s,
                     "cad_vs_best": best_s / flat["step_s"], "cad_hierarchical_vs_best": best_s / hier["step_s"]})
    command = "PYTHONPATH=src python3 bench/sim_hierarchical.py " + " ".join(sys.argv[1:])
    lines = ["# The hierarchical exchange by the simulator: cad with KV crossing into a node once (issue 43)"
             + (", cad's bytes priced" if args.price_bytes else ""), "",
             f"Command: `{command}`. Llama-3-8B, all 32 layers, {args.tokens_per_gpu} tokens per GPU, documents up to "
             f"{args.max_doc_len}, the DistCA paper's batches ({args.batches} per cell), 8 GPUs a node; an attention "
             "server is a TP group, so 8 / tp of them share a node"
             + (f"; core attention in {args.head_chunks} groups of heads but Ulysses'" if args.head_chunks != 1 else "")
             + ("; cad's planner prices its exchanges' bytes against balance (`--price-bytes`)" if args.price_bytes
                else "")
             + ". Simulated, not measured: between nodes "
             f"{network['inter_node']['bandwidth_GBps_per_gpu']:g} GB/s per GPU, inside one "
             f"{network['intra_node']['bandwidth_GBps_per_gpu']:.0f} GB/s (`assumptions` in the JSON).", "",
             "cad-hierarchical's plans are made for the hierarchical exchange (cad prices KV that a server of the "
             "receiver's node already has as a hop inside the node). Its exchange is two all-to-alls one after the "
             "other: between the nodes, then the relays' forwarding inside each node, which the runtime runs inside "
             "core attention's compute, so that no overlap hides it.", "",
             "| dist | GPUs | tp | servers a node | cad s (exposed comm) | hierarchical s (exposed comm) | hierarchical "
             "speedup | best baseline | cad vs best | hierarchical vs best |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['dist']} | {row['gpus']} | {row['tp']} | {row['servers_per_node']} | "
                     f"{row['cad_step_s']:.2f} ({row['cad_comm_exposed_s']:.2f}) | "
                     f"{row['cad_hierarchical_step_s']:.2f} ({row['cad_hierarchical_comm_exposed_s']:.2f}) | "
                     f"{row['hierarchical_speedup']:.3f}x | {row['best_baseline']} {row['best_baseline_step_s']:.2f} s | "
                     f"{row['cad_vs_best']:.3f}x | {row['cad_hierarchical_vs_best']:.3f}x |")
    stem = write_record(args.out, args.name, {"command": command, "assumptions": network, "rows": rows,
                                                   # every strategy's step and exposed communication, per cell
                                                   "configs": [{"label": r["label"], "strategies": {
                                                       k: {"step_s": v["step_s"], "comm_exposed_s": v["comm_exposed_s"]}
                                                       for k, v in r["strategies"].items()}} for r in results]}, lines)
    print("\n".join(lines[-len(rows) - 2:]))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
