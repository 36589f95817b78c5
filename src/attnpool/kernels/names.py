"""The core-attention backends' names, without torch: the training config and the command line name them
before anything imports torch."""

BACKENDS = ("reference", "flash", "fa4")
GPU_BACKENDS = ("flash", "fa4")  # the FlashAttention kernels: CUDA only, bf16
