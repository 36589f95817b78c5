#!/usr/bin/env python3
"""Peak memory on one GPU: the memory model's calibration and check, full depth, and what offload costs.

Phases (``--phases``, in this order):

- ``saved``: what one layer keeps for backward on this GPU (bf16, FSDP2 mixed precision, autocast),
  counted by a saved-tensor hook over 1 and 2 layers, against the hand count
  (attnpool.train.memory.saved_per_layer), per checkpointing mode.
- ``measure``: training runs of Llama-3-8B dimensions cut to 2-8 layers at 64K-256K tokens, every
  checkpointing mode, activation and optimizer offload on and off: the allocator's peak (allocated
  and reserved) of steps 1-2 against the prediction. Data: synthetic documents of 8K tokens (memory
  does not depend on the lengths on one rank, and attention stays cheap).
- ``fit``: a calibration from the ``measure`` runs marked ``fit`` (a residual per checkpointing mode,
  per token and constant, least squares; the reserved/allocated ratio; the CUDA context), written to
  ``memory_calibration.json``; the other runs are the held-out check.
- ``full``: the full 32-layer Llama-3-8B at ``--full-tokens`` tokens on this GPU, 5 steps on the Python
  standard library's text (byte-level), with the setting ``attnpool memory`` names.
- ``offload``: step time with and without activation offload, same configuration, median of steps 2-6.

    PYTHONPATH=src python3 bench/gpu_memory.py --out DIR [--phases saved,measure,fit,full,offload]
    PYTHONPATH=src python3 bench/gpu_memory.py --out DIR --quick   # under 2 minutes: saved, and two 2-layer
                                                                  # runs checked against the packaged calibration

Writes ``gpu_memory.json`` (every run), ``gpu_memory.md`` (the tables) and, with ``fit``,
``memory_calibration.json`` under DIR; prints the tables last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from datetime import timedelta

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as attnpool train sets it

import numpy as np  # noqa: E402
import torch  # noqa: E402

from attnpool.bench.memory import MemoryRecorder  # noqa: E402
from attnpool.comm import free_port, process_group  # noqa: E402
from attnpool.model import model_config  # noqa: E402
from attnpool.train import TrainConfig, train  # noqa: E402
from attnpool.train.memory import (CHECKPOINTING_MODES, Calibration, GiB, MemoryInputs, estimate,  # noqa: E402
                                   saved_per_layer, step_inputs_per_token)
from attnpool.train.memory_check import memory_inputs  # noqa: E402
from attnpool.train.runners import build_model  # noqa: E402
from attnpool.train.spec import resolve_run_spec  # noqa: E402

K = 1024
SHORT_DOCS = [8192] * 64
# (layers, tokens, mode, activation_offload, optimizer_offload, role): "fit" runs calibrate, "check" runs test it.
RUNS = [
    (2, 64 * K, "keep_attention", False, False, "fit"),
    (2, 128 * K, "keep_attention", False, False, "fit"),
    (2, 256 * K, "keep_attention", False, False, "fit"),
    (2, 32 * K, "full", False, False, "fit"),
    (2, 64 * K, "full", False, False, "fit"),
    (2, 128 * K, "full", False, False, "fit"),
    (2, 32 * K, "none", False, False, "fit"),
    (2, 64 * K, "none", False, False, "fit"),
    (2, 128 * K, "none", False, False, "fit"),
    (8, 64 * K, "keep_attention", False, False, "check"),
    (4, 256 * K, "keep_attention", False, False, "check"),
    (4, 128 * K, "keep_attention", True, False, "check"),
    (4, 256 * K, "keep_attention", True, False, "check"),
    (4, 64 * K, "full", False, False, "check"),
    (8, 128 * K, "full", False, False, "check"),
    (8, 128 * K, "full", True, False, "check"),
    (4, 64 * K, "none", False, False, "check"),
    (4, 64 * K, "none", True, False, "check"),
    (2, 64 * K, "keep_attention", False, True, "check"),
    (4, 128 * K, "full", True, True, "check"),
]


# --quick: checked against the packaged calibration, nothing fitted.
QUICK_RUNS = [
    (2, 32 * K, "keep_attention", False, False, "check"),
    (2, 32 * K, "full", False, False, "check"),
]
# (layers, tokens, mode, activation_offload, optimizer_offload) whose least allocator memory is measured.
THRESHOLD_RUNS = [
    (2, 128 * K, "keep_attention", False, False),
    (2, 64 * K, "full", False, False),
    (4, 128 * K, "keep_attention", True, False),
]
# Runs whose peak is broken down by allocation site (the allocator's history is recorded: slower).
BREAKDOWN_RUNS = [
    (2, 128 * K, "keep_attention", False, False, "breakdown"),
    (2, 64 * K, "full", False, False, "breakdown"),
    (2, 64 * K, "none", False, False, "breakdown"),
    (4, 128 * K, "keep_attention", True, False, "breakdown"),
]


def log(*args):
    print(*args, flush=True)


def fresh(host: bool = True):
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # Pinned host memory that offload runs cached: sizes differ from run to run, so it would pile up.
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        if host and hasattr(torch._C, name):
            getattr(torch._C, name)()
            break


def run_config(layers, tokens, mode, act_offload, opt_offload, out_dir, *, steps=2, data="synthetic", **extra):
    data_args = {"dist": SHORT_DOCS} if data == "synthetic" else {}
    return TrainConfig(model="llama3-8b", model_args={"n_layers": layers}, data=data, data_args=data_args,
                       tokens_per_rank=tokens, steps=steps, warmup_steps=1, attention="local",
                       activation_checkpointing=mode, activation_offload=act_offload, optimizer_offload=opt_offload,
                       memory_check=False, device="cuda", progress=False, checkpoint_every=-1, out=out_dir, **extra)


def predicted(config: TrainConfig, calibration: Calibration) -> dict:
    est = estimate(memory_inputs(resolve_run_spec(config, 1, device_type="cuda")), calibration)
    return {"peak_bytes": est.peak_bytes, "allocated_bytes": est.allocated_bytes, "phase": est.phase,
            "breakdown": est.breakdown}


def context_bytes() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free - torch.cuda.memory_reserved())


# --- saved ---------------------------------------------------------------------------------------------


def phase_saved(tmp) -> list[dict]:
    """Per-layer saved bytes on this GPU, by a hook over a 1- and a 2-layer forward."""
    from attnpool.plan import linear_table, plan_attention
    from attnpool.runtime import CoreAttention

    tokens = 16 * K
    rows = []
    for mode in CHECKPOINTING_MODES:
        totals = []
        for layers in (1, 2):
            config = run_config(layers, tokens, mode, False, False, f"{tmp}/saved")
            model = build_model(resolve_run_spec(config, 1, torch.device("cuda")))
            plan = plan_attention(linear_table(np.array([8192, 8192]), 1, tokens), "local")
            ids = torch.randint(0, 128256, (tokens,), device="cuda")
            positions = torch.arange(tokens, device="cuda") % 8192
            storages = {}

            def pack(t):
                if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(ids, positions, CoreAttention(plan), labels=ids)
            totals.append(sum(storages.values()))
            loss.backward()  # FSDP2 keeps the root's gathered parameters until a backward ends
            del loss, model
            fresh()
        inputs = MemoryInputs(model_config("llama3-8b", n_layers=1), tokens, mode)
        rows.append({"mode": mode, "measured_per_layer": (totals[1] - totals[0]) / tokens,
                     "hand_count_per_layer": sum(saved_per_layer(inputs).values()),
                     "measured_outside_layers": (2 * totals[0] - totals[1]) / tokens,
                     "hand_count_outside_layers": step_inputs_per_token(inputs, loss=True)})
        log("saved", rows[-1])
    return rows


# --- measure -------------------------------------------------------------------------------------------


def phase_measure(tmp, calibration: Calibration, runs, breakdown: bool = False) -> list[dict]:
    """Training runs (``runs``: RUNS rows); with ``breakdown``, what was live at each run's peak."""
    results = []
    for layers, tokens, mode, act_offload, opt_offload, role in runs:
        config = run_config(layers, tokens, mode, act_offload, opt_offload, f"{tmp}/m{len(results)}")
        row = {"layers": layers, "tokens": tokens, "mode": mode, "activation_offload": act_offload,
               "optimizer_offload": opt_offload, "role": role, "predicted": predicted(config, calibration)}
        fresh()
        row["start_allocated_bytes"] = torch.cuda.memory_allocated()  # left over from earlier runs (should be 0)
        start = time.perf_counter()
        try:
            with MemoryRecorder(enabled=breakdown) as recorder:
                result = train(config)
            row["peak_breakdown"] = recorder.breakdown(top=25)
            row.update(allocated_bytes=max(r["peak_memory_bytes"] for r in result.rows),
                       reserved_bytes=max(r["peak_reserved_bytes"] for r in result.rows),
                       step_time_s=[r["step_time_s"] for r in result.rows],
                       loss=[r["loss"] for r in result.rows], context_bytes=context_bytes())
            del result
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
        except Exception as exc:  # noqa: BLE001 - recorded, the next run goes on
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        row["wall_s"] = time.perf_counter() - start
        fresh()
        log("measure", {k: v for k, v in row.items() if k not in ("predicted", "peak_breakdown")},
            "predicted", row["predicted"]["peak_bytes"] / GiB)
        results.append(row)
    return results


