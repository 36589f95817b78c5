"""What a pipeline's stages hold and when, pure arithmetic shared by the runtime (attnpool.parallel.pipeline,
attnpool.parallel.pooled_pipeline), the memory model and the simulator (attnpool.sim.pipeline): the schedules'
names, each stage's layers (balanced by compute, the output projection counted), and the pooled schedule's
ticks and their layouts over every stage's ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from attnpool.plan.documents import DocPiece, PieceTable

if TYPE_CHECKING:  # (planning imports nothing of the model's: a config's sizes are all it reads)
    from attnpool.model.config import ModelConfig

POOLED = "pooled"
# pp_schedule auto: 1f1b or pooled, as the simulator predicts for the run's batches (train.schedule_choice)
AUTO_SCHEDULE = "auto"

# name -> (torch's name for the schedule, stages per pipeline rank)
SCHEDULES = {
    "1f1b": ("1F1B", 1),
    "gpipe": ("GPipe", 1),
    "interleaved-1f1b": ("Interleaved1F1B", 2),
}
# torch's zero-bubble schedules split each stage's backward into input and weight gradients; with this
# model (its core attention's autograd functions, FSDP2) they gave losses 2.8e-3 off after three steps
# on CPU where every other schedule agrees with one process to 1e-7.
REFUSED_SCHEDULES = ("interleaved-zero-bubble", "zbv-zero-bubble", "dualpipev")


def head_layers(cfg: ModelConfig) -> float:
    """The output projection and loss's compute in layers: their weights over a layer's matrix weights."""
    layer = cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) + 3 * cfg.dim * cfg.ffn_dim
    return cfg.dim * cfg.vocab_size / layer


def stage_layers(n_layers: int, stages: int, head: float) -> list[range]:
    """Contiguous layer ranges of ``stages`` stages, at least one layer each, the last stage counting
    ``head`` layers more: the last gets about (n_layers + head) / stages - head, the others share the rest
    evenly (earlier stages one more where it does not divide)."""
    per_stage = (n_layers + head) / stages
    last = min(max(1, round(per_stage - head)), n_layers - (stages - 1))
    base, extra = divmod(n_layers - last, stages - 1) if stages > 1 else (0, 0)
    sizes = [base + (1 if i < extra else 0) for i in range(stages - 1)] + [last]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def rank_stages(schedule: str, pp: int, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds under ``schedule`` (looped: r, r + pp, ...)."""
    return [pp_rank + i * pp for i in range(stages_per_rank(schedule))]


def stages_per_rank(schedule: str) -> int:
    return 1 if schedule in (POOLED, AUTO_SCHEDULE) else SCHEDULES[schedule][1]  # (auto: 1f1b or pooled, one each)


def schedule_names() -> tuple[str, ...]:
    return (*SCHEDULES, POOLED, AUTO_SCHEDULE)


def schedule_stage_layers(cfg: ModelConfig, schedule: str, pp: int) -> list[range]:
    """Every stage's layers under ``schedule``. Pooled stages run layer j together, so they hold equal
    numbers (the last one's head is not counted)."""
    return stage_layers(cfg.n_layers, pp * stages_per_rank(schedule), 0.0 if schedule == POOLED else head_layers(cfg))


def ticks(microbatches: int, stages: int) -> int:
    return microbatches + stages - 1


def tick_microbatch(tick: int, stage: int, microbatches: int) -> int | None:
    """The micro-batch stage ``stage`` runs in tick ``tick``, or None where it is idle."""
    m = tick - stage
    return m if 0 <= m < microbatches else None


def pooled_table(tables: Sequence[PieceTable], tick: int, stages: int) -> PieceTable:
    """Tick ``tick``'s layout over ``stages`` x dp ranks (pooled rank s * dp + d): the dp ranks of stage s
    hold micro-batch ``tick - s``'s pieces as ``tables[tick - s]`` lays them out (the same buffer order, so
    each rank's own tokens are where its stage expects them), the ranks of idle stages nothing. Documents
    are renumbered per micro-batch: two micro-batches' document 3 are different documents."""
    dp = tables[0].num_ranks
    stride = 1 + max(int(t.doc_ids.max()) if t.num_docs else 0 for t in tables)
    per_rank: list[list[DocPiece]] = [[] for _ in range(stages * dp)]
    for s in range(stages):
        m = tick_microbatch(tick, s, len(tables))
        if m is None:
            continue
        t = tables[m]
        ids, lens = t.doc_ids[t.doc], t.doc_len[t.doc]
        for i in np.lexsort((t.offset, t.rank)).tolist():
            per_rank[s * dp + int(t.rank[i])].append(
                DocPiece(m * stride + int(ids[i]), int(lens[i]), int(t.start[i]), int(t.length[i])))
    return PieceTable.from_pieces(per_rank)
