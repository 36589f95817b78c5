#!/usr/bin/env python3
"""What a hierarchical exchange could save: the inter-node bytes of cad's plans that the same KV sent twice into one
node makes up (issue 43, "make the exchange hierarchical where that measures faster").

cad sends each server the KV prefix of every document it serves a piece of, from the ranks that hold it
(Plan.kv_transfers). Where two servers of one node need the same keys from a rank of another node, a flat
all-to-all sends them across the network twice; a hierarchical exchange would send them once and copy them on
over NVLink. Queries and outputs are each one server's own, so no hierarchy saves those. For the DistCA paper's
batches (attnpool.sim's sampler, the paper's recipe) and the plans `attnpool simulate` makes (cad knowing the
nodes, the packaged H200 table), this counts, per configuration, the inter-node bytes of a step's forward exchanges
(Q and KV out, O back) and the share of them that is KV a node receives more than once: an upper bound on what
a hierarchical exchange saves in bytes (before its own extra hop inside the node).

    PYTHONPATH=src python3 bench/kv_per_node.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import sys

import numpy as np

from attnpool.bench.record import write_record
from attnpool.plan import linear_table, plan_attention
from attnpool.plan.plan import AttentionShape, Topology
from attnpool.plan.plan import inter_node_bytes as exchange_bytes_between_nodes
from attnpool.sim.costs import load_sim_costs
from attnpool.sim.simulate import SimConfig, sample
from attnpool.sim.steptime import Cluster
from attnpool.sizes import parse_size


def inter_node_bytes(plan, shape: AttentionShape, servers_per_node: int) -> tuple[float, float]:
    """(inter-node bytes of the plan's forward exchanges, of which KV a node receives more than once)."""
    node = lambda rank: np.asarray(rank) // servers_per_node  # noqa: E731
    total = exchange_bytes_between_nodes(plan, node(np.arange(plan.num_ranks)), shape)
    x = plan.kv_transfers()
    crossing = node(x.src) != node(x.server)
    dst_node, piece, start, end = node(x.server[crossing]), x.piece[crossing], x.start[crossing], \
        x.start[crossing] + x.length[crossing]
    kv = float(x.length[crossing].sum()) * shape.kv_bytes
    # Of each piece's segments that land in one node, the union crosses once; the rest crosses again. Sorted by
    # (node, piece, start), a segment opens a new interval of the union where its block changes or it starts past
    # the block's running end (as Plan.kv_transfers merges key ranges).
    order = np.lexsort((start, piece, dst_node))
    block = (dst_node * (int(piece.max(initial=0)) + 1) + piece)[order]
    start, end = start[order], end[order]
    span = int(end.max(initial=0)) + 1
    running_end = np.maximum.accumulate(block * span + end) - block * span
    opens = np.r_[True, block[1:] != block[:-1]] | np.r_[False, start[1:] > running_end[:-1]]
    first = np.flatnonzero(opens)
    last = np.r_[first[1:], len(block)] - 1
    union = int((running_end[last] - start[first]).sum())
    duplicate = kv - float(union) * shape.kv_bytes
    return total, duplicate


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--gpus", default="64,256")
    parser.add_argument("--tp", default="1,2,8", help="tensor-parallel sizes (8 GPUs a node): 8 makes a server a node")
    parser.add_argument("--configs", default="pretrain:128K,prolong:512K", help="dist:max document length pairs")
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    rows = []
    for item in args.configs.split(","):
        dist, _, size = item.partition(":")
        for gpus in (int(g) for g in args.gpus.split(",")):
            for tp in (int(t) for t in args.tp.split(",")):
                config = SimConfig(model=args.model, gpus=gpus, tp=tp, dist=dist, max_doc_len=parse_size(size),
                                   batches=args.batches, strategies=("cad",))
                cfg = config.model_config()
                costs = load_sim_costs(cfg, args.model)
                cluster = Cluster(gpus, tp, config.gpus_per_node, config.tokens_per_gpu)
                shape = AttentionShape(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 2)
                S = cluster.servers
                topology = Topology.of(S, cluster.servers_per_node, costs.intra.bandwidth / costs.inter.bandwidth)
                total = duplicate = 0.0
                for lens in sample(config, cluster):
                    plan = plan_attention(linear_table(lens, S, cluster.tokens_per_server), "cad",
                                          cost_model=costs.attn_fwd_bwd, min_shard_tokens=costs.min_shard_tokens,
                                          shape=shape, eps=config.eps, topology=topology)
                    t, d = inter_node_bytes(plan, shape, cluster.servers_per_node)
                    total, duplicate = total + t, duplicate + d
                rows.append({"dist": dist, "max_doc_len": parse_size(size), "gpus": gpus, "tp": tp, "servers": S,
                             "servers_per_node": cluster.servers_per_node,
                             "inter_node_bytes_per_step": total / args.batches,
                             "duplicate_kv_bytes_per_step": duplicate / args.batches,
                             "duplicate_share": duplicate / total if total else 0.0})
                r = rows[-1]
                print(f"{dist} {size} {gpus} GPUs tp {tp}: {r['inter_node_bytes_per_step'] / 2**30:.2f} GiB across "
                      f"nodes a step (forward), {r['duplicate_share']:.1%} of it KV sent into a node twice", flush=True)
    command = "PYTHONPATH=src python3 bench/kv_per_node.py " + " ".join(sys.argv[1:])
    lines = [f"# What a hierarchical exchange could save: KV sent into one node more than once ({args.model})", "",
             f"Date {datetime.date.today()}. A computation on the planner's own plans, not a measurement: "
             f"{args.batches} batches per configuration drawn with the DistCA paper's recipe (`attnpool simulate`'s "
             "sampler, 64K tokens per GPU, 8 GPUs a node), planned by cad knowing the nodes with the packaged H200 "
             "table. Inter-node bytes: a step's forward exchanges of one layer (Q and KV out, O back; backward "
             "mirrors them). Duplicate: KV of one piece sent from one node into another more than once, which a "
             "hierarchical exchange would send once. Command: " + f"`{command}`.", "",
             "| dist | max doc | GPUs | tp | servers (per node) | across nodes a layer (GiB) | KV sent into a node twice |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dist']} | {r['max_doc_len'] // 1024}K | {r['gpus']} | {r['tp']} | {r['servers']} "
                     f"({r['servers_per_node']}) | {r['inter_node_bytes_per_step'] / 2**30:.2f} | "
                     f"{r['duplicate_share']:.1%} |")
    write_record(args.out, "kv-per-node", {"command": command, "rows": rows}, lines)
    print("\n".join(lines[-len(rows) - 2:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
