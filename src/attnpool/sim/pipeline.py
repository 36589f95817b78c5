"""Pipeline parallelism in the simulator: a step's micro-batches through ``pp`` stages, its bubbles, and what
sharing attention servers across stages (DistCA's bubble reuse) could gain at most.

A micro-batch's time on one stage is its whole-model step time on the dp servers of one stage (the plan
and costs of ``simulate_config`` on gpus / pp GPUs) divided by pp: stages balanced, the output projection
counted (as attnpool.parallel.pipeline splits them), forward a third of it and backward two thirds. The
step is simulated operation by operation: every stage runs its schedule's fixed order (1F1B: pp - s - 1
forwards, then one forward and one backward alternately, then the remaining backwards; GPipe: all
forwards, then all backwards), each forward after the previous stage's forward of the same micro-batch,
each backward after the next stage's backward. Its bubble is the time the ranks wait.

Bubble reuse: a rank waiting for its neighbour serves CA-tasks of a stage that is running. DistCA's
scheme: every stage runs the same phase in each tick, and in a tick of the ramp where k of the pp stages
have work, their core attention is spread over all pp stage groups, so the tick costs its non-attention
part plus k / pp of its attention. Over the ramp k runs from 1 to pp - 1, which saves half of the ramp's
attention: about (pp - 1) a / 2 per step, a a micro-batch's core attention per stage (the mean;
``reuse_gain``). An upper bound on any reuse (``reuse_gain_bound``): the step cannot be shorter than the
same pipeline with no core attention on its critical path (every stage-time cut to its non-attention
part), nor than every rank's share of the step's work. Neither counts moving Q and KV between stage groups.

``pooled_step_s`` models the schedule attnpool builds for it (``pp_schedule: pooled``, :func:`pooled_makespan`):
lock-step GPipe ticks with each tick's attention pooled; ``pooled_gain`` is its gain over ``schedule``, which
also counts what lock-step costs (a tick lasts as long as its slowest stage's non-attention work).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from attnpool.errors import ConfigError
from attnpool.sim.simulate import SimConfig, simulate_config

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


def makespan(stage_times, pp: int, schedule: str = "1f1b") -> float:
    """The step time of micro-batches whose time on one stage (forward plus backward) is ``stage_times``."""
    t = np.asarray(stage_times, dtype=float)
    M = len(t)
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
                    ready = 0.0 if s == 0 else end["F"][s - 1, m]
                else:
                    ready = end["F"][s, m] if s == pp - 1 else end["B"][s + 1, m]
                if np.isnan(ready):
                    break  # waits for a neighbour's operation not yet scheduled
                clock[s] = max(clock[s], ready) + duration[kind][m]
                end[kind][s, m] = clock[s]
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"the {schedule} order deadlocks (pp={pp}, microbatches={M})")
    return float(clock.max())


def pooled_makespan(stage_times, attention_times, pp: int) -> float:
    """The step time of ``pp_schedule: pooled`` (attnpool.parallel.pooled_pipeline): GPipe's order in lock-step
    ticks, each tick's core attention (of the micro-batches of its busy stages; ``attention_times`` per stage,
    like ``stage_times``) spread evenly over all pp stage groups, its other work taking as long as the
    busiest stage's. Forward ticks take FORWARD_SHARE of each, backward ticks the rest."""
    t, a = np.asarray(stage_times, dtype=float), np.asarray(attention_times, dtype=float)
    M = len(t)
    total = 0.0
    for tick in range(M + pp - 1):
        busy = [tick - s for s in range(pp) if 0 <= tick - s < M]
        total += max(t[m] - a[m] for m in busy) + sum(a[m] for m in busy) / pp
    return total  # the forward ticks' FORWARD_SHARE and the backward ticks' rest add up to one of each


def pipeline_step(step_s, attention_s, pp: int, schedule: str = "1f1b") -> dict:
    """One pipelined step of micro-batches whose whole-model step times (``step_s``) and core attention
    times (``attention_s``) are given: its time, its bubble and the bound on what bubble reuse saves."""
    step_s, attention_s = np.asarray(step_s, dtype=float), np.asarray(attention_s, dtype=float)
    total = makespan(step_s / pp, pp, schedule)
    work = step_s.sum() / pp  # each rank's share: pp stages' work over pp ranks
    bound = max(makespan((step_s - attention_s) / pp, pp, schedule), work)
    pooled_ramp = (pp - 1) * float(np.mean(attention_s / pp)) / 2
    pooled = pooled_makespan(step_s / pp, attention_s / pp, pp)
    return {"step_s": total, "bubble_fraction": 1 - work / total, "reuse_gain": pooled_ramp / total,
            "reuse_gain_bound": 1 - bound / total, "attention_share": float(attention_s.sum() / step_s.sum()),
            "pooled_step_s": pooled, "pooled_gain": 1 - pooled / total}


def simulate_pipeline(config: SimConfig, pp: int, microbatches: int, steps: int = 4, schedule: str = "1f1b",
                      **kwargs) -> dict:
    """``config`` (its ``gpus`` all of the pipeline's) run as ``pp`` stages of gpus / pp GPUs each, ``steps``
    steps of ``microbatches`` micro-batches; per strategy the mean over steps of :func:`pipeline_step`."""
    if pp < 1 or config.gpus % (pp * config.tp):
        raise ConfigError("pp", pp, f"pp x tp must divide the {config.gpus} GPUs")
    if microbatches < 1:
        raise ConfigError("microbatches", microbatches, "must be at least 1")
    if schedule not in PIPELINE_SCHEDULES:
        raise ConfigError("schedule", schedule, f"the simulator models {', '.join(PIPELINE_SCHEDULES)}")
    stage = simulate_config(replace(config, gpus=config.gpus // pp, batches=steps * microbatches), **kwargs)
    out = {"label": f"{config.label()}/pp{pp}/mb{microbatches}", "pp": pp, "microbatches": microbatches,
           "schedule": schedule, "steps": steps, "stage_simulation": stage, "strategies": {}}
    for name, summary in stage["strategies"].items():
        per_step = [pipeline_step(summary["per_batch_step_s"][i:i + microbatches],
                                  summary["per_batch_attention_s"][i:i + microbatches], pp, schedule)
                    for i in range(0, steps * microbatches, microbatches)]
        out["strategies"][name] = {key: float(np.mean([p[key] for p in per_step])) for key in per_step[0]}
    baselines = [k for k in out["strategies"] if k == "wlb" or k.startswith("percp-cp")]
    if "cad" in out["strategies"] and baselines:
        best = min(baselines, key=lambda k: out["strategies"][k]["step_s"])
        out["wlb_ideal"] = best
        out["speedup"] = out["strategies"][best]["step_s"] / out["strategies"]["cad"]["step_s"]
    return out
