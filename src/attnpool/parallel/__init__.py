"""Parallelisms and schedules applied to the model from outside, one module each (as TorchTitan's ``parallelize``):
``mesh`` (the ("pp", "dp", "tp") DeviceMesh and each rank's place in it), ``tensor`` (tensor and sequence
parallelism from PyTorch's DTensor plans), ``checkpointing`` (activation checkpointing), ``compile``,
``parallelize`` (all of them and FSDP2, in one order), ``pingpong`` (nano-batches interleaved layer by layer),
``pipeline`` and ``pooled_pipeline`` (pipeline stages and their schedules)."""

from attnpool.parallel.mesh import ParallelDims, RankMesh, build_rank_mesh
from attnpool.parallel.parallelize import parallelize
from attnpool.parallel.tensor import apply_tensor_parallel, tensor_parallel_problem

__all__ = ["ParallelDims", "RankMesh", "apply_tensor_parallel", "build_rank_mesh", "parallelize",
           "tensor_parallel_problem"]
