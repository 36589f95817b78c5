"""A change's step times beside the code before it: the same `attnpool bench` runs on two source trees,
alternately, on the GPUs at hand, then compared step by step.

    python3 bench/gpu_ab.py --old OLD/src --new src --name local-1gpu --nproc 1 --out OUT -- \
        --model llama3-8b --layers 4 --configs prolong:128K --strategies local --warmup 2 --steps 5

Each round runs both trees (old first in even rounds, new first in odd ones, so that a drift in the machine's
state falls on both alike). Both draw the same batches (same seeds), so the measured steps pair up: the table
gives each tree's median step, the ratio of the medians, and the median of the paired per-step ratios, with
the largest relative difference between the two trees' losses (a change meant to compute the same function
gives the same losses). Writes OUT/NAME.json (every run's records and meta) and OUT/NAME.md; the runs' own
directories and logs go under --work. Prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_bench(src: str, out: str, nproc: int, bench_args: list[str]) -> dict:
    """One torchrun of `attnpool bench` from the tree ``src``; its e2e.json."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(src), PYTHONUNBUFFERED="1", **NCCL_ENV)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", "attnpool.cli.main",
           "bench", "--out", out, *bench_args]
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    with open(os.path.join(out, "log"), "w") as log:
        code = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"{src}: attnpool bench exited {code}; see {out}/log")
    with open(os.path.join(out, "e2e.json")) as fh:
        result = json.load(fh)
    result["wall_s"] = time.perf_counter() - t0
    return result


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    """Per (dist, tokens, strategy): both trees' step times over every round, paired step by step."""
    def record(run: dict, key: tuple) -> dict:
        return next(r for r in run["records"] if (r["dist"], r["tokens_per_gpu"], r["strategy"]) == key)

    rows = []
    for key in [(r["dist"], r["tokens_per_gpu"], r["strategy"]) for r in runs["old"][0]["records"]]:
        times = {"old": [], "new": []}
        paired, loss_diff = [], 0.0
        for old_run, new_run in zip(runs["old"], runs["new"]):
            old, new = record(old_run, key), record(new_run, key)
            times["old"] += old["step_times_s"]
            times["new"] += new["step_times_s"]
            paired += [b / a for a, b in zip(old["step_times_s"], new["step_times_s"])]
            loss_diff = max([loss_diff] + [abs(a - b) / abs(a) for a, b in zip(old["losses"], new["losses"])])
        old_median, new_median = statistics.median(times["old"]), statistics.median(times["new"])
        rows.append({"dist": key[0], "tokens_per_gpu": key[1], "strategy": key[2], "old_step_times_s": times["old"],
                     "new_step_times_s": times["new"], "old_median_s": old_median, "new_median_s": new_median,
                     "new_over_old": new_median / old_median, "paired_median": statistics.median(paired),
                     "paired_ratios": paired, "loss_max_rel_diff": loss_diff})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the source tree before the change (its src/)")
    p.add_argument("--new", required=True, help="the source tree with the change")
    p.add_argument("--name", required=True, help="names the results: OUT/NAME.json and OUT/NAME.md")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs) per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternating")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    p.add_argument("--work", default=None, help="the runs' directories and logs (default: a new temporary one)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the arguments of attnpool bench")
    args = p.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    work = args.work or tempfile.mkdtemp(prefix="attnpool-ab-")
    os.makedirs(args.out, exist_ok=True)
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for round_ in range(args.rounds):
        order = ("old", "new") if round_ % 2 == 0 else ("new", "old")
        for tree in order:
            src = args.old if tree == "old" else args.new
            result = run_bench(src, os.path.join(work, f"{args.name}-{tree}-{round_}"), args.nproc, bench_args)
            runs[tree].append(result)
            print(f"round {round_} {tree}: {result['wall_s']:.0f} s", flush=True)
    rows = compare(runs)
    meta = {k: runs["new"][0]["meta"][k] for k in ("date", "machine", "torch", "model", "attention_backend")}
    command = (f"python3 bench/gpu_ab.py --old {args.old} --new {args.new} --name {args.name} --nproc {args.nproc} "
               f"--rounds {args.rounds} -- {' '.join(bench_args)}")
    with open(os.path.join(args.out, f"{args.name}.json"), "w") as fh:
        json.dump({"meta": {**meta, "command": command}, "rows": rows, "runs": runs}, fh, indent=1)
    lines = [f"# {args.name}: old against new, {meta['machine']}", "",
             f"{meta['model']}, torch {meta['torch']}, kernel {meta['attention_backend']}, {args.rounds} rounds of "
             f"each tree, alternating. Command: `{command}`", "",
             "| dist | tokens/GPU | strategy | old median (s) | new median (s) | new / old | paired median | "
             "loss max rel diff |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dist']} | {r['tokens_per_gpu'] // 1024}K | {r['strategy']} | {r['old_median_s']:.3f} | "
                     f"{r['new_median_s']:.3f} | {r['new_over_old']:.3f} | {r['paired_median']:.3f} | "
                     f"{r['loss_max_rel_diff']:.2e} |")
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines[4:]))


if __name__ == "__main__":
    main()
