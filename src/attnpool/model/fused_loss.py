"""``loss_kernel``: how the LM head's loss (output projection, then cross-entropy over the vocabulary) runs,
applied from outside the model, as ``compile`` and activation checkpointing are.

- ``chunked`` (:func:`attnpool.model.llama.chunked_cross_entropy`): float32 logits a chunk of tokens at a
  time, each chunk's logits recomputed in backward. Plain PyTorch: runs everywhere, tensor parallelism's
  vocabulary-split head included, but the head's matmul runs three times (forward, recompute, backward)
  and the softmax's elementwise passes read and write float32 logits.
- ``liger``: Liger-Kernel's fused linear cross-entropy. Per chunk of tokens, the bf16 logits, a Triton
  kernel that computes the loss and writes the logits' gradient in their place, and at once the gradients
  of the hidden states and of the weight (accumulated in float32): the gradients are made in the forward,
  backward only scales them. On one H200 (Llama 3's head, 128K tokens): 640 ms against 1150 ms forward +
  backward, and less memory (bench/results/2026-11-26-h200-fa4.md). CUDA only; not with tensor
  parallelism (the head's weight is then a vocabulary-split DTensor).
- ``auto``: liger where it imports on a CUDA run with tp = 1, else chunked (attnpool.model.loss_kernels
  chooses; it holds no torch, for the config).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnpool.model.llama import IGNORE_INDEX, chunked_cross_entropy


def liger_cross_entropy(h: Tensor, weight: Tensor, labels: Tensor, softcap: float | None = None) -> Tensor:
    """Summed cross-entropy of ``h @ weight.T`` (soft-capped at ``softcap`` where given) against ``labels``
    (-100 ignored), as chunked_cross_entropy returns it, by Liger-Kernel's fused linear cross-entropy (weight
    gradient accumulated in float32; its soft-cap is the same tanh, in the kernel)."""
    if h.shape[0] == 0:  # (an empty shard: Liger sizes its chunks from the token count)
        return chunked_cross_entropy(h, weight, labels, softcap=softcap)
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    # Under autocast the final norm's output may be float32; the kernel takes the weight's dtype.
    return liger_fused_linear_cross_entropy(h.to(weight.dtype), weight, labels, ignore_index=IGNORE_INDEX,
                                            reduction="sum", accum_dtype=torch.float32, softcap=softcap)


LOSS_FUNCTIONS = {"chunked": chunked_cross_entropy, "liger": liger_cross_entropy}


def use_loss_kernel(model: torch.nn.Module, kernel: str) -> None:
    """Make ``model`` (attnpool's Transformer, a pipeline stage or an hf: model) compute its loss with
    ``kernel`` (a resolved name: liger or chunked)."""
    model.cross_entropy = LOSS_FUNCTIONS[kernel]
