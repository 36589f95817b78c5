"""How much larger each server's expanded KV (one prefix per CA-task, as the kernel call needs it) is
than its unique KV (each served document's prefix once), under cad on 4 servers.

The runtime materialises K and V at the expanded size for each kernel call, and dK and dV at that
size in backward; a server with two shards of one document holds that prefix twice, unless the
shards continue each other (Plan.kernel_segments makes them one segment). Printed:
the expansion with one segment per CA-task, and with the kernel segments the runtime uses.

    PYTHONPATH=src python bench/kv_expansion.py
"""

from __future__ import annotations

from attnpool.data.lengths import SamplingOptions, sample_batches
from attnpool.plan import AttentionShape, linear_table, load_cost_model, plan_attention

CONFIGS = (("pretrain", 64 * 1024, 4.0), ("prolong", 128 * 1024, 1.0), ("prolong", 256 * 1024, 1.0))


def main(servers: int = 4, seeds: int = 3) -> None:
    cost_model = load_cost_model("table")
    print("| dist | tokens/server | seed | expanded / unique KV rows per server: one segment per task | "
          "with kernel_segments |")
    print("|---|---|---|---|---|")
    for dist, tokens, elongate in CONFIGS:
        for seed in range(seeds):
            lens = sample_batches(dist, servers * tokens, 1, seed, SamplingOptions(elongate=elongate))[0]
            plan = plan_attention(linear_table(lens, servers, tokens), "cad", cost_model=cost_model,
                                  min_shard_tokens=1024, shape=AttentionShape())
            x = plan.kv_transfers()
            unique = [x.length[x.server == r].sum() for r in range(servers)]
            per_task = [plan.task_end[plan.task_server == r].sum() / unique[r] for r in range(servers)]
            merged = [plan.kernel_segments(r)[2].sum() / unique[r] for r in range(servers)]
            print(f"| {dist} | {tokens // 1024}K | {seed} | {', '.join(f'{v:.3f}' for v in per_task)} | "
                  f"{', '.join(f'{v:.3f}' for v in merged)} |")


if __name__ == "__main__":
    main()
