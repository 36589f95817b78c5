"""PNG figures in the shape of the DistCA paper's: speedup against GPUs, step-time breakdown, tolerance sweep."""

from __future__ import annotations

from pathlib import Path

import numpy as np

BREAKDOWN = (("linear_s", "linear", "#4c72b0"), ("attention_s", "attention", "#dd8452"),
             ("imbalance_s", "imbalance (wait)", "#c44e52"), ("comm_exposed_s", "exposed comm", "#8172b3"))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _size(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def plot_speedup(results: list[dict], path) -> bool:
    """Speedup of cad over WLB-ideal against GPUs: a panel per model, a line per (distribution, max doc length)."""
    rows = [r for r in results if r.get("speedup")]
    if not rows:
        return False
    plt = _plt()
    models = sorted({r["config"]["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.8), squeeze=False, sharey=True)
    for ax, model in zip(axes[0], models):
        lines: dict[tuple, list] = {}
        for r in rows:
            c = r["config"]
            if c["model"] == model:
                lines.setdefault((c["dist"], c["max_doc_len"]), []).append((c["gpus"], r["speedup"]))
        for (dist, L), pts in sorted(lines.items()):
            pts.sort()
            x, y = zip(*pts)
            ax.plot(x, y, marker="o" if dist == "pretrain" else "s", ls="-" if dist == "pretrain" else "--",
                    label=f"{dist}, {_size(L)}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        xs = sorted({r["config"]["gpus"] for r in rows if r["config"]["model"] == model})
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("GPUs")
        ax.set_title(f"{model}: cad over WLB-ideal (predicted)", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0, 0].set_ylabel("speedup")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_breakdown(results: list[dict], path, max_panels: int = 12) -> bool:
    """Stacked step time per strategy (linear, attention, imbalance, exposed comm), a panel per configuration."""
    rows = results[:max_panels]
    if not rows:
        return False
    plt = _plt()
    cols = min(3, len(rows))
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 3.6 * nrows), squeeze=False)
    for ax, r in zip(axes.ravel(), rows):
        names = list(r["strategies"])
        bottom = np.zeros(len(names))
        for key, label, color in BREAKDOWN:
            vals = np.array([r["strategies"][n][key] for n in names])
            ax.bar(range(len(names)), vals, bottom=bottom, color=color, label=label)
            bottom += vals
        best = r.get("wlb_ideal", {}).get("strategy")
        ticks = [f"{n}\n(WLB-ideal)" if n == best else n for n in names]
        ax.set_xticks(range(len(names)), ticks, rotation=60, fontsize=7, ha="right")
        ax.axhline(r["ideal_step_s"], color="k", lw=0.8, ls="--", label="ideal")
        sp = r.get("speedup")
        ax.set_title(r["label"] + (f"  speedup {sp:.2f}x" if sp else ""), fontsize=9)
        ax.set_ylabel("step time (s)")
    for ax in axes.ravel()[len(rows):]:
        ax.axis("off")
    axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_eps(results: list[dict], path, max_panels: int = 12) -> bool:
    """cad's tolerance sweep: step time and bytes moved against eps, a panel per configuration."""
    rows = [r for r in results if r.get("eps_sweep")][:max_panels]
    if not rows:
        return False
    plt = _plt()
    cols = min(3, len(rows))
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, r in zip(axes.ravel(), rows):
        sw = r["eps_sweep"]
        eps = [p["eps"] for p in sw]
        ax.plot(eps, [p["step_s"] for p in sw], marker="o", color="#4c72b0", label="step time")
        ax.set_xlabel("tolerance eps")
        ax.set_ylabel("step time (s)", color="#4c72b0")
        ax2 = ax.twinx()
        ax2.plot(eps, [p["bytes_moved"] / 2**30 for p in sw], marker="s", color="#dd8452", label="bytes moved")
        ax2.plot(eps, [p["max_bytes_per_server"] / 2**30 for p in sw], marker="^", ls="--", color="#c44e52",
                 label="max per server")
        ax2.set_ylabel("GiB per layer (fwd)", color="#dd8452")
        ax.set_title(r["label"], fontsize=9)
        lines = ax.get_legend_handles_labels()
        lines2 = ax2.get_legend_handles_labels()
        ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=7, loc="best", framealpha=0.6)
    for ax in axes.ravel()[len(rows):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(results: list[dict], out_dir) -> list[str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fn in (("speedup.png", plot_speedup), ("breakdown.png", plot_breakdown), ("eps_sweep.png", plot_eps)):
        if fn(results, out / name):
            written.append(str(out / name))
    return written
