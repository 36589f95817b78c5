"""Model FLOPs utilisation (MFU): what a step's model computes, over what its GPUs could in bf16.

A step's model FLOPs: 6 per matmul weight per token (forward and backward of the decoder layers' projections and
the output head) and core attention's, 4 x head_dim x heads per (query, key) pair forward and twice that backward,
over every document's causal pairs (in a sliding-window layer, its window's pairs: attnpool.kinds): 3 forwards, as
PaLM's and Megatron-LM's MFU count them. Recomputed work is not counted: neither activation checkpointing's nor the
FlashAttention kernels' own recompute of QK^T and the softmax in their backward (plan.cost's 2.5 forwards, which
prices the kernels' time, includes it), nor is sparse attention's saving: a step's MFU is the model's work, whatever
the run did to get it, so that runs compare. (Until 2026-11-29 attention counted 3.5 forwards, FlashAttention's
benchmarks' convention: earlier records' MFU is that much higher on their attention part.)
"""

from __future__ import annotations

import numpy as np
import torch

from attnpool.plan.cost import attention_flops
from attnpool.plan.documents import window_pairs
from attnpool.plan.stages import layer_weights

# Dense bf16 tensor-core peaks, TFLOP/s per GPU (the vendors' datasheets, half their figures with sparsity), by a part
# of the device's name; the longest name that matches wins ("H100 PCIe" or "H200 NVL" before "H100" or "H200").
BF16_DENSE_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.5, "H200 NVL": 835.5, "H100": 989.4, "H200": 989.4,
                          "GH200": 989.4, "A100": 312.0}
# Core attention's backward in model FLOPs: its four matmuls (dV, dP, dQ, dK), twice the forward's two.
MODEL_BACKWARD_FORWARDS = 2.0


def linear_weights(cfg) -> int:
    """Matmul weights of one decoder layer (QKV, O, the gated MLP)."""
    return sum(layer_weights(cfg))


def linear_flops_per_token(cfg) -> float:
    """Forward+backward FLOPs per token of the decoder layers' projections and the output head."""
    return 6.0 * (cfg.n_layers * linear_weights(cfg) + cfg.dim * cfg.vocab_size)


def step_flops(cfg, doc_lens) -> float:
    """The model's forward+backward FLOPs over documents of these lengths (every token one of them)."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    pairs = sum(float(np.sum(window_pairs(0 * lens, lens, kind.window))) for kind in cfg.layer_kinds())
    attention = float(attention_flops(pairs, cfg.n_heads, cfg.head_dim, "fwd")) * (1.0 + MODEL_BACKWARD_FORWARDS)
    return linear_flops_per_token(cfg) * float(lens.sum()) + attention


def bf16_peak_flops(device: torch.device) -> float | None:
    """FLOP/s of one GPU of ``device``'s kind in dense bf16; None on the CPU or for a GPU not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    known = [key for key in BF16_DENSE_PEAK_TFLOPS if key in name]
    return BF16_DENSE_PEAK_TFLOPS[max(known, key=len)] * 1e12 if known else None