# --- fit -------------------------------------------------------------------------------------------------


def hand_count(r: dict) -> int:
    """The hand count alone (no calibration) of a measured run's allocated peak."""
    config = run_config(r["layers"], r["tokens"], r["mode"], r["activation_offload"], r["optimizer_offload"], "x")
    return predicted(config, Calibration.none())["allocated_bytes"]


def phase_fit(record: dict) -> dict:
    """The calibration: per checkpointing mode, a residual ``per_token * tokens + constant`` fitted by least
    squares to the ``fit`` runs' allocated peaks minus the hand count; the fragmentation, the largest ratio
    of the allocator memory a run needed (``threshold``) to its allocated peak; the CUDA context."""
    ok = [r for r in record["measure"] if "error" not in r]
    per_token, constant = {}, {}
    for mode in CHECKPOINTING_MODES:
        runs = [r for r in ok if r["role"] == "fit" and r["mode"] == mode]
        if len(runs) < 2:
            per_token[mode], constant[mode] = 0.0, 0.0
            continue
        tokens = np.array([r["tokens"] for r in runs], dtype=np.float64)
        residual = np.array([r["allocated_bytes"] - hand_count(r) for r in runs], dtype=np.float64)
        slope, intercept = np.polyfit(tokens, residual, 1)
        per_token[mode], constant[mode] = float(slope), float(intercept)
    needed = [r["needed_bytes"] / r["allocated_bytes"] for r in record.get("threshold", []) if r.get("needed_bytes")]
    return {"source": f"bench/gpu_memory.py on one {record['device']} (torch {record['torch']}), {record['date']}",
            "residual_per_token": per_token, "residual_constant": constant,
            "fragmentation": float(max(needed)) if needed else 1.0,
            "cuda_context_bytes": int(max(r["context_bytes"] for r in ok))}


