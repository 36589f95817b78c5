"""``attnpool plan``: draw a batch from a length distribution, lay it out, plan it, report."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from attnpool.cli.common import parse_size
from attnpool.data.lengths import DISTRIBUTIONS, SamplingOptions, sample_batches
from attnpool.errors import ConfigError
from attnpool.plan import LAYOUTS, STRATEGIES, AttentionShape, layout_table, linear_table, load_cost_model, plan_attention
from attnpool.plan.cost import byte_price_problem, exchange_byte_seconds
from attnpool.plan.plan import Topology, inter_node_bytes
from attnpool.plan.ulysses import ulysses_problem
from attnpool.plan.metrics import PlanMetrics, home_loads, imbalance


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="plan core attention for one sampled batch and report balance, bytes and time",
                       description="Sample a packed global batch, lay it out on servers and plan core attention.")
    p.add_argument("--dist", default="prolong", help=f"length distribution: {', '.join(DISTRIBUTIONS)} or a JSON file (default prolong)")
    p.add_argument("--servers", type=int, default=64, help="attention servers: GPUs, or TP groups with --tp (default 64)")
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: a server is a TP group, each GPU of which "
                                                      "computes and sends its share of the heads (Llama-3-8B's 32 query "
                                                      "/ 8 KV heads; bytes are per GPU) (default 1)")
    p.add_argument("--tokens-per-server", type=parse_size, default=parse_size("512K"), help="tokens per server, e.g. 128K (default 512K)")
    p.add_argument("--strategy", default="cad", choices=STRATEGIES + ("all",), help="scheduler, or 'all' side by side (default cad)")
    p.add_argument("--seed", type=int, default=0, help="batch sampling seed (default 0)")
    p.add_argument("--eps", type=float, default=0.02, help="cad leaves max/mean <= 1 + eps (default 0.02)")
    p.add_argument("--min-shard", type=parse_size, default=None, help="smallest query shard a scheduler may cut (default from the cost table: 512)")
    p.add_argument("--cost-model", default="table", help="'table' (measured H200 default), 'pairs', or a cost-table JSON file")
    p.add_argument("--memory-cap", type=float, default=1.1, help="wlb: tokens per server may reach this multiple of the budget (default 1.1)")
    p.add_argument("--layout", default="linear", choices=LAYOUTS,
                   help="which server holds which documents before planning (attnpool train's layout): linear, poured "
                        "in order, or balanced, equal tokens with whole documents placed to even out attention first "
                        "(wlb packs by its own --memory-cap) (default linear)")
    p.add_argument("--no-upsample", action="store_true", help="draw documents plainly instead of the paper's long-document up-sampling")
    p.add_argument("--elongate", type=float, default=1.0, help="multiply every document length by this factor (paper: context / 64K)")
    p.add_argument("--max-doc-len", type=parse_size, default=None, help="cut longer documents into pieces of this length")
    p.add_argument("--window", type=parse_size, default=None, help="plan the layers of a sliding window of this many "
                                                                   "keys, e.g. 4K (default: causal over the whole prefix)")
    p.add_argument("--ranks-per-node", type=int, default=0,
                   help="GPUs a node (a multiple of --tp): cad then prices bytes between nodes higher, and the "
                        "report counts them (default 0: every server on one node)")
    p.add_argument("--hierarchical-exchange", action="store_true",
                   help="with --ranks-per-node: KV into a node crosses once (attnpool train's hierarchical_exchange), "
                        "and cad plans for it")
    p.add_argument("--exchange-gibps", type=float, default=None,
                   help="GiB/s per GPU of the link inside a node (attnpool train's exchange_gibps): cad weighs its "
                        "moves' bytes against the balance they buy, as a run without checkpointing or ping-pong "
                        "(default: balance whatever the bytes)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="draw per-server load for each strategy")
    p.set_defaults(func=run)


# The planner's and the sampler's names for what this command's flags set: their refusals name the flag typed.
FLAG_OF_FIELD = {"eps": "--eps", "elongate": "--elongate", "max_doc_len": "--max-doc-len",
                 "min_shard_tokens": "--min-shard", "exchange_gibps": "--exchange-gibps"}


def run(args: argparse.Namespace) -> int:
    try:
        return _plan(args)
    except ConfigError as exc:
        if exc.field in FLAG_OF_FIELD:
            raise ConfigError(FLAG_OF_FIELD[exc.field], exc.value, exc.problem) from None
        raise


def _plan(args: argparse.Namespace) -> int:
    if args.servers < 1:
        raise ConfigError("--servers", args.servers, "need at least one server")
    shape = AttentionShape()
    if args.tp < 1 or shape.n_kv_heads % args.tp:
        raise ConfigError("--tp", args.tp, f"must divide the {shape.n_kv_heads} KV heads of the planned shape")
    if args.tokens_per_server < 1:
        raise ConfigError("--tokens-per-server", args.tokens_per_server, "must be positive")
    if args.seed < 0:
        raise ConfigError("--seed", args.seed, "must be >= 0")
    if not (math.isfinite(args.memory_cap) and args.memory_cap >= 1.0):
        raise ConfigError("--memory-cap", args.memory_cap, "must be a finite number >= 1.0")
    if args.window is not None and args.window < 1:
        raise ConfigError("--window", args.window, "a sliding window is a positive number of keys")
    topology = None
    if args.ranks_per_node:
        gpus = args.servers * args.tp
        per_node = min(args.ranks_per_node, gpus)  # (a node larger than the job holds all of it)
        if args.ranks_per_node < 0 or per_node % args.tp or gpus % per_node:
            raise ConfigError("--ranks-per-node", args.ranks_per_node, f"must be a positive multiple of --tp={args.tp} "
                                                                       f"that divides the {gpus} GPUs")
        topology = Topology.of(args.servers, per_node // args.tp, relays=args.hierarchical_exchange)
    if args.hierarchical_exchange and (topology is None or topology.num_nodes == 1):
        raise ConfigError("--hierarchical-exchange", True, "needs servers on several nodes (--ranks-per-node)")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        raise ConfigError("--plot", args.plot, "its directory does not exist")
    options = SamplingOptions(upsample=not args.no_upsample, elongate=args.elongate, max_doc_len=args.max_doc_len)
    cost_model = load_cost_model(args.cost_model)
    byte_seconds = 0.0
    if args.exchange_gibps is not None:
        if args.strategy not in ("cad", "all"):
            raise ConfigError("--exchange-gibps", args.exchange_gibps, f"prices cad's moves; --strategy {args.strategy} "
                                                                       "plans none")
        if byte_price_problem(cost_model):
            raise ConfigError("--exchange-gibps", args.exchange_gibps, byte_price_problem(cost_model))
        byte_seconds = exchange_byte_seconds(args.exchange_gibps)
    # A server's cost and bytes are one GPU's: its share of the heads (the plan does not change with tp).
    shape = AttentionShape(shape.n_q_heads // args.tp, shape.n_kv_heads // args.tp, shape.head_dim, shape.dtype_bytes)
    if args.tp > 1 and hasattr(cost_model, "scaled_to"):
        cost_model = cost_model.scaled_to(shape.n_q_heads, shape.head_dim)
    doc_lens = sample_batches(args.dist, args.servers * args.tokens_per_server, 1, args.seed, options)[0]
    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
    skipped = {}
    if args.strategy == "all":  # ulysses only where the servers split the heads (a server per head at most)
        problem = ulysses_problem(args.servers, shape.n_q_heads, shape.n_kv_heads)
        if problem:
            strategies, skipped = tuple(s for s in strategies if s != "ulysses"), {"ulysses": problem}
    linear = linear_table(doc_lens, args.servers, args.tokens_per_server)
    results = {}
    for strategy in strategies:
        table = layout_table(args.layout, doc_lens, args.servers, args.tokens_per_server, strategy, args.memory_cap,
                             linear)
        plan = plan_attention(table, strategy, cost_model=cost_model, min_shard_tokens=args.min_shard, eps=args.eps,
                              shape=shape, window=args.window, topology=topology, byte_seconds=byte_seconds)
        metrics = PlanMetrics.of(plan, cost_model, shape,
                                 topology.rank_node if topology is not None and topology.relays else None)
        if topology is not None:  # (ulysses sends every token's Q, KV and O across all ranks, not as tasks)
            metrics.inter_node_bytes = (None if strategy == "ulysses" else
                                        int(inter_node_bytes(plan, topology.rank_node, shape, args.hierarchical_exchange)))
        if strategy == "wlb" or args.layout != "linear":  # "before" is the linear layout served locally, as for all
            before = home_loads(linear, cost_model, args.window)
            metrics.load_before, metrics.imbalance_before = before.tolist(), imbalance(before)
        results[strategy] = metrics
    batch = {"dist": args.dist, "servers": args.servers, "tp": args.tp, "tokens_per_server": args.tokens_per_server,
             "seed": args.seed, "layout": args.layout,
             "num_docs": len(doc_lens), "max_doc_len": max(doc_lens), "cost_model": getattr(cost_model, "name", ""),
             "eps": args.eps, "window": args.window, "ranks_per_node": args.ranks_per_node or None,
             "hierarchical_exchange": args.hierarchical_exchange}
    if args.json:
        json.dump({"batch": batch, "strategies": {k: m.summary() for k, m in results.items()}, "skipped": skipped},
                  sys.stdout, indent=1)
        print()
    else:
        print_table(batch, results)
        for name, reason in skipped.items():
            print(f"{name}: not planned: {reason}")
    if args.plot:
        plot_loads(results, batch, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr if args.json else sys.stdout)  # (stdout holds the JSON alone)
    return 0


def print_table(batch: dict, results: dict[str, PlanMetrics]) -> None:
    from attnpool.console import text_console
    from rich.table import Table

    servers = f"{batch['servers']} servers (TP groups of {batch['tp']}; bytes per GPU)" if batch["tp"] > 1 \
        else f"{batch['servers']} servers"
    window = "" if batch.get("window") is None else f", window {batch['window']}"
    if batch.get("ranks_per_node"):
        window += f", {batch['ranks_per_node']} GPUs a node" + (", hierarchical" if batch["hierarchical_exchange"] else "")
    if batch.get("layout", "linear") != "linear":
        window += f", layout {batch['layout']} (wlb: its own packing; before: linear)"
    title = (f"{batch['dist']}: {servers} x {batch['tokens_per_server']} tokens, "
             f"{batch['num_docs']} documents (longest {batch['max_doc_len']}), seed {batch['seed']}{window}")
    table = Table(title=title)
    table.add_column("")
    for name in results:
        table.add_column(name, justify="right")
    rows = [
        ("max/mean before", lambda m: f"{m.imbalance_before:.3f}"),
        ("max/mean after", lambda m: f"{m.imbalance_after:.3f}"),
        ("bytes moved (GiB)", lambda m: f"{m.bytes_moved / 2**30:.2f}"),
        ("max bytes/rank (MiB)", lambda m: f"{m.summary()['max_bytes_per_rank'] / 2**20:.1f}"),
        *([("between nodes (GiB)", lambda m: "-" if m.inter_node_bytes is None else f"{m.inter_node_bytes / 2**30:.2f}")]
          if batch.get("ranks_per_node") else []),
        ("max KV tokens/server", lambda m: f"{m.max_kv_tokens:,}"),
        ("  with copy per shard", lambda m: f"{max(m.kv_tokens_expanded):,}"),
        ("shards", lambda m: f"{m.num_shards:,}"),
        ("smallest shard", lambda m: f"{m.min_shard_tokens:,}"),
        ("plan time (ms)", lambda m: f"{m.plan_ms:.1f}"),
    ]
    for label, fmt in rows:
        table.add_row(label, *(fmt(m) for m in results.values()))
    text_console().print(table)


def plot_loads(results: dict[str, PlanMetrics], batch: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(len(results), 1, figsize=(10, 2.2 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, (name, m) in zip(axes[:, 0], results.items()):
        x = np.arange(m.num_servers)
        before = np.asarray(m.load_before)
        after = np.asarray(m.load_after)
        mean = after.mean()
        ax.bar(x, before / mean, color="#cccccc", label="home (local)")
        ax.bar(x, after / mean, color="#1f77b4", alpha=0.8, label=name)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_ylabel("load / mean")
        ax.set_title(f"{name}: max/mean {m.imbalance_after:.3f} (home {m.imbalance_before:.3f})", fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("server")
    fig.suptitle(f"{batch['dist']}, {batch['servers']} servers x {batch['tokens_per_server']} tokens", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
