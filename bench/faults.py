"""Fault-injection figures on CPU (gloo, the tiny model, 4 processes): faults injected, runs that finished,
steps lost, time to name a silent peer.

    .venv/bin/python bench/faults.py --out DIR [--trials 3]

- kill: a reference run of 12 steps (a checkpoint every 3), then ``--trials`` runs with ``--max-restarts
  3`` in which a random worker gets SIGKILL at two random steps; each run must finish with the
  reference's losses. Steps lost = steps trained again after a restart, beyond the last checkpoint.
- sigterm: SIGTERM to the launcher at a random step; then ``--resume``: steps lost, losses.
- stall: SIGSTOP to a worker; seconds until the run ends naming it, at two ``--collective-timeout-s``.
- damage: the newest checkpoint overwritten (8 KB), truncated or a shard deleted: what resume does.

Writes faults.json and faults.md under DIR and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from attnpool.bench.faults import (damage, losses, start_train, train_cli, wait_for_step,  # noqa: E402
                                   wait_gone, workers)

STEPS, EVERY, NPROC = 12, 3, 4
RUN = ("--nproc", str(NPROC), "--steps", str(STEPS), "--checkpoint-every", str(EVERY))


def kill_trials(root: str, reference: dict, trials: int, rng: random.Random) -> list[dict]:
    rows = []
    for trial in range(trials):
        out = os.path.join(root, f"kill-{trial}")
        log_path = out + ".log"
        kills = []
        with open(log_path, "w") as log:
            proc = start_train(*RUN, "--max-restarts", "3", "--out", out, log=log)
            for at in (rng.randint(2, 5), rng.randint(7, 10)):
                reached = wait_for_step(out, at, proc)
                pids = workers(proc.pid)
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills.append(reached)
                wait_gone(pids)
            rc = proc.wait(timeout=600)
        text = open(log_path).read()
        resumed = [int(m) for m in re.findall(r"resuming from \S*step-(\d+)", text)]
        # Steps trained again: from the checkpoint resumed to the step the kill interrupted (the one in
        # progress included), less what the checkpoint interval allows at most.
        redone = [k + 1 - r for k, r in zip(kills, resumed)]
        rows.append(dict(case="kill", trial=trial, faults=len(kills), finished=rc == 0, restarts=len(resumed),
                         killed_after_step=kills, resumed_from=resumed, steps_redone=redone,
                         steps_lost_beyond_interval=sum(max(0, d - EVERY) for d in redone),
                         losses_equal=losses(out) == reference))
    return rows


def sigterm_trial(root: str, reference: dict, rng: random.Random) -> dict:
    out = os.path.join(root, "sigterm")
    with open(out + ".log", "w") as log:
        proc = start_train(*RUN, "--out", out, log=log)
        wait_for_step(out, rng.randint(2, 8), proc)
        pids = workers(proc.pid)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=300)
    stopped = max(losses(out))
    orphans = not wait_gone(pids, timeout=5)
    resumed = train_cli(*RUN, "--resume", "--out", out, timeout=600)
    return dict(case="sigterm", faults=1, finished=rc == 0 and resumed.returncode == 0, stopped_after_step=stopped,
                orphans=orphans, steps_lost_beyond_interval=0 if f"step-{stopped:06d}" in resumed.stdout else None,
                losses_equal=losses(out) == reference)


def stall_trial(root: str, timeout_s: int) -> dict:
    out = os.path.join(root, f"stall-{timeout_s}")
    with open(out + ".log", "w") as log:
        proc = start_train("--nproc", "2", "--steps", "500", "--collective-timeout-s", str(timeout_s), "--out", out,
                           log=log)
        wait_for_step(out, 2, proc)
        stalled = workers(proc.pid)[-1]
        os.kill(stalled, signal.SIGSTOP)
        t0 = time.time()
        try:
            rc = proc.wait(timeout=timeout_s * 4 + 60)
        finally:
            if os.path.exists(f"/proc/{stalled}"):
                os.kill(stalled, signal.SIGKILL)
        seconds = time.time() - t0
    text = open(out + ".log").read()
    return dict(case="stall", faults=1, collective_timeout_s=timeout_s, finished=False, exit_code=rc,
                named=f"(pid {stalled} on " in text, seconds_to_error=round(seconds, 1))


def damage_trials(root: str, reference: dict) -> list[dict]:
    rows = []
    for how in ("overwrite", "truncate", "delete"):
        out = os.path.join(root, f"damage-{how}")
        first = train_cli(*RUN, "--stop-at", "9", "--out", out, timeout=600)
        assert first.returncode == 0, first.stderr
        file = damage(os.path.join(out, "checkpoints", "step-000009"), how)
        resumed = train_cli(*RUN, "--resume", "--out", out, timeout=600)
        rows.append(dict(case=f"damage ({how})", faults=1, finished=resumed.returncode == 0,
                         skipped_named=f"skipping {os.path.dirname(file)}" in resumed.stdout,
                         resumed_from_step=6 if "step-000006" in resumed.stdout else None,
                         losses_equal=losses(out) == reference))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as root:
        ref_out = os.path.join(root, "reference")
        assert train_cli(*RUN, "--out", ref_out, timeout=600).returncode == 0
        reference = losses(ref_out)
        rows = kill_trials(root, reference, args.trials, rng)
        rows.append(sigterm_trial(root, reference, rng))
        rows += [stall_trial(root, t) for t in (10, 30)]
        rows += damage_trials(root, reference)
    meta = dict(date=time.strftime("%Y-%m-%d"), machine=f"CPU, {os.cpu_count()} cores, gloo, {NPROC} processes",
                run=f"tiny model (configs/demo-cpu.yaml, dim 32, 2 layers), {STEPS} steps, a checkpoint every {EVERY}",
                command=f"python bench/faults.py --out DIR --trials {args.trials} --seed {args.seed}")
    with open(os.path.join(args.out, "faults.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Fault injection on {meta['machine']}", "", f"{meta['run']}. Command: `{meta['command']}`", "",
             "| case | faults | finished | steps lost beyond the checkpoint interval | losses = uninterrupted run | detail |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        detail = {k: v for k, v in r.items() if k not in ("case", "faults", "finished", "steps_lost_beyond_interval",
                                                            "losses_equal")}
        lost = r.get("steps_lost_beyond_interval", "-")
        lines.append(f"| {r['case']} | {r['faults']} | {'yes' if r['finished'] else 'no'} | "
                     f"{'-' if lost is None else lost} | {r.get('losses_equal', '-')} | "
                     f"{', '.join(f'{k}={v}' for k, v in detail.items())} |")
    with open(os.path.join(args.out, "faults.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
