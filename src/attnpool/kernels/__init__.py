"""Core attention backends behind one contract (see kernels.base).

    out, lse = attention(q, k, v, cu_q, cu_k, max_q, max_k)   # differentiable
    backend = get_backend("fa4", device)                       # explicit pair
    out, lse = backend.forward(q, k, v, cu_q, cu_k, max_q, max_k)
    dq, dk, dv = backend.backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k)
"""

from attnpool.kernels.names import BACKENDS, GPU_BACKENDS

__all__ = ["BACKENDS", "GPU_BACKENDS", "Backend", "attention", "auto_backend_name", "backend_named", "backend_problem",
           "get_backend",
           "resolve_backend_name", "serves_positions"]


def __getattr__(name: str):  # torch on first use: the backends' names load without it (attnpool.kernels.names)
    if name == "Backend":
        from attnpool.kernels.base import Backend

        return Backend
    if name in __all__:
        from attnpool.kernels import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'attnpool.kernels' has no attribute {name!r}")
