#!/usr/bin/env python3
"""cad planning for the hierarchical exchange (issue 43): bytes between nodes and planning time, with and without
``Topology.relays``, on the DistCA paper's batches (`attnpool simulate`'s sampler), the packaged H200 table and
8 GPUs a node. Bytes: one layer's forward exchanges (Q out, O back, KV), KV relayed as the hierarchical exchange
sends it (plan.plan.inter_node_bytes) for both plans, so the columns differ by the plan alone. Time: the
planner's own wall time per plan (``Plan.plan_seconds``), median over the batches, on the machine it runs on.

    PYTHONPATH=src python3 bench/plan_relays.py --out bench/results
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys

from attnpool.bench.record import write_record
from attnpool.plan import AttentionShape, linear_table, plan_attention
from attnpool.plan.plan import Topology, inter_node_bytes
from attnpool.sim.costs import load_sim_costs
from attnpool.sim.simulate import SimConfig, sample
from attnpool.sim.steptime import Cluster
from attnpool.sizes import parse_size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--gpus", default="64,256")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--dists", default="prolong,pretrain")
    ap.add_argument("--max-doc-len", default="512K")
    ap.add_argument("--batches", type=int, default=4)
    args = ap.parse_args()
    rows = []
    for dist in args.dists.split(","):
        for gpus in (int(g) for g in args.gpus.split(",")):
            for tp in (int(t) for t in args.tp.split(",")):
                config = SimConfig(gpus=gpus, tp=tp, dist=dist, max_doc_len=parse_size(args.max_doc_len),
                                   batches=args.batches, strategies=("cad",))
                cfg = config.model_config()
                costs = load_sim_costs(cfg, config.model)
                cluster = Cluster(gpus, tp, config.gpus_per_node, config.tokens_per_gpu)
                shape = AttentionShape(cfg.n_heads // tp, max(1, cfg.n_kv_heads // tp), cfg.head_dim, 2)
                topology = Topology.of(cluster.servers, cluster.servers_per_node,
                                       costs.intra.bandwidth / costs.inter.bandwidth)
                found = {False: ([], []), True: ([], [])}
                for lens in sample(config, cluster):
                    table = linear_table(lens, cluster.servers, cluster.tokens_per_server)
                    for relays in (False, True):
                        plan = plan_attention(table, "cad", cost_model=costs.attn_fwd_bwd, shape=shape, eps=config.eps,
                                              min_shard_tokens=costs.min_shard_tokens,
                                              topology=dataclasses.replace(topology, relays=relays))
                        found[relays][0].append(inter_node_bytes(plan, topology.rank_node, shape, relays=True))
                        found[relays][1].append(plan.plan_seconds)
                flat, relayed = (sum(found[r][0]) / args.batches for r in (False, True))
                rows.append({"dist": dist, "gpus": gpus, "tp": tp, "servers": cluster.servers,
                             "servers_per_node": cluster.servers_per_node,
                             "bytes_between_nodes_flat_plan": flat, "bytes_between_nodes_relay_plan": relayed,
                             "per_batch_ratio": [r / f for f, r in zip(*(found[x][0] for x in (False, True)))],
                             "plan_s_flat": statistics.median(found[False][1]),
                             "plan_s_relays": statistics.median(found[True][1])})
                r = rows[-1]
                print(f"{dist} {gpus} GPUs tp {tp}: {relayed / flat - 1:+.1%} bytes between nodes, plan "
                      f"{r['plan_s_flat']:.2f} -> {r['plan_s_relays']:.2f} s", flush=True)
    command = "PYTHONPATH=src python3 bench/plan_relays.py " + " ".join(sys.argv[1:])
    lines = ["# cad planning for the hierarchical exchange: bytes between nodes and planning time (issue 43)", "",
             f"A computation on the planner's own plans, not a GPU measurement. Command: `{command}`, on "
             f"{platform.machine()} ({platform.processor() or 'cpu'}), the development machine's 2 cores. Llama-3-8B, "
             f"64K tokens per GPU, documents up to {args.max_doc_len}, the DistCA paper's batches ({args.batches} a "
             "cell), 8 GPUs a node, the packaged H200 table. Both plans' exchanges are counted as the hierarchical "
             "exchange sends them (one layer's forward: Q out, O back, KV relayed); planning time is the planner's "
             "wall time, the median over the batches.", "",
             "| dist | GPUs | tp | servers (a node) | flat-priced plan (GiB) | planned for relays (GiB) | change | "
             "worst batch | plan s, flat | plan s, relays |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dist']} | {r['gpus']} | {r['tp']} | {r['servers']} ({r['servers_per_node']}) | "
                     f"{r['bytes_between_nodes_flat_plan'] / 2**30:.2f} | {r['bytes_between_nodes_relay_plan'] / 2**30:.2f} | "
                     f"{r['bytes_between_nodes_relay_plan'] / r['bytes_between_nodes_flat_plan'] - 1:+.1%} | "
                     f"{max(r['per_batch_ratio']) - 1:+.1%} | {r['plan_s_flat']:.2f} | {r['plan_s_relays']:.2f} |")
    write_record(args.out, "cpu-plan-relays", {"command": command, "rows": rows}, lines)
    print("\n".join(lines[-len(rows) - 2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
