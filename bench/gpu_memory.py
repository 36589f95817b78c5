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

Writes ``gpu_memory.json`` (every run), ``gpu_memory.md`` (the tables) and, with ``fit``,
``memory_calibration.json`` under DIR; prints the tables last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as attnpool train sets it

import numpy as np  # noqa: E402
import torch  # noqa: E402

from attnpool.bench.memory import MemoryRecorder  # noqa: E402
from attnpool.comm import process_group  # noqa: E402
from attnpool.model import model_config  # noqa: E402
from attnpool.train import TrainConfig, train  # noqa: E402
from attnpool.train.memory import (CHECKPOINTING_MODES, Calibration, GiB, MemoryInputs, estimate,  # noqa: E402
                                   saved_per_layer, step_inputs_per_token)
from attnpool.train.train import build_model, memory_inputs  # noqa: E402

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


# Runs whose peak is broken down by allocation site (the allocator's history is recorded: slower).
BREAKDOWN_RUNS = [
    (2, 128 * K, "keep_attention", False, False, "breakdown"),
    (2, 64 * K, "full", False, False, "breakdown"),
    (2, 64 * K, "none", False, False, "breakdown"),
    (4, 128 * K, "keep_attention", True, False, "breakdown"),
]


def log(*args):
    print(*args, flush=True)


def fresh():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_config(layers, tokens, mode, act_offload, opt_offload, out_dir, *, steps=2, data="synthetic", **extra):
    data_args = {"dist": SHORT_DOCS} if data == "synthetic" else {}
    return TrainConfig(model="llama3-8b", model_args={"n_layers": layers}, data=data, data_args=data_args,
                       tokens_per_rank=tokens, steps=steps, warmup_steps=1, attention="local",
                       activation_checkpointing=mode, activation_offload=act_offload, optimizer_offload=opt_offload,
                       memory_check=False, device="cuda", progress=False, checkpoint_every=-1, out=out_dir, **extra)


def predicted(config: TrainConfig, calibration: Calibration) -> dict:
    model = model_config(config.model, **config.model_args)
    est = estimate(memory_inputs(config, model, 1, True), calibration)
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
            model = build_model(model_config("llama3-8b", n_layers=layers), config, torch.device("cuda"), bf16=True)
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
                     "hand_count_outside_layers": step_inputs_per_token(inputs)})
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


