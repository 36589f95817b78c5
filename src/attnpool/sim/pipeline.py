"""Pipeline parallelism in the simulator: a step's micro-batches through ``pp`` stages, its bubbles, what any
bubble reuse could gain at most, and the step of ``pp_schedule: pooled`` (DistCA's bubble reuse as attnpool
builds it).

**1F1B and GPipe.** A micro-batch's whole-model step time on the dp servers of one stage (the plan and costs of
``simulate_config`` on gpus / pp GPUs) is split over the stages as attnpool.parallel.pipeline splits the model
(plan.stages.stage_layers: balanced by compute, the output projection counted, so the last stage holds fewer
layers): each stage its layers' share, the last the output projection too (:func:`stage_times`). Forward is a third
of it, backward two thirds. The step is simulated operation by operation: every stage runs its schedule's fixed
order (1F1B: pp - s - 1 forwards, then one forward and one backward alternately, then the remaining backwards;
GPipe: all forwards, then all backwards), each forward after the previous stage's forward of the same
micro-batch and the passing of its hidden states (:func:`transfer_seconds`), each backward after the next
stage's backward and the passing of its gradient. Its bubble is the time the ranks wait. An upper bound on
any reuse (``reuse_gain_bound``): the step cannot be shorter than the same pipeline with no core attention on
its critical path, nor than every rank's share of the step's work. ``reuse_gain`` is DistCA's idealized scheme
(half of the ramps' core attention saved), moving nothing.

**Pooled** (:func:`pooled_tick_steps`), as attnpool.parallel.pooled_pipeline runs it: GPipe's order in lock-step
ticks, stages split as 1F1B's, each layer slot's core attention planned by cad over every stage's ranks (the ranks
of idle stages, and of stages past their last layer, hold no tokens and serve) and its exchanges timed over all of
them, the hidden states passed between stages, and the last stage's output projection where it is busy, less what
its spare slots hide beside other stages' layers. What the plans move is what it costs: the exchanges are not
hidden (no ping-pong). Each tick also counts the work its plans serve away from home beside the least that
balance needs (plan.metrics.work_moved).

Not modelled: FSDP2's gathers and reductions over a stage's dp ranks (attnpool.sim.steptime counts them for a run
without pipelining). torch's 1F1B keeps a stage's weights gathered across its micro-batches' backwards, while the
pooled schedule gathers every layer again in every tick, so where dp spans slow links the simulator favours pooled.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from attnpool.errors import ConfigError
from attnpool.plan.api import plan_attention
from attnpool.plan.layout import linear_table
from attnpool.plan.metrics import work_moved
from attnpool.plan.stages import head_layers, pooled_table, slot_presence, stage_layers, tick_microbatch, ticks
from attnpool.sim.costs import SimCosts, load_sim_costs
from attnpool.sim.simulate import SimConfig, sample, simulate_config
from attnpool.sim.steptime import Cluster, StepModel

PIPELINE_SCHEDULES = ("1f1b", "gpipe")
FORWARD_SHARE = 1 / 3  # of a micro-batch's forward and backward time


def stage_order(stage: int, pp: int, microbatches: int, schedule: str = "1f1b") -> list[tuple[str, int]]:
    """The ("F" or "B", micro-batch) operations of one stage, in the order it runs them."""
    if schedule == "gpipe":
        return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    warmup = min(pp - stage - 1, microbatches)
    order = [("F", m) for m in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", m) for m in range(microbatches - warmup, microbatches)]


def makespan(stage_times, pp: int, schedule: str = "1f1b", transfer_s: float = 0.0) -> float:
    """The step time of micro-batches whose time on a stage (forward plus backward) is ``stage_times``: one per
    micro-batch (every stage alike), or a (pp, micro-batches) array. ``transfer_s``: what passing a micro-batch's
    hidden states (or their gradient) to the next stage adds before that stage can start on it."""
    t = np.asarray(stage_times, dtype=float)
    if t.ndim == 1:
        t = np.tile(t, (pp, 1))
    M = t.shape[1]
    duration = {"F": t * FORWARD_SHARE, "B": t * (1 - FORWARD_SHARE)}
    end = {"F": np.full((pp, M), np.nan), "B": np.full((pp, M), np.nan)}
    orders = [stage_order(s, pp, M, schedule) for s in range(pp)]
    clock, position = np.zeros(pp), [0] * pp
    remaining = 2 * pp * M
    while remaining:
        progressed = False
        for s in range(pp):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                if kind == "F":
                    ready = 0.0 if s == 0 else end["F"][s - 1, m] + transfer_s
                else:
                    ready = end["F"][s, m] if s == pp - 1 else end["B"][s + 1, m] + transfer_s
                if np.isnan(ready):
                    break  # waits for a neighbour's operation not yet scheduled
                clock[s] = max(clock[s], ready) + duration[kind][s, m]
                end[kind][s, m] = clock[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} order deadlocks (pp={pp}, microbatches={M})")
    return float(clock.max())


def stage_times(step_s, head_s, layers: list[int]) -> np.ndarray:
    """(stages, micro-batches) seconds of each micro-batch on each stage, from its whole-model step time on one
    stage's servers (``step_s``, its output projection's ``head_s`` included): a stage's layers' share of the rest,
    and the last stage the output projection too."""
    step_s, head_s = np.asarray(step_s, dtype=float), np.asarray(head_s, dtype=float)
    per_layer = (step_s - head_s) / sum(layers)
    out = np.outer(np.asarray(layers, dtype=float), per_layer)
    out[-1] += head_s
    return out


def pipeline_step(times: np.ndarray, attention_s, layers: list[int], schedule: str = "1f1b",
                  transfer_s: float = 0.0) -> dict:
    """One pipelined step: ``times`` (stage_times), ``attention_s`` each micro-batch's core attention over the
    whole model. Its time, its bubble, and a bound on what any bubble reuse saves."""
    pp = len(layers)
    attention_s = np.asarray(attention_s, dtype=float)
    total = makespan(times, pp, schedule, transfer_s)
    work = times.sum() / pp  # each rank's share: pp stages' work over pp ranks
    attention = np.outer(np.asarray(layers, dtype=float) / sum(layers), attention_s)
    bound = max(makespan(times - attention, pp, schedule, transfer_s), work)
    ramp = (pp - 1) * float(np.mean(attention_s / pp)) / 2
    return {"step_s": total, "bubble_fraction": 1 - work / total, "reuse_gain": ramp / total,
            "reuse_gain_bound": 1 - bound / total, "attention_share": float(attention_s.sum() / times.sum())}


def transfer_seconds(cfg, cluster: Cluster, costs: SimCosts, pp: int) -> float:
    """Passing one micro-batch's hidden states (bf16, each GPU its tokens' share) to the next stage: stages are the
    mesh's outermost dimension, so they share a node only when the whole pipeline fits in one."""
    if pp == 1:
        return 0.0
    link = costs.intra if pp * cluster.gpus <= cluster.gpus_per_node else costs.inter
    return link.latency + cluster.tokens_per_gpu * cfg.dim * 2 / link.bandwidth