def phase_threshold(tmp, configs, measured: list[dict], iterations: int = 5) -> list[dict]:
    """The least allocator memory each configuration runs in: its allocated peak plus what the allocator
    cannot give back when an allocation fails (reserved memory beyond that is cache it releases). Found
    by capping the allocator (``torch.cuda.set_per_process_memory_fraction``) between the run's allocated
    peak and the whole device, by bisection."""
    total = torch.cuda.get_device_properties(0).total_memory
    rows = []
    for layers, tokens, mode, act_offload, opt_offload in configs:
        ref = next(r for r in measured if (r["layers"], r["tokens"], r["mode"], r["activation_offload"],
                                           r["optimizer_offload"]) == (layers, tokens, mode, act_offload, opt_offload))
        # Below its allocated peak it fails; the answer lies a little above (with everything it runs).
        low, high = ref["allocated_bytes"] / total, min(1.0, 1.25 * ref["allocated_bytes"] / total)
        attempts = []
        for i in range(iterations):
            fraction = (low + high) / 2
            torch.cuda.set_per_process_memory_fraction(fraction)
            fresh(host=False)  # the same sizes again: keep the pinned memory
            try:
                train(run_config(layers, tokens, mode, act_offload, opt_offload, f"{tmp}/t{len(rows)}-{i}"))
                high, ran = fraction, True
            except torch.OutOfMemoryError:
                low, ran = fraction, False
            attempts.append({"fraction": fraction, "ran": ran})
            torch.cuda.set_per_process_memory_fraction(1.0)
            fresh(host=False)
        fresh()
        rows.append({"layers": layers, "tokens": tokens, "mode": mode, "activation_offload": act_offload,
                     "optimizer_offload": opt_offload, "allocated_bytes": ref["allocated_bytes"],
                     "reserved_bytes": ref["reserved_bytes"], "needed_bytes": int(high * total),
                     "attempts": attempts})
        log("threshold", rows[-1])
    return rows