def phase_fit(measured: list[dict]) -> dict:
    """Residuals per mode from the fit runs: measured allocated minus the hand count (no calibration)."""
    ok = [r for r in measured if "error" not in r]
    fit_runs = [r for r in ok if r["role"] == "fit"]
    per_token, constant = {}, {}
    for mode in CHECKPOINTING_MODES:
        runs = [r for r in fit_runs if r["mode"] == mode]
        if len(runs) < 2:
            per_token[mode], constant[mode] = 0.0, 0.0
            continue
        tokens = np.array([r["tokens"] for r in runs], dtype=np.float64)
        residual = np.array([r["allocated_bytes"] - r["hand_allocated_bytes"] for r in runs], dtype=np.float64)
        slope, intercept = np.polyfit(tokens, residual, 1)
        per_token[mode], constant[mode] = float(slope), float(intercept)
    fragmentation = float(max(r["reserved_bytes"] / r["allocated_bytes"] for r in fit_runs))
    context = int(max(r["context_bytes"] for r in ok))
    return {"source": f"bench/gpu_memory.py on one {torch.cuda.get_device_name()} (torch {torch.__version__}), "
                      f"{time.strftime('%Y-%m-%d')}",
            "residual_per_token": per_token, "residual_constant": constant, "fragmentation": fragmentation,
            "cuda_context_bytes": context}


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
    lines = [f"# Peak memory on one {record['device']}", "", f"Command: `{record['command']}`", ""]
    if record.get("saved"):
        lines += ["## Saved for backward per layer and token (bytes)", "",
                  "| mode | measured | hand count | outside layers: measured | hand count |", "|---|---|---|---|---|"]
        lines += [f"| {r['mode']} | {r['measured_per_layer']:.1f} | {r['hand_count_per_layer']:.1f} | "
                  f"{r['measured_outside_layers']:.1f} | {r['hand_count_outside_layers']:.1f} |" for r in record["saved"]]
        lines.append("")
    if record.get("measure"):
        lines += ["## Peak per configuration (GiB)", "",
                  "| role | layers | tokens | checkpointing | act. offload | opt. offload | allocated | reserved | "
                  "predicted (calibrated) | error | hand count alone |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in record["measure"]:
            if "error" in r:
                lines.append(f"| {r['role']} | {r['layers']} | {r['tokens'] // K}K | {r['mode']} | "
                             f"{r['activation_offload']} | {r['optimizer_offload']} | {r['error']} | | | | |")
                continue
            measured = r["reserved_bytes"] + r["context_bytes"]
            calibrated = r.get("calibrated_peak_bytes")
            calibrated = "| |" if calibrated is None else f"{calibrated / GiB:.2f} | {calibrated / measured - 1:+.1%} |"
            lines.append(f"| {r['role']} | {r['layers']} | {r['tokens'] // K}K | {r['mode']} | {r['activation_offload']} | "
                         f"{r['optimizer_offload']} | {r['allocated_bytes'] / GiB:.2f} | {r['reserved_bytes'] / GiB:.2f} | "
                         f"{calibrated} {r['hand_allocated_bytes'] / GiB:.2f} |")
        lines += ["", "Measured peak = reserved + CUDA context (what the GPU holds); the error compares the calibrated "
                      "prediction with it.", ""]
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
    if record.get("calibration"):
        lines += ["## Calibration", "", "```", json.dumps(record["calibration"], indent=1), "```", ""]
    if record.get("full"):
        r = record["full"]
        lines += ["## Full depth", "", "```", json.dumps(r, indent=1, default=str), "```", ""]
    if record.get("offload"):
        lines += ["## Activation offload: step time", "", "| layers | tokens | checkpointing | without (s) | with (s) | "
                  "slowdown | peak without | peak with | offloaded |", "|---|---|---|---|---|---|---|---|---|"]
        for r in record["offload"]:
            lines.append(f"| {r['layers']} | {r['tokens'] // K}K | {r['mode']} | {r['without']['median_step_s']:.3f} | "
                         f"{r['with']['median_step_s']:.3f} | {r['slowdown']:+.1%} | "
                         f"{r['without']['allocated_bytes'] / GiB:.2f} | {r['with']['allocated_bytes'] / GiB:.2f} | "
                         f"{(r['with']['offloaded_bytes'] or 0) / GiB:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--phases", default="measure,fit,full,offload,saved")
    parser.add_argument("--full-tokens", type=int, default=64 * K)
    parser.add_argument("--full-setting", default="keep_attention,act",
                        help="MODE[,act][,opt]: the full-depth run's checkpointing mode and offloads")
    args = parser.parse_args()
    phases = args.phases.split(",")
    os.makedirs(args.out, exist_ok=True)
    torch.cuda.set_device(0)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "command": "PYTHONPATH=src python3 bench/gpu_memory.py " + " ".join(sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "total_memory": torch.cuda.get_device_properties(0).total_memory}

    def save():
        with open(os.path.join(args.out, "gpu_memory.json"), "w") as fh:
            json.dump(record, fh, indent=1, default=str)
        with open(os.path.join(args.out, "gpu_memory.md"), "w") as fh:
            fh.write(markdown(record))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp, \
            process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                          timeout=timedelta(minutes=10), device_id=torch.device("cuda", 0)):
        calibration = Calibration.load()
        if "breakdown" in phases:
            record["breakdown"] = phase_measure(tmp, Calibration.none(), BREAKDOWN_RUNS, breakdown=True)
            save()
        if "measure" in phases:
            record["measure"] = phase_measure(tmp, Calibration.none(), RUNS)
            for r in record["measure"]:
                r["hand_allocated_bytes"] = r["predicted"]["allocated_bytes"]
            save()
        if "fit" in phases and record.get("measure"):
            record["calibration"] = calibration_data = phase_fit(record["measure"])
            with open(os.path.join(args.out, "memory_calibration.json"), "w") as fh:
                json.dump(calibration_data, fh, indent=1)
            calibration = Calibration(**{k: calibration_data[k] for k in ("residual_per_token", "residual_constant",
                                                                          "fragmentation", "cuda_context_bytes",
                                                                          "source")})
        for r in record.get("measure", []):
            config = run_config(r["layers"], r["tokens"], r["mode"], r["activation_offload"], r["optimizer_offload"], "x")
            r["calibrated_peak_bytes"] = predicted(config, calibration)["peak_bytes"]
        save()
        if "full" in phases:
            mode, *flags = args.full_setting.split(",")
            try:
                record["full"] = phase_full(tmp, args.full_tokens, mode, "act" in flags, "opt" in flags, calibration)
            except Exception as exc:  # noqa: BLE001 - the offload phase still runs
                traceback.print_exc()
                record["full"] = {"error": f"{type(exc).__name__}: {exc}"}
            save()
        if "offload" in phases:
            record["offload"] = phase_offload(tmp, [(8, 64 * K, "keep_attention"), (4, 128 * K, "keep_attention")])
            save()
        if "saved" in phases:
            record["saved"] = phase_saved(tmp)
            save()
    print(markdown(record))


if __name__ == "__main__":
    main()
