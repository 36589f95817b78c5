"""Tensor and sequence parallelism on the Llama-family decoder, from PyTorch's DTensor plans.

The plan (as TorchTitan's for Llama): between layers each tp rank holds 1/tp of its dp rank's tokens
(sequence parallel: the residual stream and the norms); inside a layer the norm's output is gathered to
the whole sequence and the projections are split by heads (q, k, v column-parallel, o row-parallel)
and by the MLP's hidden units (gate, up column-parallel, down row-parallel), the row-parallel outputs
reduce-scattered back to sequence shards. So core attention receives the dp rank's whole sequence with
this rank's H/tp query heads and H_kv/tp KV heads, and runs the dp ranks' plan on them: the model does
not know. The embedding is vocab-parallel (row-parallel over the vocabulary, its output reduce-scattered
to sequence shards); the output projection's weight is split by vocabulary too, and the loss, which
multiplies the final norm's output by that weight in chunks (model.llama.chunked_cross_entropy), gets
the whole sequence and computes a vocab-parallel cross-entropy under ``loss_parallel()``, which the
training step enters.

Each tp rank holds every token's RoPE angles and labels (they are per token, cheap, and the same on
the tp ranks of a dp rank), and the recompute of keep_attention's linear parts runs whole per layer
part: its inputs (a sequence shard, the whole sequence's angles) are not split alike.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from attnpool.model import ModelConfig, Transformer

SEQUENCE = 0  # the model's activations are (tokens, ...): no batch dimension
HEADS = 1  # q, k and v are (tokens, heads, head_dim)


def tensor_parallel_problem(model_cfg: ModelConfig, tp: int) -> str | None:
    """Why ``model_cfg`` cannot be split over ``tp`` ranks, or None."""
    if tp == 1:
        return None
    for name in ("n_kv_heads", "n_heads", "ffn_dim"):
        value = getattr(model_cfg, name)
        if value % tp:
            what = "KV heads" if name == "n_kv_heads" else "query heads" if name == "n_heads" else "MLP hidden units"
            return f"tp={tp} must divide the model's {value} {what} ({name}); each tp rank takes an equal share"
    return None


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Shard ``model`` over ``tp_mesh`` in place (before FSDP2 wraps it). float8 linear layers (attnpool.parallel.float8)
    take the same plans, their inputs gathered in bf16 and cast after. Where a cast scales a tp rank's shard of a
    tensor rather than the whole, it rounds as the whole would, down to values far below the largest: the scales are
    powers of two (see apply_float8). (torchao's float8 plans, which cast before the all-gather, need float8
    collectives, which gloo lacks, so nothing here could check them.)"""
    root_plan = {}  # a pipeline stage may hold none of these (see attnpool.parallel.pipeline)
    if model.embed is not None:
        root_plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(SEQUENCE))
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel(sequence_dim=SEQUENCE)
    if model.lm_head is not None:  # tied, the embedding's weight is already split by vocabulary
        # Only its weight is used (by the chunked loss), split by vocabulary like this style's output.
        root_plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)
    if model.norm is not None:
        # The chunked loss takes the final norm's output: the whole sequence, not this rank's shard.
        parallelize_module(model.norm, tp_mesh, PrepareModuleOutput(output_layouts=Shard(SEQUENCE),
                                                                    desired_output_layouts=Replicate(),
                                                                    use_local_output=False))
    for layer in model.layers.values():
        parallelize_module(layer, tp_mesh, {**_optional_norms(layer),
            "attention_norm": SequenceParallel(sequence_dim=SEQUENCE),
            "attention": PrepareModuleInput(input_layouts=(Shard(SEQUENCE), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.q_proj": ColwiseParallel(),
            "attention.k_proj": ColwiseParallel(),
            "attention.v_proj": ColwiseParallel(),
            "attention.o_proj": RowwiseParallel(output_layouts=Shard(SEQUENCE)),
            "mlp_norm": SequenceParallel(sequence_dim=SEQUENCE),
            "mlp": PrepareModuleInput(input_layouts=(Shard(SEQUENCE),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(SEQUENCE)),
        })


def _optional_norms(layer) -> dict:
    """The plans of the norms some families add: q/k norms act on each head of this rank's share of the heads,
    (tokens, heads, head_dim) split by heads; the norms of attention's and the MLP's outputs on the sequence shard
    the row-parallel projections leave. Their weights are replicated, their gradients summed over the tp ranks;
    what they return is a plain tensor, as what they take (the block adds it to the residual, RoPE rotates it)."""
    plan = {}
    if layer.attention.q_norm is not None:
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=HEADS, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=HEADS, use_local_output=True)
    if layer.attention_out_norm is not None:
        plan["attention_out_norm"] = SequenceParallel(sequence_dim=SEQUENCE, use_local_output=True)
        plan["mlp_out_norm"] = SequenceParallel(sequence_dim=SEQUENCE, use_local_output=True)
    return plan
