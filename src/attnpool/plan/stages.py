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


def layer_weights(cfg: ModelConfig) -> tuple[int, int]:
    """A decoder layer's matrix weights before core attention (the Q/K/V projections) and after it (the output
    projection and the gated MLP): what its linear compute per token is proportional to."""
    before = cfg.dim * cfg.head_dim * (cfg.n_heads + 2 * cfg.n_kv_heads)
    return before, cfg.n_heads * cfg.head_dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim


def head_layers(cfg: ModelConfig) -> float:
    """The output projection and loss's compute in layers: their weights over a layer's matrix weights."""
    return cfg.dim * cfg.vocab_size / sum(layer_weights(cfg))


def linear_share_before_attention(cfg: ModelConfig) -> float:
    """A layer's linear compute before core attention (the Q/K/V projections) as a share of all of it."""
    before, after = layer_weights(cfg)
    return before / (before + after)


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
    """Every stage's layers under ``schedule``, balanced with the output projection counted (the pooled
    schedule's too: a stage with fewer layers than the first serves the layer slots it has none for)."""
    return stage_layers(cfg.n_layers, pp * stages_per_rank(schedule), head_layers(cfg))


def pooled_slots(cfg: ModelConfig, pp: int) -> int:
    """Layer slots of a pooled tick: the most layers a stage holds (the first stage's)."""
    return max(len(r) for r in schedule_stage_layers(cfg, POOLED, pp))


def ticks(microbatches: int, stages: int) -> int:
    return microbatches + stages - 1


def tick_microbatch(tick: int, stage: int, microbatches: int) -> int | None:
    """The micro-batch stage ``stage`` runs in tick ``tick``, or None where it is idle."""
    m = tick - stage
    return m if 0 <= m < microbatches else None


def slot_presence(stage_layer_counts: Sequence[int]) -> list[tuple[bool, ...]]:
    """Per layer slot of a pooled tick (as many as the most layers a stage holds): which stages have a layer there;
    the others serve that slot with no tokens of their own."""
    return [tuple(n > j for n in stage_layer_counts) for j in range(max(stage_layer_counts))]


def pooled_table(tables: Sequence[PieceTable], tick: int, stages: int,
                 present: Sequence[bool] | None = None) -> PieceTable | None:
    """Tick ``tick``'s layout over ``stages`` x dp ranks (pooled rank s * dp + d): the dp ranks of stage s
    hold micro-batch ``tick - s``'s pieces as ``tables[tick - s]`` lays them out (the same buffer order, so
    each rank's own tokens are where its stage expects them), the ranks of idle stages, and of stages not
    ``present`` (a layer slot past their last layer: slot_presence), nothing; None where no stage holds any.
    Documents are renumbered per micro-batch: two micro-batches' document 3 are different documents."""
    dp = tables[0].num_ranks
    stride = 1 + max(int(t.doc_ids.max()) if t.num_docs else 0 for t in tables)
    per_rank: list[list[DocPiece]] = [[] for _ in range(stages * dp)]
    for s in range(stages):
        m = tick_microbatch(tick, s, len(tables))
        if m is None or (present is not None and not present[s]):
            continue
        t = tables[m]
        ids, lens = t.doc_ids[t.doc], t.doc_len[t.doc]
        for i in np.lexsort((t.offset, t.rank)).tolist():
            per_rank[s * dp + int(t.rank[i])].append(
                DocPiece(m * stride + int(ids[i]), int(lens[i]), int(t.start[i]), int(t.length[i])))
    return PieceTable.from_pieces(per_rank) if any(per_rank) else None
