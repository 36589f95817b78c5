#!/usr/bin/env python3
"""float8 against bf16, window by window, from the quality runs' records (issue 47).

Reads records laid out as ``bench/results/2026-11-29-h200x2-float8-quality-600.json`` (``runs``: name -> per-step
``loss`` and ``grad_norm`` lists) and prints, for every ``--window`` steps, the baseline's mean loss and each other
run's mean loss against it (the runs share initial weights and batches, so a window compares like with like), then
the mean gradient norms; ``--plot`` draws the losses and the differences.

Runs that differ only in rounding drift apart (two bf16 runs ended 3.3% apart over 600 steps:
``bench/results/2026-11-29-h200-float8-noise-floor.md``), so one run against one says little. ``--group
LABEL=PATTERN`` (repeatable; shell-style patterns over run names) compares groups instead: each window's mean over a
group's runs against the mean over the baseline group's, with the lowest and highest of the group's runs beside it.

    python3 bench/float8_quality.py bench/results/2026-11-29-h200x2-float8-quality-600.json \\
        bench/results/2026-11-29-h200-float8-gw-hp.json --baseline 600-steps-quality-bf16-s0 --steps 600
    python3 bench/float8_quality.py bench/results/2026-11-29-h200-float8-noise-floor.json \\
        --group 'bf16=nondet-bf16-*' --group 'rowwise=nondet-rowwise-*' --baseline bf16
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics


def load_runs(paths: list[str], steps: int) -> dict[str, dict[str, list[float]]]:
    """Every run of ``steps`` steps in the records at ``paths``, by name (a later record's run of the same name
    is refused: it would hide one)."""
    runs: dict[str, dict[str, list[float]]] = {}
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        for name, run in record["runs"].items():
            if len(run["loss"]) != steps:
                continue
            if name in runs:
                raise SystemExit(f"{path}: run {name} is in an earlier record too")
            runs[name] = run
    return runs


def short_names(names: list[str]) -> dict[str, str]:
    """Each name without the part every name shares up to a dash (``600-steps-quality-``)."""
    shared = os.path.commonprefix(names) if len(names) > 1 else ""
    cut = shared.rfind("-") + 1
    return {name: name[cut:] for name in names}


def window_table(runs: dict, baseline: str, window: int) -> list[str]:
    """Markdown rows: steps, the baseline's mean loss, every other run's mean loss against it, the gradient norms."""
    others = [name for name in runs if name != baseline]
    base, short = runs[baseline], short_names(list(runs))
    lines = [f"| steps | {short[baseline]} loss | " + " | ".join(short[name] for name in others) + " | grad norm: "
             + " / ".join(short[name] for name in [baseline, *others]) + " |", "|---" * (3 + len(others)) + "|"]
    steps = len(base["loss"])
    for start in range(0, steps, window):
        def mean(run, key):
            return statistics.mean(run[key][start:start + window])
        b = mean(base, "loss")
        cells = [f"{mean(runs[name], 'loss') / b - 1:+.2%}" for name in others]
        norms = " / ".join(f"{mean(runs[name], 'grad_norm'):.2f}" for name in [baseline, *others])
        lines.append(f"| {start + 1}-{min(start + window, steps)} | {b:.4f} | " + " | ".join(cells) + f" | {norms} |")
    return lines


def group_runs(runs: dict, patterns: dict[str, str]) -> dict[str, list[str]]:
    """Each group's run names: those ``patterns[label]`` matches (shell-style), in the records' order; a pattern that
    matches nothing is refused."""
    groups = {label: [name for name in runs if fnmatch.fnmatchcase(name, pattern)]
              for label, pattern in patterns.items()}
    for label, names in groups.items():
        if not names:
            raise SystemExit(f"--group {label}={patterns[label]}: matches none of {', '.join(runs)}")
    return groups


def group_table(runs: dict, groups: dict[str, list[str]], baseline: str, window: int) -> list[str]:
    """Markdown rows: steps, the baseline group's mean loss with its runs' spread around it, and every other group's
    mean against the baseline's mean, its runs' lowest and highest in brackets."""
    others = [label for label in groups if label != baseline]
    lines = [f"| steps | {baseline} loss (mean of {len(groups[baseline])}) | {baseline}'s runs | "
             + " | ".join(f"{label} (mean of {len(groups[label])}) [runs]" for label in others) + " |",
             "|---" * (3 + len(others)) + "|"]
    steps = len(runs[groups[baseline][0]]["loss"])
    for start in range(0, steps, window):
        def means(label):
            return [statistics.mean(runs[name]["loss"][start:start + window]) for name in groups[label]]
        b = statistics.mean(means(baseline))

        def against(values):
            return f"{statistics.mean(values) / b - 1:+.2%} [{min(values) / b - 1:+.2%}, {max(values) / b - 1:+.2%}]"
        spread = means(baseline)
        cells = [against(means(label)) for label in others]
        lines.append(f"| {start + 1}-{min(start + window, steps)} | {b:.4f} | {min(spread) / b - 1:+.2%} to "
                     f"{max(spread) / b - 1:+.2%} | " + " | ".join(cells) + " |")
    return lines


def plot(runs: dict, baseline: str, window: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    base = runs[baseline]["loss"]

    def smooth(values):
        return [statistics.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]
    short = short_names(list(runs))
    for i, (name, run) in enumerate(runs.items()):
        color = f"C{i}"  # (one colour a run in both panels)
        top.plot(range(1, len(run["loss"]) + 1), smooth(run["loss"]), label=short[name], lw=1, color=color)
        if name != baseline:
            ratio = [a / b - 1 for a, b in zip(smooth(run["loss"]), smooth(base))]
            bottom.plot(range(1, len(ratio) + 1), [100 * r for r in ratio], lw=1, color=color)
    top.set_ylabel(f"loss ({window}-step mean)")
    top.legend(fontsize=8)
    bottom.axhline(0, color="grey", lw=0.5)
    bottom.set_ylabel(f"against {short[baseline]} (%)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("records", nargs="+", help="quality records' JSON files")
    ap.add_argument("--baseline", required=True, help="the run (or with --group, the group) the others are "
                    "compared with")
    ap.add_argument("--group", action="append", default=[], metavar="LABEL=PATTERN",
                    help="compare the means of groups of runs (names matching the shell-style PATTERN)")
    ap.add_argument("--steps", type=int, default=600, help="compare the runs of this many steps")
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--plot", default=None, metavar="PNG")
    args = ap.parse_args()
    if args.window < 1 or args.steps < 1:
        ap.error(f"--window {args.window} / --steps {args.steps}: must be positive")
    if args.plot and args.group:
        ap.error("--plot draws single runs against --baseline's; it does not draw --group's means")
    runs = load_runs(args.records, args.steps)
    if args.group:
        if any("=" not in g for g in args.group):
            ap.error(f"--group {next(g for g in args.group if '=' not in g)}: give LABEL=PATTERN")
        groups = group_runs(runs, dict(g.split("=", 1) for g in args.group))
        if args.baseline not in groups:
            ap.error(f"--baseline {args.baseline}: not one of the groups ({', '.join(groups)})")
        print("\n".join(group_table(runs, groups, args.baseline, args.window)))
        return
    if args.baseline not in runs:
        ap.error(f"--baseline {args.baseline}: no run of {args.steps} steps of that name "
                 f"(found: {', '.join(runs) or 'none'})")
    print("\n".join(window_table(runs, args.baseline, args.window)))
    if args.plot:
        plot(runs, args.baseline, args.window, args.plot)


if __name__ == "__main__":
    main()
