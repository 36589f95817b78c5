"""The ranks' layout: data parallel ("dp") by tensor parallel ("tp"), tp ranks neighbours.

Rank r is dp rank ``r // tp`` and tp rank ``r % tp``, so a tensor-parallel group is ``tp`` consecutive
ranks: one node when tp divides the GPUs per node, as torchrun numbers them. A dp rank (a whole tp group)
holds ``tokens_per_rank`` tokens of the global batch; its tp ranks hold the same tokens, split by
sequence between layers and by heads inside them (attnpool.parallel.tensor). Core attention's plan is
made over the dp ranks; tp rank i runs it on its own heads, exchanging with the dp ranks of tp index i
only, over ``RankMesh.attention_group``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from attnpool.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @classmethod
    def of(cls, world: int, tp: int) -> "ParallelDims":
        """The layout of ``world`` ranks with tensor parallelism ``tp``; refused unless tp divides world."""
        if tp < 1:
            raise ConfigError("tp", tp, "must be at least 1")
        if world % tp:
            raise ConfigError("tp", tp, f"must divide the number of ranks ({world}): world = dp x tp")
        return cls(world // tp, tp)


@dataclass(frozen=True, eq=False)
class RankMesh:
    """One rank's view of the mesh."""

    dims: ParallelDims
    mesh: DeviceMesh  # ("dp", "tp")
    dp_rank: int
    tp_rank: int
    attention_group: object  # the dp ranks of this tp index: core attention's plan runs over them

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    def new_attention_group(self):
        """Another communicator over this rank's dp ranks (a collective: every rank calls it together)."""
        groups = [dist.new_group([d * self.dims.tp + t for d in range(self.dims.dp)]) for t in range(self.dims.tp)]
        return groups[self.tp_rank]


def build_rank_mesh(dims: ParallelDims, device_type: str) -> RankMesh:
    """The ("dp", "tp") DeviceMesh over the initialised default group (a collective)."""
    mesh = init_device_mesh(device_type, (dims.dp, dims.tp), mesh_dim_names=("dp", "tp"))
    if dims.dp > 1 and dims.tp > 1:
        # A reduction over parameters sharded on both dims (the gradient norm) then takes one collective
        # over all ranks instead of one per dim (PyTorch's DeviceMesh has no public name for this yet).
        mesh[("dp", "tp")]._flatten(mesh_dim_name="dp_tp")
    rank = dist.get_rank()
    return RankMesh(dims, mesh, rank // dims.tp, rank % dims.tp, mesh["dp"].get_group())
