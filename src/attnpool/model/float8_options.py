"""The ``float8`` settings' names and checks (no torch: the config reads them); the conversion itself is
attnpool.parallel.float8."""

from __future__ import annotations

import importlib.util

# torchao's recipes: one scale per tensor; one per row; one per row with the weight gradient's matmul left in bf16
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
MIN_CAPABILITY = (8, 9)
INSTALL_HINT = "pip install 'attnpool[float8]' (torchao)"


def float8_problem(device_type: str, capability: tuple[int, int] | None = None) -> str | None:
    """Why float8 training cannot run here, or None: it needs torchao and a CUDA GPU of compute capability 8.9+
    (``capability`` None: the GPU not known yet, asked again on the ranks)."""
    if device_type != "cuda":
        return f"float8 matmuls run on CUDA GPUs of compute capability 8.9 or newer, and this run is on {device_type}"
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        return (f"float8 matmuls need compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ada, "
                f"Hopper); this GPU is {capability[0]}.{capability[1]}")
    if importlib.util.find_spec("torchao") is None:
        return f"torchao is not installed: {INSTALL_HINT}"
    return None
