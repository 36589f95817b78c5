#!/usr/bin/env python3
"""The memory model against the measured peaks of bench/gpu_hf_checkpoint.py's memory runs, predicted again on the
CPU with today's model (`attnpool memory` with each run's flags, on its config.json): what a change to the model
does to them, without a GPU.

    PYTHONPATH=src python bench/cpu_hf_memory_recheck.py --out bench/results [--name NAME]

Measured peaks and the predictions the runs made come from --measured (default the 2026-11-28 2 x H100 record).
Runs with tp or pp are left out (their stages and shards are predicted by other paths, rechecked by
tests/test_pipeline.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from attnpool.bench.record import write_record
from gpu_hf_checkpoint import MEMORY_MODELS, MEMORY_RUNS

MEASURED = "bench/results/2026-11-28-h100x4-hf-memory.json"
GIB = 1 << 30


def predicted_now(directory: str, model: str, impl: str, tokens: int, mode: str) -> int:
    """The allocated peak `attnpool memory` predicts for the run (2 ranks, cad, synthetic prolong, as the run)."""
    cmd = [sys.executable, "-m", "attnpool.cli.main", "memory", "--model", f"hf:{directory}", "--model-impl", impl,
           "--nproc", "2", "--tokens-per-rank", str(tokens), "--activation-checkpointing", mode, "--data", "synthetic",
           "--data-args", "dist=prolong", "--attention", "cad", "--gpu-memory", "80GiB", "--json"]
    if "sliding_window" in MEMORY_MODELS[model]:
        cmd += ["--max-doc-len", str(2 * tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(json.loads(out.stdout)["allocated_bytes"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--measured", default=MEASURED)
    parser.add_argument("--name", default="cpu-hf-memory-recheck")
    args = parser.parse_args()
    measured = {r["name"]: r for r in json.load(open(args.measured))["memory"] if r.get("peak_memory_bytes")}
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for model, impl, tokens, mode, flags in MEMORY_RUNS:
            run = measured.get("-".join([model, impl, f"{tokens // 1024}K", mode]))
            if flags or run is None:
                continue
            directory = os.path.join(work, model)
            os.makedirs(directory, exist_ok=True)
            with open(os.path.join(directory, "config.json"), "w") as f:
                json.dump(MEMORY_MODELS[model], f)
            now = predicted_now(directory, model, impl, tokens, mode)
            rows.append({"run": run["name"], "measured_bytes": run["peak_memory_bytes"],
                         "predicted_at_the_run_bytes": run["predicted_peak_memory_bytes"], "predicted_now_bytes": now})
            print(f"{run['name']}: done", file=sys.stderr, flush=True)
    command = "PYTHONPATH=src python bench/cpu_hf_memory_recheck.py " + " ".join(sys.argv[1:])
    lines = [f"# The memory model against {os.path.basename(args.measured)}'s peaks, predicted again on the CPU", "",
             "Each run's allocated peak as measured, as the run predicted it, and as `attnpool memory` with the "
             f"run's flags predicts it now (2 ranks, cad, the same synthetic batches). Command: `{command}`.", "",
             "| run | measured (GiB) | predicted at the run | error | predicted now | error |", "|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured_bytes"]
        lines.append(f"| {r['run']} | {m / GIB:.2f} | {r['predicted_at_the_run_bytes'] / GIB:.2f} | "
                     f"{r['predicted_at_the_run_bytes'] / m - 1:+.1%} | {r['predicted_now_bytes'] / GIB:.2f} | "
                     f"{r['predicted_now_bytes'] / m - 1:+.1%} |")
    write_record(args.out, args.name, {"command": command, "measured": args.measured, "rows": rows}, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
