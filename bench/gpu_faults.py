#!/usr/bin/env python3
"""A silent peer and a killed worker on GPUs (NCCL): how long until the run ends, and what it says.

    PYTHONPATH=src python3 bench/gpu_faults.py --out DIR [--timeouts 10,20]

- stall: 2 GPUs, the demo's tiny model, ``--collective-timeout-s T``; rank 1 gets SIGSTOP once step 3 is logged.
  Measured: seconds from the signal to the launcher's exit, its exit code and last line (it should name rank 1).
- kill: the same run, rank 1 gets SIGKILL; ``--max-restarts 0``: the launcher's exit code and last line.

bench/faults.py measures the same on CPU (gloo). Writes gpu_faults.json and gpu_faults.md under DIR and prints
the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))

from attnpool.bench.faults import metrics_rows, workers  # noqa: E402

RUN = ("--config", "configs/demo-cpu.yaml", "--device", "cuda", "--nproc", "2", "--steps", "400",
       "--checkpoint-every", "-1", "--no-progress")


def fault_run(out: str, fault: signal.Signals, timeout_s: float | None) -> dict:
    """Start the run, wait for step 3, send ``fault`` to rank 1's process, time the launcher's exit."""
    args = [*RUN, "--out", out] + (["--collective-timeout-s", str(timeout_s)] if timeout_s else [])
    log_path = out + ".log"
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), PYTHONUNBUFFERED="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "attnpool.cli.main", "train", *args], stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None and len(metrics_rows(out)) < 3:
            time.sleep(0.2)
        ranks = workers(proc.pid)
        target = ranks[1] if len(ranks) > 1 else None
        if target is None or proc.poll() is not None:
            proc.kill()
            return {"fault": fault.name, "timeout_s": timeout_s, "error": "the run did not reach step 3 with 2 workers"}
        os.kill(target, fault)
        t0 = time.time()
        try:
            code = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = None
        ended_s = time.time() - t0
        if os.path.exists(f"/proc/{target}"):
            os.kill(target, signal.SIGKILL)
    text = open(log_path).read().strip().splitlines()
    return {"fault": fault.name, "timeout_s": timeout_s, "pid": target, "exit": code, "ended_s": round(ended_s, 1),
            "last_line": text[-1] if text else "", "names_the_rank": "rank 1" in (text[-1] if text else ""),
            "log_lines": len(text)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeouts", default="10,20", help="collective_timeout_s values for the stall runs")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import torch

    rows = [fault_run(os.path.join(args.out, f"stall-{t}"), signal.SIGSTOP, float(t))
            for t in args.timeouts.split(",")]
    rows.append(fault_run(os.path.join(args.out, "kill"), signal.SIGKILL, None))
    result = {"device": f"2 x {torch.cuda.get_device_name(0)}", "torch": torch.__version__, "runs": rows}
    with open(os.path.join(args.out, "gpu_faults.json"), "w") as fh:
        json.dump(result, fh, indent=2)
    lines = [f"# Faults on {result['device']} (torch {result['torch']}, NCCL)", "",
             "| fault | collective_timeout_s | exit | ended after (s) | names rank 1 | last line |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['fault']} | {r.get('timeout_s') or '-'} | {r.get('exit')} | {r.get('ended_s')} | "
                     f"{r.get('names_the_rank')} | {r.get('last_line', r.get('error', ''))[:300]} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "gpu_faults.md"), "w") as fh:
        fh.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