@dataclass(frozen=True)
class PooledTimer:
    """What :func:`pooled_tick_steps` times a pooled tick with: the servers of every stage, the stages' layer counts
    (plan.stages.stage_layers, the output projection counted), its seconds and the seconds of one layer's linear
    parts on a busy server, and the hand-over of hidden states."""

    cfg: object
    cluster: Cluster
    costs: SimCosts
    recompute: str
    counts: tuple[int, ...]
    head_s: float
    layer_linear_s: float
    transfer_s: float

    def model(self, slots: int) -> StepModel:
        """``slots`` layer slots over every stage's servers, no output projection (added per tick, below)."""
        return StepModel(replace(self.cfg, n_layers=slots), self.cluster, self.costs, self.recompute, head=False)


def pooled_tick_steps(timer: PooledTimer, tables: list, eps: float) -> list[dict]:
    """Every tick of one ``pp_schedule: pooled`` step (attnpool.parallel.pooled_pipeline): for each set of layer slots
    whose stages with a layer there are the same (plan.stages.slot_presence), its layout over all stages' ranks
    (plan.stages.pooled_table) planned by cad as the runtime plans it and timed over every stage's servers (each
    slot's exchange spans them all and holds them in lock-step); the last stage's output projection where it is
    busy, less what its spare slots hide: it runs in parts between them, each beside another stage's layer where
    one has tokens in that slot in this tick, and exposed where none has (in the drain, the other stages are done);
    and the hidden states' passing where a later stage is busy."""
    pp = len(timer.counts)
    classes = Counter(slot_presence(timer.counts))
    models = {slots: timer.model(slots) for slots in set(classes.values())}  # (once per step, not per tick)
    shape = next(iter(models.values())).shape
    out = []
    for tick in range(ticks(len(tables), pp)):
        busy = [s for s in range(pp) if tick_microbatch(tick, s, len(tables)) is not None]
        step = exposed = moved = shifted = above_mean = 0.0
        hiding = 0  # the last stage's spare slots of this tick in which another stage runs a layer
        for present, slots in classes.items():
            table = pooled_table(tables, tick, pp, present)
            if table is None:  # no stage has a layer in these slots: nobody calls them
                continue
            if not present[-1]:
                hiding += slots
            plan = plan_attention(table, "cad", cost_model=timer.costs.attn_fwd_bwd,
                                  min_shard_tokens=timer.costs.min_shard_tokens, eps=eps, shape=shape)
            st = models[slots].plan_step(plan, overlap=False, name="pooled")
            step, exposed, moved = step + st.step, exposed + st.comm_exposed, moved + st.bytes_moved * slots
            work = work_moved(plan, timer.costs.attn_fwd_bwd)
            shifted, above_mean = shifted + work[0] * slots, above_mean + work[1] * slots
        if pp - 1 in busy:
            step += max(0.0, timer.head_s - hiding * timer.layer_linear_s)
        step += 2 * timer.transfer_s if max(busy) > 0 else 0.0
        out.append({"step_s": step, "bytes_moved": moved, "busy_stages": busy, "comm_exposed_s": exposed,
                    "work_moved": shifted, "work_above_mean": above_mean})
    return out