# --- full depth and offload ----------------------------------------------------------------------------


def phase_full(tmp, tokens, mode, act_offload, opt_offload, calibration) -> dict:
    config = run_config(32, tokens, mode, act_offload, opt_offload, f"{tmp}/full", steps=5, data="stdlib", lr=3e-4)
    row = {"layers": 32, "tokens": tokens, "mode": mode, "activation_offload": act_offload,
           "optimizer_offload": opt_offload, "predicted": predicted(config, calibration)}
    fresh()
    try:
        result = train(config)
        row.update(loss=[r["loss"] for r in result.rows], tokens_per_s=[r["tokens_per_s"] for r in result.rows],
                   step_time_s=[r["step_time_s"] for r in result.rows],
                   allocated_bytes=max(r["peak_memory_bytes"] for r in result.rows),
                   reserved_bytes=max(r["peak_reserved_bytes"] for r in result.rows))
        del result
    except torch.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    fresh()
    log("full", row)
    return row


def phase_offload(tmp, configs) -> list[dict]:
    rows = []
    for layers, tokens, mode in configs:
        pair = {}
        for act_offload in (False, True):
            config = run_config(layers, tokens, mode, act_offload, False, f"{tmp}/o{len(rows)}{act_offload}", steps=6)
            fresh()
            result = train(config)
            times = [r["step_time_s"] for r in result.rows][1:]
            pair[act_offload] = {"median_step_s": float(np.median(times)), "step_time_s": times,
                                 "allocated_bytes": max(r["peak_memory_bytes"] for r in result.rows),
                                 "offloaded_bytes": result.rows[-1].get("activation_offload_bytes"),
                                 "loss": [r["loss"] for r in result.rows]}
            del result
            fresh()
        rows.append({"layers": layers, "tokens": tokens, "mode": mode, "without": pair[False], "with": pair[True],
                     "slowdown": pair[True]["median_step_s"] / pair[False]["median_step_s"] - 1})
        log("offload", rows[-1])
    return rows


# --- report ----------------------------------------------------------------------------------------------


