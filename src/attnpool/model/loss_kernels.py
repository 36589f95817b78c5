"""``loss_kernel``: the names of the LM head's loss kernels, and which one a run gets. No torch here (the config
reads the names); the kernels themselves are in attnpool.model.fused_loss.

- ``chunked``: float32 logits a chunk of tokens at a time, recomputed in backward; plain PyTorch, runs everywhere.
- ``liger``: Liger-Kernel's fused linear cross-entropy (CUDA only, tp = 1).
- ``auto``: liger where it imports on a CUDA run with tp = 1, else chunked.
"""

from __future__ import annotations

import importlib.util

from attnpool.errors import ConfigError

LOSS_KERNELS = ("auto", "liger", "chunked")


def liger_problem(device_type: str, tp: int) -> str | None:
    """Why Liger's fused loss cannot run here, or None."""
    if device_type != "cuda":
        return f"Liger-Kernel's Triton kernels run on CUDA GPUs, and this run is on {device_type}"
    if tp > 1:
        return f"with tensor parallelism (tp={tp}) the head's weight is split by vocabulary; use chunked"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel is not installed (pip install 'attnpool[hopper]', or pip install liger-kernel)"
    return None


def resolve_loss_kernel(name: str, device_type: str, tp: int = 1) -> str:
    """``liger`` or ``chunked`` for the configured ``loss_kernel``; a ConfigError naming loss_kernel where
    ``liger`` is asked for and cannot run."""
    if name not in LOSS_KERNELS:
        raise ConfigError("loss_kernel", name, f"choose one of {', '.join(LOSS_KERNELS)}")
    problem = liger_problem(device_type, tp)
    if name == "liger" and problem is not None:
        raise ConfigError("loss_kernel", name, problem)
    if name == "auto":
        return "chunked" if problem is not None else "liger"
    return name
