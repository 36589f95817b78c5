"""The ranks' layout: pipeline stages ("pp") by data parallel ("dp") by tensor parallel ("tp"), tp innermost.

Rank r is tp rank ``r % tp``, dp rank ``(r // tp) % dp`` and pipeline rank ``r // (dp * tp)``: a
tensor-parallel group is ``tp`` consecutive ranks (one node when tp divides the GPUs per node, as
torchrun numbers them). A dp rank holds ``tokens_per_rank`` tokens of each micro-batch; its tp ranks hold
the same tokens, split by sequence between layers and by heads inside them (attnpool.parallel.tensor);
its pipeline ranks run its layers in stages (attnpool.parallel.pipeline). Core attention's plan is made
over the dp ranks; each (pipeline rank, tp rank) runs it with the dp ranks of the same indices only,
over ``RankMesh.attention_group``.

That group is a communicator of its own, not the dp mesh's that FSDP2 gathers and reduces over. NCCL runs one
communicator's operations one after another, whatever streams they are issued on (a trace shows it), so on a
shared one each layer's exchange in backward waited for the gradient reduction and the gather FSDP had issued
before it: a hundred milliseconds a layer at 5 GiB/s for the 8B's layers
(``bench/results/2026-11-30-h200x2-attention-communicator.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _set_pg_timeout

from attnpool.errors import ConfigError


@dataclass(frozen=True)
class ParallelDims:
    dp: int
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @classmethod
    def of(cls, world: int, tp: int = 1, pp: int = 1) -> "ParallelDims":
        """The layout of ``world`` ranks with tensor parallelism ``tp`` and ``pp`` pipeline stages; refused
        unless tp x pp divides world."""
        for name, value in (("tp", tp), ("pp", pp)):
            if value < 1:
                raise ConfigError(name, value, "must be at least 1")
        if world % (tp * pp):
            field, value = ("tp", tp) if pp == 1 else ("pp", pp)
            raise ConfigError(field, value, f"tp x pp = {tp * pp} must divide the number of ranks ({world}): "
                                            "ranks = pp x dp x tp")
        return cls(world // (tp * pp), tp, pp)


@dataclass(frozen=True, eq=False)
class RankMesh:
    """One rank's view of the mesh."""

    dims: ParallelDims
    mesh: DeviceMesh  # ("pp", "dp", "tp")
    pp_rank: int
    dp_rank: int
    tp_rank: int
    attention_group: object  # the dp ranks of this pipeline and tp index, a communicator of core attention's own
    # The collective timeout of the groups made for this mesh (the run's collective_timeout_s; None: torch's default
    # of 30 minutes on gloo, 10 on NCCL, so that a stalled peer would hold every rank in such a group that long)
    timeout: timedelta | None = None

    @property
    def dp_mesh(self) -> DeviceMesh:
        return self.mesh["dp"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.mesh["tp"]

    @property
    def pp_group(self):
        return self.mesh["pp"].get_group()

    def new_attention_group(self):
        """Another communicator over this rank's dp ranks (a collective: every rank calls it together)."""
        return _new_dp_group(self.dims, self.pp_rank, self.tp_rank, self.timeout)

    def pp_peers(self) -> list[int]:
        """The global ranks of this rank's dp and tp index on every pipeline stage, in stage order."""
        d = self.dims
        return [(p * d.dp + self.dp_rank) * d.tp + self.tp_rank for p in range(d.pp)]

    def tied_embedding_group(self):
        """A communicator of this rank and its peer of the same dp and tp index on the other end of the pipeline
        (first and last stage), for a tied embedding's gradients; None on the ranks between. A collective: every
        rank calls it."""
        d = self.dims
        mine = None
        for i in range(d.dp):
            for t in range(d.tp):
                group = dist.new_group([i * d.tp + t, ((d.pp - 1) * d.dp + i) * d.tp + t], timeout=self.timeout)
                if (i, t) == (self.dp_rank, self.tp_rank) and self.pp_rank in (0, d.pp - 1):
                    mine = group
        return mine

    def pooled_attention_group(self):
        """A communicator over every stage's dp ranks of this tp index, in (stage, dp rank) order: core attention
        pooled across pipeline stages (attnpool.parallel.pooled_pipeline). A collective: every rank calls it."""
        d = self.dims
        mine = None
        for t in range(d.tp):
            group = dist.new_group([(p * d.dp + i) * d.tp + t for p in range(d.pp) for i in range(d.dp)],
                                   timeout=self.timeout)
            if t == self.tp_rank:
                mine = group
        return mine


def _new_dp_group(dims: ParallelDims, pp_rank: int, tp_rank: int, timeout: timedelta | None):
    """A new communicator over the dp ranks of each (pipeline rank, tp rank); this rank's. A collective: every rank
    creates every group, in the same order."""
    mine = None
    for p in range(dims.pp):
        for t in range(dims.tp):
            group = dist.new_group([(p * dims.dp + i) * dims.tp + t for i in range(dims.dp)], timeout=timeout)
            if (p, t) == (pp_rank, tp_rank):
                mine = group
    return mine


def build_rank_mesh(dims: ParallelDims, device_type: str, timeout: timedelta | None = None) -> RankMesh:
    """The ("pp", "dp", "tp") DeviceMesh over the initialised default group, and core attention's own communicator
    (a collective). ``timeout``: the collective timeout of the communicators made here (the run's)."""
    mesh = init_device_mesh(device_type, (dims.pp, dims.dp, dims.tp), mesh_dim_names=("pp", "dp", "tp"))
    groups = mesh.get_all_groups()
    if dims.dp > 1 and dims.tp > 1:
        # A reduction over parameters sharded on both dims (the gradient norm) then takes one collective
        # over all of a stage's ranks instead of one per dim (DeviceMesh has no public name for this yet).
        groups.append(mesh[("dp", "tp")]._flatten(mesh_dim_name="dp_tp").get_group())
    if timeout is not None:
        # DeviceMesh makes its sub-groups with torch's default timeout (10 minutes on NCCL, 30 on gloo) and takes
        # none; c10d's setter is what TorchTitan uses for the same.
        for group in groups:
            _set_pg_timeout(timeout, group)
    rank = dist.get_rank()
    pp_rank, dp_rank, tp_rank = rank // (dims.dp * dims.tp), (rank // dims.tp) % dims.dp, rank % dims.tp
    # (one dp rank has no peer to exchange with: the dp mesh's group serves, and no communicator is made)
    attention_group = _new_dp_group(dims, pp_rank, tp_rank, timeout) if dims.dp > 1 else mesh["dp"].get_group()
    return RankMesh(dims, mesh, pp_rank, dp_rank, tp_rank, attention_group, timeout)