def markdown(record: dict) -> str:
    lines = [f"# Peak memory on one {record['device']}", "", f"Command: `{record['command']}`",
             f"(torch {record['torch']}, {record['date']})", ""]
    if record.get("measure"):
        lines += ["## Allocated peak per configuration (GiB)", "",
                  "The allocator's peak of allocated memory (`torch.cuda.max_memory_allocated`, steps 1-2) against the "
                  "prediction: calibrated, and the hand count alone. `fit` runs calibrate, `check` runs test.", "",
                  "| role | layers | tokens | checkpointing | act. offload | opt. offload | measured | predicted | error | "
                  "hand count | error | peak phase | reserved |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in record["measure"]:
            head = (f"| {r['role']} | {r['layers']} | {r['tokens'] // K}K | {r['mode']} | {r['activation_offload']} | "
                    f"{r['optimizer_offload']} |")
            if "error" in r:
                lines.append(f"{head} {r['error']} | | | | | | |")
                continue
            if "calibrated" not in r:  # not predicted yet (finish() adds it)
                continue
            measured, hand, cal = r["allocated_bytes"], r["hand_allocated_bytes"], r["calibrated"]
            lines.append(f"{head} {measured / GiB:.2f} | {cal['allocated_bytes'] / GiB:.2f} | "
                         f"{cal['allocated_bytes'] / measured - 1:+.1%} | {hand / GiB:.2f} | {hand / measured - 1:+.1%} | "
                         f"{cal['phase']} | {r['reserved_bytes'] / GiB:.2f} |")
        errors = [abs(r["calibrated"]["allocated_bytes"] / r["allocated_bytes"] - 1) for r in record["measure"]
                  if "calibrated" in r and "error" not in r and r["role"] == "check"]
        if errors:
            lines += ["", f"Held-out (`check`) runs: largest error {max(errors):.1%}, mean {np.mean(errors):.1%}.", ""]
    if record.get("threshold"):
        lines += ["## What the allocator needs (GiB)", "",
                  "Reserved memory beyond the allocated peak is mostly cache that the allocator releases when an "
                  "allocation fails. The least memory each run needs was found by capping the allocator "
                  "(`set_per_process_memory_fraction`) and bisecting; the calibration's fragmentation is the largest "
                  "needed/allocated ratio, and the predicted peak (what the GPU must hold) adds the CUDA context.", "",
                  "| layers | tokens | checkpointing | act. offload | allocated | reserved | needed | needed/allocated | "
                  "predicted peak | needed + context |", "|---|---|---|---|---|---|---|---|---|---|"]
        context = record.get("calibration", {}).get("cuda_context_bytes", 0)
        for r in record["threshold"]:
            config = run_config(r["layers"], r["tokens"], r["mode"], r["activation_offload"], r["optimizer_offload"], "x")
            peak = r.get("predicted_peak_bytes") or predicted(config, Calibration.none())["peak_bytes"]
            lines.append(f"| {r['layers']} | {r['tokens'] // K}K | {r['mode']} | {r['activation_offload']} | "
                         f"{r['allocated_bytes'] / GiB:.2f} | {r['reserved_bytes'] / GiB:.2f} | {r['needed_bytes'] / GiB:.2f} | "
                         f"{r['needed_bytes'] / r['allocated_bytes']:.3f} | {peak / GiB:.2f} | "
                         f"{(r['needed_bytes'] + context) / GiB:.2f} |")
        lines.append("")
    if record.get("calibration"):
        lines += ["## Calibration", "", "```", json.dumps(record["calibration"], indent=1), "```", ""]
    if record.get("full"):
        r = record["full"]
        lines += ["## Full depth: Llama-3-8B, 32 layers, one GPU", ""]
        if "error" in r:
            lines += [f"{r['tokens'] // K if 'tokens' in r else '?'}K tokens: {r['error']}", ""]
        else:
            lines += [f"{r['tokens'] // K}K tokens per step, {r['mode']}"
                      f"{', activation offload' if r['activation_offload'] else ''}"
                      f"{', optimizer offload' if r['optimizer_offload'] else ''}; Python standard library text "
                      "(byte-level), 5 steps.", "",
                      "| step | loss | step time (s) | tokens/s |", "|---|---|---|---|"]
            lines += [f"| {i + 1} | {loss:.3f} | {t:.2f} | {rate:,.0f} |"
                      for i, (loss, t, rate) in enumerate(zip(r["loss"], r["step_time_s"], r["tokens_per_s"]))]
            lines += ["", f"Peak allocated {r['allocated_bytes'] / GiB:.2f} GiB (predicted "
                          f"{r['predicted']['allocated_bytes'] / GiB:.2f}, {r['predicted']['allocated_bytes'] / r['allocated_bytes'] - 1:+.1%}), "
                          f"reserved {r['reserved_bytes'] / GiB:.2f} GiB; predicted peak with fragmentation and context "
                          f"{r['predicted']['peak_bytes'] / GiB:.2f} GiB of {record['total_memory'] / GiB:.2f}.", ""]
    if record.get("offload"):
        lines += ["## Activation offload: step time (median of steps 2-6)", "",
                  "| layers | tokens | checkpointing | without (s) | with (s) | slowdown | allocated without | with | "
                  "offloaded per step |", "|---|---|---|---|---|---|---|---|---|"]
        for r in record["offload"]:
            lines.append(f"| {r['layers']} | {r['tokens'] // K}K | {r['mode']} | {r['without']['median_step_s']:.3f} | "
                         f"{r['with']['median_step_s']:.3f} | {r['slowdown']:+.1%} | "
                         f"{r['without']['allocated_bytes'] / GiB:.2f} | {r['with']['allocated_bytes'] / GiB:.2f} | "
                         f"{(r['with']['offloaded_bytes'] or 0) / GiB:.2f} |")
        lines.append("")
    if record.get("saved"):
        lines += ["## Saved for backward, per layer and token (bytes)", "",
                  "Counted by a saved-tensor hook over a 1- and a 2-layer forward (bf16, FSDP2), against "
                  "`attnpool.train.memory.saved_per_layer`.", "",
                  "| mode | measured | hand count | outside layers: measured | hand count |", "|---|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['measured_per_layer']:.1f} | {r['hand_count_per_layer']:.1f} | "
                  f"{r['measured_outside_layers']:.1f} | {r['hand_count_outside_layers']:.1f} |" for r in record["saved"]]
        lines.append("")
    for r in record.get("breakdown", []):
        b = r.get("peak_breakdown")
        if not b:
            continue
        lines += [f"## What was live at the peak: {r['layers']} layers, {r['tokens'] // K}K tokens, {r['mode']}"
                  f"{', activation offload' if r['activation_offload'] else ''}", "",
                  f"Peak {(b['start_bytes'] + b['peak_bytes']) / GiB:.2f} GiB allocated (trace entry {b['peak_index']} "
                  f"of {b['entries']}).", "", "| allocated at | GiB | blocks |", "|---|---|---|"]
        lines += [f"| `{g['site']}` | {g['bytes'] / GiB:.3f} | {g['blocks']} |" for g in b["groups"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def calibration_of(data: dict) -> Calibration:
    return Calibration(**{k: data[k] for k in ("residual_per_token", "residual_constant", "fragmentation",
                                               "cuda_context_bytes", "source")})


def finish(record: dict, out: str, fit: bool = True) -> None:
    """Fit (where measurements exist and ``fit``), predict every measured run with the result (else with the
    packaged calibration), write the files."""
    calibration = Calibration.load()
    if fit and record.get("measure"):
        record["calibration"] = phase_fit(record)
        with open(os.path.join(out, "memory_calibration.json"), "w") as fh:
            json.dump(record["calibration"], fh, indent=1)
        calibration = calibration_of(record["calibration"])
    for r in record.get("measure", []):
        config = run_config(r["layers"], r["tokens"], r["mode"], r["activation_offload"], r["optimizer_offload"], "x")
        r["hand_allocated_bytes"] = hand_count(r)
        r["calibrated"] = predicted(config, calibration)
    for r in record.get("threshold", []):
        config = run_config(r["layers"], r["tokens"], r["mode"], r["activation_offload"], r["optimizer_offload"], "x")
        r["predicted_peak_bytes"] = predicted(config, calibration)["peak_bytes"]
    save(record, out)


def save(record: dict, out: str) -> None:
    with open(os.path.join(out, "gpu_memory.json"), "w") as fh:
        json.dump(record, fh, indent=1, default=str)
    try:
        text = markdown(record)
    except Exception:  # noqa: BLE001 - the JSON is written; a report bug must not end the measurements
        traceback.print_exc()
        sys.stderr.flush()
        return
    with open(os.path.join(out, "gpu_memory.md"), "w") as fh:
        fh.write(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phases", default="measure,threshold,full,offload,saved")
    parser.add_argument("--refit", metavar="GPU_MEMORY_JSON",
                        help="no GPU: fit the calibration again from recorded measurements, with this model's hand count")
    parser.add_argument("--measurements", metavar="GPU_MEMORY_JSON",
                        help="take the measure phase's runs from an earlier record instead of running them")
    parser.add_argument("--full-tokens", type=int, default=64 * K)
    parser.add_argument("--full-setting", default="keep_attention,act",
                        help="MODE[,act][,opt]: the full-depth run's checkpointing mode and offloads")
    parser.add_argument("--quick", action="store_true",
                        help="the saved phase and QUICK_RUNS checked against the packaged calibration (nothing fitted): "
                             "under 2 minutes")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.refit:
        with open(args.refit) as fh:
            record = json.load(fh)
        record["refit"] = "PYTHONPATH=src python3 bench/gpu_memory.py " + " ".join(sys.argv[1:])
        finish(record, args.out)
        print(markdown(record))
        return
    phases = ["saved", "quick"] if args.quick else args.phases.split(",")
    torch.cuda.set_device(0)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "command": "PYTHONPATH=src python3 bench/gpu_memory.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "total_memory": torch.cuda.get_device_properties(0).total_memory}
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, \
            process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                          timeout=timedelta(minutes=10), device_id=torch.device("cuda", 0)):
        if args.measurements:
            with open(args.measurements) as fh:
                record["measure"] = json.load(fh)["measure"]
        if "breakdown" in phases:
            record["breakdown"] = phase_measure(tmp, Calibration.none(), BREAKDOWN_RUNS, breakdown=True)
            save(record, args.out)
        if "measure" in phases or "quick" in phases:
            record["measure"] = phase_measure(tmp, Calibration.none(), QUICK_RUNS if args.quick else RUNS)
            save(record, args.out)
        if "threshold" in phases:
            record["threshold"] = phase_threshold(tmp, THRESHOLD_RUNS, record["measure"])
            save(record, args.out)
        finish(record, args.out, fit=not args.quick)
        calibration = calibration_of(record["calibration"]) if record.get("calibration") else Calibration.load()
        if "full" in phases:
            mode, *flags = args.full_setting.split(",")
            try:
                record["full"] = phase_full(tmp, args.full_tokens, mode, "act" in flags, "opt" in flags, calibration)
            except Exception as exc:  # noqa: BLE001 - the offload phase still runs
                traceback.print_exc()
                record["full"] = {"error": f"{type(exc).__name__}: {exc}"}
            save(record, args.out)
        if "offload" in phases:
            record["offload"] = phase_offload(tmp, [(8, 64 * K, "keep_attention"), (4, 128 * K, "keep_attention")])
            save(record, args.out)
        if "saved" in phases:
            record["saved"] = phase_saved(tmp)
            save(record, args.out)
    print(markdown(record))


if __name__ == "__main__":
    main()
