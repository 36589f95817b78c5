"""Exactness of the parallel layouts on GPUs (NCCL, bf16): each layout trains the same steps on the same
batches as its reference, and their losses are compared.

    python3 bench/gpu_layouts.py --out DIR [--gpus 4] [--tokens 16K] [--steps 4] [--layers 4] [--quick]

--quick (under 2 minutes): dp2 x tp2 against dp2 with cad, and one process, 2 layers, 4K tokens, 2 steps.

Layouts (every one with two micro-batches a step, so the pipeline runs a real 1F1B schedule):

    dp2 x tp2 and pp2 x dp2   against dp2 (the same dp ranks, so the same documents per rank)
    pp2 x tp2                 against one process (dp = 1)

each with `local` and `cad` where dp > 1. A second run of the one-process reference gives the noise of
bf16 training on GPUs itself (cuBLAS and NCCL choose reduction orders per shape and per run), against
which the layouts' differences are read. Runs that fit the GPUs together run at once, each on its own
GPUs and port. Writes layouts.json and layouts.md under DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# Layouts: name -> (processes, attnpool train flags, the reference's name)
LAYOUTS = {
    "one": (1, ["--attention", "local"], None),
    "one-again": (1, ["--attention", "local"], "one"),
    "dp2-local": (2, ["--attention", "local"], None),
    "dp2-cad": (2, ["--attention", "cad"], None),
    "dp2xtp2-local": (4, ["--attention", "local", "--tp", "2"], "dp2-local"),
    "dp2xtp2-cad": (4, ["--attention", "cad", "--tp", "2"], "dp2-cad"),
    "pp2xdp2-local": (4, ["--attention", "local", "--pp", "2"], "dp2-local"),
    "pp2xdp2-cad": (4, ["--attention", "cad", "--pp", "2"], "dp2-cad"),
    "pp2xtp2-local": (4, ["--attention", "local", "--pp", "2", "--tp", "2"], "one"),
    # The pooled pipeline (issue 22): its idle stages serve CA-tasks, one exchange over all four ranks.
    "pp2xdp2-pooled-cad": (4, ["--attention", "cad", "--pp", "2", "--pp-schedule", "pooled"], "dp2-cad"),
}
QUICK_LAYOUTS = ("one", "dp2-cad", "dp2xtp2-cad")
# bf16 keeps 8 significant bits: two reduction orders of the same sums give losses a few 1e-3 apart
# after a few steps. The CPU tests hold the same layouts to 1e-5 in float32; on GPUs float32 GEMMs
# (TF32 off) and NCCL's other reduction orders leave some 1e-6, so 1e-4 separates logic from rounding.
TOLERANCE = {"bf16": 1e-2, "fp32": 1e-4}


def launch(name: str, gpus: list[int], port: int, args) -> subprocess.Popen:
    nproc, flags, _ = LAYOUTS[name]
    out = os.path.join(args.out, name)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(port),
           "-m", "attnpool.cli.main", "train", "--model", args.model, "--model-args", f"n_layers={args.layers}",
           "--data", "synthetic", "--data-args", "dist=prolong", "--tokens-per-rank", args.tokens,
           "--microbatches", "2", "--steps", str(args.steps), "--warmup-steps", "2", "--lr", "1e-4",
           "--precision", args.precision, "--device", args.device, "--checkpoint-every", "-1", "--no-progress",
           "--seed", "0", "--out", out, *flags]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)))
    os.makedirs(out, exist_ok=True)
    log = open(os.path.join(args.out, f"{name}.log"), "w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def losses(args, name: str) -> list[float] | None:
    path = os.path.join(args.out, name, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r["loss"] for r in rows if "loss" in r]


def run_all(args) -> dict:
    """Packs the runs onto the GPUs, first come first placed, each waiting only for GPUs it needs."""
    pending = [n for n in chosen_layouts(args) if LAYOUTS[n][0] <= args.gpus]
    free, running, status, port = list(range(args.gpus)), {}, {}, 29600
    t0 = time.time()
    while pending or running:
        for name in list(pending):
            nproc = LAYOUTS[name][0]
            ref = LAYOUTS[name][2]
            if len(free) >= nproc and (ref is None or ref in status or name == "one-again"):
                gpus, free = free[:nproc], free[nproc:]
                port += 1
                running[name] = (launch(name, gpus, port, args), gpus, time.time())
                pending.remove(name)
        time.sleep(1)
        for name, (proc, gpus, start) in list(running.items()):
            if proc.poll() is None and time.time() - start > args.run_timeout_s:
                proc.kill()
            if proc.poll() is not None:
                status[name] = dict(rc=proc.returncode, wall_s=round(time.time() - start, 1))
                free += gpus
                del running[name]
                print(f"[{time.time() - t0:5.0f} s] {name}: rc {proc.returncode} in {status[name]['wall_s']} s", flush=True)
    return status


def chosen_layouts(args) -> list[str]:
    return [n for n in LAYOUTS if not args.quick or n in QUICK_LAYOUTS]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gpus", type=int, default=4)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tokens", default="16K", help="tokens per dp rank per micro-batch")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--run-timeout-s", type=float, default=180)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: gloo, float32, a smoke test")
    p.add_argument("--precision", default=None, choices=("bf16", "fp32"), help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--quick", action="store_true", help="three layouts, 2 layers, 4K tokens, 2 steps: under 2 minutes")
    args = p.parse_args()
    if args.quick:
        args.layers, args.tokens, args.steps, args.run_timeout_s = 2, "4K", 2, min(args.run_timeout_s, 90)
    args.precision = args.precision or ("bf16" if args.device == "cuda" else "fp32")
    os.makedirs(args.out, exist_ok=True)
    status = run_all(args)
    tolerance = TOLERANCE[args.precision]
    rows = []
    for name in chosen_layouts(args):
        nproc, flags, ref = LAYOUTS[name]
        mine, theirs = losses(args, name), losses(args, ref) if ref else None
        dev = None
        if mine and theirs:
            n = min(len(mine), len(theirs))
            dev = max(abs(a - b) / abs(b) for a, b in zip(mine[:n], theirs[:n]))
        rows.append(dict(layout=name, processes=nproc, flags=" ".join(flags), reference=ref, losses=mine,
                         max_rel_diff=dev, ok=None if ref is None else dev is not None and dev <= tolerance,
                         **status.get(name, dict(rc=None, wall_s=None))))
    import torch
    device = torch.cuda.get_device_name() if args.device == "cuda" else "CPU process (gloo)"
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=f"{args.gpus} x {device}",
                torch=torch.__version__, model=f"{args.model} x {args.layers} layers", tokens_per_dp_rank=args.tokens,
                microbatches=2, steps=args.steps, tolerance=tolerance, precision=args.precision,
                command=f"python3 bench/gpu_layouts.py --out DIR --gpus {args.gpus} --tokens {args.tokens} "
                        f"--steps {args.steps} --layers {args.layers} --precision {args.precision}"
                        + (" --quick" if args.quick else ""))
    with open(os.path.join(args.out, "layouts.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    backend = f"{'NCCL' if args.device == 'cuda' else 'gloo'}, {args.precision}"
    lines = [f"# Parallel layouts against their references on {meta['machine']} ({backend})", "",
             f"{meta['model']}, synthetic prolong, {args.tokens} tokens per dp rank per micro-batch, 2 micro-batches, "
             f"{args.steps} steps; tolerance {tolerance} relative.", "", f"Command: `{meta['command']}`", "",
             "| layout | processes | reference | losses | max rel diff | ok | wall s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ls = "-" if not r["losses"] else " ".join(f"{x:.4f}" for x in r["losses"])
        dev = "-" if r["max_rel_diff"] is None else f"{r['max_rel_diff']:.2e}"
        ok = "-" if r["ok"] is None else ("yes" if r["ok"] else "NO")
        lines.append(f"| {r['layout']} | {r['processes']} | {r['reference'] or '-'} | {ls} | {dev} | {ok} | {r['wall_s']} |")
    with open(os.path.join(args.out, "layouts.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["ok"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
