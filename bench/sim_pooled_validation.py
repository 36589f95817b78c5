#!/usr/bin/env python3
"""The simulator's pipeline schedules against their measured steps, and what ``pp_schedule: auto`` would choose.

For every configuration of the results file (each schedule's ``e2e.json`` of ``bash bench/gpu_e2e.sh pooled-pp4``
and ``pooled-pp2dp2``, as 2026-11-28-h200x4-pooled-1f1b-split.json holds them, both schedules of a configuration
from one device call): the benchmark's micro-batches are regenerated (same synthetic source, seed and stream as
``attnpool bench``), attnpool.sim.pipeline simulates each measured step under 1F1B and under the pooled schedule,
and the totals over the measured steps are compared. ``auto`` is asked as a run asks it
(train.schedule_choice.choose_schedule, on the run's first micro-batches), and its choice's measured step is
compared with 1F1B's; where the file holds a run of ``auto`` itself, its choice and step are shown too. Where the
pooled run has its ``--ablation`` (one-element messages), the step it saved, the exchanges' measured cost, is set
beside the simulator's exposed exchange time.

    PYTHONPATH=src python3 bench/sim_pooled_validation.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys


from attnpool.bench.record import write_record
from attnpool.data import DocumentStream, make_source
from attnpool.sim.pipeline import simulate_pipeline
from attnpool.sim.simulate import SimConfig
from attnpool.train.config import TrainConfig
from attnpool.train.memory import Calibration, estimate
from attnpool.train.memory_check import run_memory_inputs
from attnpool.train.memory_fit import Capacity
from attnpool.train.data_source import build_source
from attnpool.train.schedule_choice import AUTO_POOLED_GAIN, choose_schedule
from attnpool.train.spec import resolve_run_spec

# The pooled schedule as it is now: stages split as 1F1B's (a stage past its last layer serves), the loss in sized
# parts. Its first form, every stage holding the same layers: 2026-11-28-h200x4-pooled-pipeline.json, checked by
# this file as of commit 4f1600e.
MEASURED = "bench/results/2026-11-28-h200x4-pooled-1f1b-split.json"
ABLATED = "cad (1-element messages)"
GPUS = 4
TARGET = 0.10  # the simulator and the memory model within 10% of every run (issue 44)
H200 = Capacity(143771 * 2**20, "NVIDIA H200")


def bench_microbatches(dist: str, tokens: int, dp: int, count: int) -> list[list[int]]:
    """The first ``count`` micro-batches `attnpool bench` draws for a pipelined run: ``dp`` ranks of ``tokens``."""
    options = {"elongate": max(1.0, tokens * dp / 65536)} if dist == "pretrain" else {}
    source = make_source("synthetic", dist=dist, vocab_size=128256, seed=0, options=options)
    stream = DocumentStream(source, dp, tokens, 0)
    return [stream.next_batch().doc_lens.tolist() for _ in range(count)]


def bench_config(dist: str, tokens: int, layers: int, pp: int, microbatches: int, steps: int,
                 schedule: str) -> TrainConfig:
    """The benchmark's run as `attnpool bench` configures it (attnpool.bench.e2e.run_one), under ``schedule``."""
    elongate = {"elongate": max(1.0, tokens * (GPUS // pp) / 65536)} if dist == "pretrain" else {}
    return TrainConfig(model="llama3-8b", model_args={"n_layers": layers}, data="synthetic",
                       data_args={"dist": dist, "options": elongate}, tokens_per_rank=tokens, pp=pp,
                       microbatches=microbatches, pp_schedule=schedule, steps=steps, seed=0, attention="cad",
                       activation_checkpointing="keep_attention", precision="bf16", attention_backend="flash",
                       device="cuda", out=os.devnull)


def auto_choice(*run):
    """What ``pp_schedule: auto`` chooses for the benchmark's run, as a rank of it would."""
    config = bench_config(*run, "auto")
    spec = resolve_run_spec(config, GPUS, None, "cuda")
    return choose_schedule(spec, build_source(config, spec.model))


def predicted_peak_gib(*run) -> float:
    """The memory model's allocated peak of the run's busiest rank, at this commit (as `attnpool bench` reports it)."""
    config = bench_config(*run)
    spec = resolve_run_spec(config, GPUS, None, "cuda")
    calibration = Calibration.load()
    x = run_memory_inputs(spec, build_source(config, spec.model), H200, calibration)
    return estimate(x, calibration).allocated_bytes / 2**30


def runs_by_config(path: str) -> dict:
    """(dist, tokens, layers, pp, microbatches) -> {schedule: its record}, with the run's warm-up and step counts
    (the first run of each schedule in the file); "auto": a run of ``pp_schedule: auto``; "ablation": (the pooled
    run's ablation, the pooled run of the same call)."""
    out: dict = {}
    for run in json.load(open(path))["runs"]:
        meta = run["meta"]
        layers = int(meta["model"].split(" x ")[1].split()[0])
        plain = {(r["dist"], r["tokens_per_gpu"]): r for r in run["records"] if r["strategy"] == "cad"}
        for r in run["records"]:
            key = (r["dist"], r["tokens_per_gpu"], layers, r["pp"], r["microbatches"])
            record = dict(r, warmup=meta["warmup"], steps=meta["measured_steps"])
            if r["strategy"] == ABLATED:
                out.setdefault(key, {}).setdefault("ablation", (record, plain[r["dist"], r["tokens_per_gpu"]]))
            elif r.get("pp_schedule_choice"):
                out.setdefault(key, {}).setdefault("auto", record)
            else:
                out.setdefault(key, {}).setdefault(r["pp_schedule"], record)
    return out


def validate(key, records) -> dict:
    dist, tokens, layers, pp, microbatches = key
    dp = GPUS // pp
    warmup, steps = records["1f1b"]["warmup"], records["1f1b"]["steps"]
    batches = bench_microbatches(dist, tokens, dp, (warmup + steps) * microbatches)[warmup * microbatches:]
    config = SimConfig(model="llama3-8b", layers=layers, gpus=GPUS, tp=1, gpus_per_node=GPUS, tokens_per_gpu=tokens,
                       dist=dist, strategies=("cad",), recompute="linear", batches=len(batches))
    sim = simulate_pipeline(config, pp, microbatches, steps, doc_batches=batches)
    predicted = {"1f1b": sim["strategies"]["cad-serial"]["per_step_s"], "pooled": sim["pooled"]["per_step_s"]}
    exposed = sum(tick["comm_exposed_s"] for step in sim["pooled"]["steps"] for tick in step["ticks"])
    total = {name: float(sum(steps_s)) for name, steps_s in predicted.items()}
    row = {"dist": dist, "tokens_per_dp_rank": tokens, "layers": layers, "pp": pp, "dp": dp,
           "microbatches": microbatches, "measured_steps": steps, "stage_layers_1f1b": sim["stage_layers"]}
    for schedule in ("1f1b", "pooled"):
        record = records[schedule]
        measured = record["step_times_s"]
        row[schedule] = {"measured_s": measured, "predicted_s": predicted[schedule],
                         "measured_total_s": float(sum(measured)), "predicted_total_s": float(sum(predicted[schedule])),
                         "error": float(sum(predicted[schedule]) / sum(measured) - 1),
                         "peak_memory_gib": record["peak_memory_bytes"] / 2**30,
                         "predicted_peak_memory_gib_at_run": (record["predicted_peak_memory_bytes"] or 0) / 2**30,
                         "predicted_peak_memory_gib": predicted_peak_gib(dist, tokens, layers, pp, microbatches,
                                                                         warmup + steps, schedule),
                         "losses": record["losses"]}
        row[schedule]["memory_error"] = row[schedule]["predicted_peak_memory_gib"] / row[schedule]["peak_memory_gib"] - 1
    row["predicted_gain"] = 1 - total["pooled"] / total["1f1b"]
    choice = auto_choice(dist, tokens, layers, pp, microbatches, warmup + steps)
    row["auto"] = choice.to_dict()
    row["measured_speedup"] = row["1f1b"]["measured_total_s"] / row["pooled"]["measured_total_s"]
    row["auto_vs_1f1b"] = row["1f1b"]["measured_total_s"] / row[choice.chosen]["measured_total_s"]
    row["losses_max_rel_diff"] = float(max(abs(a - b) / b for a, b in zip(row["pooled"]["losses"],
                                                                              row["1f1b"]["losses"])))
    if "auto" in records:  # auto run itself: what it chose on the GPUs, and its step against 1F1B's
        run = records["auto"]
        row["auto_run"] = {"chosen": run["pp_schedule"], "choice": run["pp_schedule_choice"],
                           "vs_1f1b": row["1f1b"]["measured_total_s"] / run["total_time_s"]}
    # What the exchanges cost: simulated, the time ranks wait at them; measured, the step the ablation saves
    row["exchange_share_predicted"] = exposed / sum(predicted["pooled"])
    # What the pooled plans move against the least balance needs (every rank's home work above the mean)
    row["work_moved_over_needed"] = (sum(step["work_moved"] for step in sim["pooled"]["steps"])
                                     / sum(step["work_above_mean"] for step in sim["pooled"]["steps"]))
    if "ablation" in records:
        ablated, pooled = records["ablation"]
        row["exchange_share_measured"] = 1 - ablated["total_time_s"] / pooled["total_time_s"]
    return row


def _row_line(r: dict) -> str:
    a, p = r["1f1b"], r["pooled"]
    steps = r["measured_steps"]
    measured_exchange = f"{r['exchange_share_measured']:.1%}" if "exchange_share_measured" in r else "-"
    return (f"| {r['dist']} {r['layers']} layers, pp{r['pp']} x dp{r['dp']}, {r['microbatches']} micro-batches | "
            f"{a['measured_total_s'] / steps:.2f} | {a['predicted_total_s'] / steps:.2f} ({a['error']:+.1%}) | "
            f"{p['measured_total_s'] / steps:.2f} | {p['predicted_total_s'] / steps:.2f} ({p['error']:+.1%}) | "
            f"{r['measured_speedup']:.3f}x | {1 / (1 - r['predicted_gain']):.3f}x | {r['auto']['chosen']} | "
            f"{r['auto_vs_1f1b']:.3f}x | {measured_exchange} / {r['exchange_share_predicted']:.1%} | "
            f"{r['work_moved_over_needed']:.3f} | "
            f"{a['peak_memory_gib']:.1f} / {p['peak_memory_gib']:.1f} | "
            f"{a['memory_error']:+.1%} / {p['memory_error']:+.1%} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--measured", default=MEASURED)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    rows = [validate(key, records) for key, records in runs_by_config(args.measured).items()]
    command = "PYTHONPATH=src python3 bench/sim_pooled_validation.py " + " ".join(sys.argv[1:])
    lines = ["# The pooled pipeline against 1F1B on 4 x H200: measured, simulated, and auto's choice", "",
             f"Date {datetime.date.today()}. Measured: `{args.measured}` (4 x NVIDIA H200, llama3-8b, 64K tokens per "
             "dp rank, cad, flash kernel, keep_attention, FSDP2, bf16; a configuration's two schedules in one device "
             "call, on the same batches; the totals of each run's measured steps). Simulated: "
             "`attnpool.sim.pipeline.simulate_pipeline` with the packaged H200 profile on the same micro-batches, the "
             "stages split as the runs split them (the output projection counted), pooled's layer slots planned by cad "
             "over every stage's ranks. `auto`: `pp_schedule: auto` asked as a run asks it (its first micro-batches; "
             f"pooled where predicted at least {AUTO_POOLED_GAIN:.0%} faster). Exchange: the share of pooled's step "
             "that its exchanges cost, measured as what `--ablation` (one-element messages) saves, and simulated as the "
             "time ranks wait at them (`-`: no ablation run). Moved / needed: the attention work pooled's plans serve "
             "away from home over the measured steps, against the least any balanced plan must move (every rank's "
             f"home work above the mean; plan.metrics.work_moved). Command: `{command}`.", "",
             "| run | 1F1B measured (s) | simulated | pooled measured (s) | simulated | pooled vs 1F1B measured | "
             "predicted | auto | auto vs 1F1B | exchange measured / simulated | moved / needed | "
             "peak GiB 1F1B / pooled | memory model |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [_row_line(r) for r in rows]
    errors = [abs(r[s]["error"]) for r in rows for s in ("1f1b", "pooled")]
    memory = [abs(r[s]["memory_error"]) for r in rows for s in ("1f1b", "pooled")]
    predicted_fast = [r for r in rows if r["predicted_gain"] >= AUTO_POOLED_GAIN]
    chose_pooled = [r for r in rows if r["auto"]["chosen"] == "pooled"]
    lines += ["", f"Simulator: within {max(errors):.1%} of every run (target {TARGET:.0%}). Memory model: within "
                  f"{max(memory):.1%}. Where the simulator predicts pooled at least {AUTO_POOLED_GAIN:.0%} faster "
                  f"({len(predicted_fast)} of {len(rows)} configurations) it ran "
                  + ", ".join(f"{r['measured_speedup']:.3f}x" for r in predicted_fast) + " 1F1B; where `auto` "
                  f"chose pooled ({len(chose_pooled)} of {len(rows)}), "
                  + ", ".join(f"{r['auto_vs_1f1b']:.3f}x" for r in chose_pooled) + "; its choices ran "
                  + ", ".join(f"{r['auto_vs_1f1b']:.3f}x" for r in rows) + " 1F1B in all. Losses: pooled against "
                  f"1F1B within {max(r['losses_max_rel_diff'] for r in rows):.1e} relative (bf16). Pooled's plans "
                  f"move {min(r['work_moved_over_needed'] for r in rows):.3f}-"
                  f"{max(r['work_moved_over_needed'] for r in rows):.3f}x the work balance needs; its exchanges cost "
                  + ", ".join(f"{r['exchange_share_measured']:.1%}" for r in rows if "exchange_share_measured" in r)
                  + " of the step where measured."]
    for r in rows:
        if "auto_run" in r:
            lines += ["", f"`pp_schedule: auto` run itself ({r['dist']}, {r['layers']} layers, pp{r['pp']} x "
                          f"dp{r['dp']}, {r['microbatches']} micro-batches): chose {r['auto_run']['chosen']} "
                          f"({r['auto_run']['choice']['why']}), {r['auto_run']['vs_1f1b']:.3f}x 1F1B's measured step "
                          "(the same choice as asked offline above: "
                          f"{'yes' if r['auto_run']['chosen'] == r['auto']['chosen'] else 'no'})."]
    lines += ["", "Nothing in the simulator was fitted to these runs. The schedule's first form, every stage holding "
                  "the same layers, was checked on the same eight configurations (the simulator within 4.3%): this "
                  "file as of commit 4f1600e."]
    write_record(args.out, "sim-pooled-validation", {"command": command, "measured": args.measured, "rows": rows},
                 lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
