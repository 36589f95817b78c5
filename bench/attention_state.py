"""What core attention keeps for backward per layer, on the worst rank, under `local` and `cad` (planner only).

From each rank's DispatchLayout (the runtime's own index maps) for sampled batches on 4 ranks, Llama-3-8B
attention shapes, bf16: the server's Q, its unique K and V, the output rows it returned to other ranks, its
LSE, and the rank's own output (which the layer after attention keeps anyway). Also what two earlier designs
kept: the caller's q, k, v beside the received rows (before c4f4459), and a whole copy of the server's output
(before 6a1bafb). Activation memory only: the GPU's peak also holds transients, weights and optimizer state.

    PYTHONPATH=src python bench/attention_state.py
"""

from __future__ import annotations

import numpy as np
import torch

from attnpool.data.lengths import SamplingOptions, sample_batches
from attnpool.plan import AttentionShape, linear_table, load_cost_model, plan_attention
from attnpool.runtime.dispatch import DispatchLayout

H_Q, H_KV, HEAD_DIM, BYTES = 32, 8, 128, 2  # Llama-3-8B, bf16
Q_ROW, KV_ROW, LSE_ROW = H_Q * HEAD_DIM * BYTES, 2 * H_KV * HEAD_DIM * BYTES, H_Q * 4
DESIGNS = ("caller q,k,v + received", "server buffers + whole output copy", "now")
CONFIGS = (("pretrain", 64 * 1024, 4.0), ("prolong", 128 * 1024, 1.0), ("prolong", 256 * 1024, 1.0))


def state_bytes(L: DispatchLayout) -> dict[str, int]:
    """Bytes kept per layer by this rank under each design."""
    T, S, U = L.num_tokens, L.num_server_q, L.num_unique_kv
    q_recv, kv_recv = sum(L.q_recv_splits), sum(L.kv_recv_splits)  # a received Q row's output goes back
    output = T * Q_ROW
    return dict(zip(DESIGNS, (
        T * (Q_ROW + KV_ROW) + q_recv * Q_ROW + kv_recv * KV_ROW + S * (Q_ROW + LSE_ROW) + output,
        S * Q_ROW + U * KV_ROW + S * (Q_ROW + LSE_ROW) + output,
        S * Q_ROW + U * KV_ROW + q_recv * Q_ROW + S * LSE_ROW + output,
    )))


def main(ranks: int = 4, batches: int = 12) -> None:
    cost_model = load_cost_model("table")
    print("| dist | tokens/rank | strategy | " + " | ".join(f"{d} (GiB)" for d in DESIGNS) + " |")
    print("|---|---|---|" + "---|" * len(DESIGNS))
    for dist, tokens, elongate in CONFIGS:
        lens_all = sample_batches(dist, ranks * tokens, batches, 0, SamplingOptions(elongate=elongate))
        for strategy in ("local", "cad"):
            worst = {d: [] for d in DESIGNS}
            for lens in lens_all:
                plan = plan_attention(linear_table(lens, ranks, tokens), strategy, cost_model=cost_model,
                                      min_shard_tokens=1024, shape=AttentionShape())
                per_rank = [state_bytes(DispatchLayout.build(plan, r, torch.device("cpu"))) for r in range(ranks)]
                for d in DESIGNS:
                    worst[d].append(max(b[d] for b in per_rank) / 2**30)
            print(f"| {dist} | {tokens // 1024}K | {strategy} | "
                  + " | ".join(f"{np.median(worst[d]):.2f}" for d in DESIGNS) + " |")


if __name__ == "__main__":
    main()