def simulate_pipeline(config: SimConfig, pp: int, microbatches: int, steps: int = 4, schedule: str = "1f1b", *,
                      costs: SimCosts | None = None, profile=None, doc_batches: list[list[int]] | None = None,
                      pooled: bool = True, progress=None, model_cfg=None) -> dict:
    """``config`` (its ``gpus`` all of the pipeline's) run as ``pp`` stages of gpus / pp GPUs each, ``steps``
    steps of ``microbatches`` micro-batches (``doc_batches``: their document lengths, each one stage's global
    batch; default: sampled). Per strategy of ``config``, the mean over steps of :func:`pipeline_step` under
    ``schedule``, its stages split as attnpool.parallel.pipeline splits them; with ``pooled`` (where cad is simulated
    and the model's layers are causal), ``pp_schedule: pooled``'s step (:func:`pooled_tick_steps`).
    ``model_cfg``: the model, where it is not ``config.model``'s preset."""
    if pp < 1 or config.gpus % (pp * config.tp):
        raise ConfigError("pp", pp, f"pp x tp must divide the {config.gpus} GPUs")
    if microbatches < 1:
        raise ConfigError("microbatches", microbatches, "must be at least 1")
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError("schedule", schedule, f"the simulator models {', '.join(PIPELINE_SCHEDULES)}")
    config.check(model_cfg)
    cfg = model_cfg or config.model_config()
    if costs is None:
        costs = load_sim_costs(cfg, config.model, profile)
    # FSDP's traffic is left out (the module's docstring)
    stage_config = replace(config, gpus=config.gpus // pp, batches=steps * microbatches, fsdp=False)
    if doc_batches is not None and len(doc_batches) != steps * microbatches:
        raise ConfigError("doc_batches", len(doc_batches), f"need steps x microbatches = {steps * microbatches}")
    stage_cluster = Cluster(stage_config.gpus, config.tp, config.gpus_per_node, config.tokens_per_gpu)
    if doc_batches is None:
        doc_batches = sample(stage_config, stage_cluster)
    stage = simulate_config(stage_config, costs, doc_batches=doc_batches, model_cfg=model_cfg)
    stage_model = StepModel(cfg, stage_cluster, costs, config.recompute)
    head_s = stage_cluster.tokens_per_server * (stage_model.tok_head_fwd + stage_model.tok_head_bwd)
    transfer_s = transfer_seconds(cfg, stage_cluster, costs, pp)
    layers = [len(r) for r in stage_layers(cfg.n_layers, pp, head_layers(cfg))]
    out = {"label": f"{config.label()}/pp{pp}/mb{microbatches}", "pp": pp, "microbatches": microbatches,
           "schedule": schedule, "steps": steps, "stage_layers": layers, "transfer_s": transfer_s,
           "stage_simulation": stage, "strategies": {}}
    for name, summary in stage["strategies"].items():
        per_step = []
        for i in range(0, steps * microbatches, microbatches):
            times = stage_times(summary["per_batch_step_s"][i:i + microbatches], head_s, layers)
            per_step.append(pipeline_step(times, summary["per_batch_attention_s"][i:i + microbatches], layers,
                                          schedule, transfer_s))
        out["strategies"][name] = {key: float(np.mean([p[key] for p in per_step])) for key in per_step[0]}
        out["strategies"][name]["per_step_s"] = [p["step_s"] for p in per_step]
    baselines = [k for k in out["strategies"] if k == "wlb" or k.startswith("percp-cp")]
    if "cad" in out["strategies"] and baselines:
        best = min(baselines, key=lambda k: out["strategies"][k]["step_s"])
        out["wlb_ideal"] = best
        out["speedup"] = out["strategies"][best]["step_s"] / out["strategies"]["cad"]["step_s"]
    if pooled and "cad" in config.strategies and pooled_problem_of(cfg) is None:
        out["pooled"] = simulate_pooled(config, cfg, costs, layers, doc_batches, microbatches, head_s, transfer_s,
                                        stage_cluster, progress)
        for name in ("cad", "cad-serial"):
            if name in out["strategies"]:
                out["strategies"][name]["pooled_gain"] = 1 - out["pooled"]["step_s"] / out["strategies"][name]["step_s"]
    return out


def pooled_problem_of(cfg) -> str | None:
    """Why the simulator cannot run ``pp_schedule: pooled`` for this model, or None (it pools causal attention
    only)."""
    if any(kind.window is not None for kind in cfg.layer_kinds()):
        return "the pooled schedule plans causal attention only"
    return None


def simulate_pooled(config: SimConfig, cfg, costs: SimCosts, layers: list[int], doc_batches, microbatches: int,
                    head_s: float, transfer_s: float, stage_cluster: Cluster, progress=None) -> dict:
    """``pp_schedule: pooled``'s steps over ``doc_batches`` (:func:`pooled_tick_steps`), their mean and per step;
    ``layers``: each stage's layers."""
    counts = tuple(layers)
    cluster = Cluster(config.gpus, config.tp, config.gpus_per_node, config.tokens_per_gpu)
    one_layer = StepModel(replace(cfg, n_layers=1), stage_cluster, costs, config.recompute, head=False)
    timer = PooledTimer(cfg, cluster, costs, config.recompute, counts, head_s,
                        stage_cluster.tokens_per_server * one_layer.linear_per_token_step(), transfer_s)
    dp, tokens = stage_cluster.servers, stage_cluster.tokens_per_server
    steps = []
    for i in range(0, len(doc_batches), microbatches):
        tables = [linear_table(lens, dp, tokens) for lens in doc_batches[i:i + microbatches]]
        tick_rows = pooled_tick_steps(timer, tables, config.eps)
        steps.append({"step_s": sum(t["step_s"] for t in tick_rows), "ticks": tick_rows,
                      **{key: sum(t[key] for t in tick_rows) for key in ("bytes_moved", "work_moved",
                                                                          "work_above_mean")}})
        if progress:
            progress(len(steps), len(doc_batches) // microbatches)
    return {"step_s": float(np.mean([s["step_s"] for s in steps])), "per_step_s": [s["step_s"] for s in steps],
            "bytes_moved": float(np.mean([s["bytes_moved"] for s in steps])), "stage_layers": list(counts),
            "steps": steps}
