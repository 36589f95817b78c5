"""Parallelisms applied to the model from outside, one module each (as TorchTitan's ``parallelize``):
``mesh`` (the ("dp", "tp") DeviceMesh and each rank's place in it), ``tensor`` (tensor and sequence
parallelism from PyTorch's DTensor plans)."""

from attnpool.parallel.mesh import ParallelDims, RankMesh, build_rank_mesh
from attnpool.parallel.tensor import apply_tensor_parallel, tensor_parallel_problem

__all__ = ["ParallelDims", "RankMesh", "apply_tensor_parallel", "build_rank_mesh", "tensor_parallel_problem"]
