"""Reports of simulated runs as Markdown + JSON, and the paper-scale prediction grid.

:func:`paper_report` simulates the DistCA paper's evaluation grid without
pipeline parallelism (Llama-3-8B and the 34B Llama; Pretrain and ProLong; max
document length 128K, 256K, 512K; 64 to 512 GPUs, TP=8 inside a node; 30
batches each) and writes the predicted speedup of ``cad`` over WLB-ideal next
to the range the paper reports, and over the best baseline (WLB-ideal's or Ulysses). These are predictions of a cost model, not
measurements; the file says so in its first line.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from attnpool.sim.plots import write_plots
from attnpool.sim.simulate import SimConfig, assumptions, expand, simulate_many

# The DistCA paper (arXiv 2510.18121): its end-to-end speedup over WLB-ideal without pipeline parallelism.
PAPER_SPEEDUP_NO_PP = {"pretrain": (1.07, 1.20), "prolong": (1.05, 1.12)}
PAPER_GRID = dict(models=("llama3-8b", "llama-34b"), dists=("pretrain", "prolong"),
                  max_doc_lens=(131072, 262144, 524288), gpus=(64, 128, 256, 512))


def _size(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def results_markdown(results: list[dict], *, title: str, command: str, assumption: dict, paper: bool) -> str:
    lines = [f"# {title}", ""]
    lines += ["**Predictions of the attnpool cluster simulator (`attnpool simulate`), not measurements.**", ""]
    lines += [f"Command: `{command}`", "",
              f"Date: {time.strftime('%Y-%m-%d')}; python {platform.python_version()}; "
              f"simulated on CPU.", ""]
    lines += ["## Cost model", ""]
    for k, v in assumption["sources"].items():
        if v and k != "linear":  # linear is listed per model below
            lines.append(f"- {k}: {v}")
    lines.append(f"- inter-node: {assumption['inter_node']['bandwidth_GBps_per_gpu']:.0f} GB/s per GPU, "
                 f"{assumption['inter_node']['latency_us']:.0f} us per collective; intra-node: "
                 f"{assumption['intra_node']['bandwidth_GBps_per_gpu']:.0f} GB/s per GPU, "
                 f"{assumption['intra_node']['latency_us']:.0f} us")
    for m, v in assumption["models"].items():
        tp = next((f"; forward TP collectives (TP={k.rsplit('tp', 1)[-1]}, exposed) {x * 1e9:.2f} ns per token per layer"
                   for k, x in v.items() if k.startswith("tp_comm")), "")
        lines.append(f"- {m}: linear {v['linear']}: {v['linear_s_per_token_per_layer']['fwd'] * 1e9:.2f} ns fwd + "
                     f"{v['linear_s_per_token_per_layer']['bwd'] * 1e9:.2f} ns bwd per token per layer on one GPU (TP=1){tp}")
    lines.append(f"- not modelled: {', '.join(assumption['not_modelled'])}")
    lines += ["", "## Results", ""]
    head = ["model", "dist", "max doc", "GPUs", "servers", "WLB-ideal (DP x CP)", "WLB-ideal step (s)",
            "cad step (s)", "ideal / cad", "predicted speedup", "best baseline", "over the best baseline"]
    if paper:
        head.append("paper, no PP (reported)")
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for r in results:
        c = r["config"]
        wi = r.get("wlb_ideal", {})
        sp = r.get("speedup")
        row = [c["model"], c["dist"], _size(c["max_doc_len"]), str(c["gpus"]), str(r["servers"]),
               f"{wi.get('dp', '-')} x {wi.get('cp', '-')}" if wi else "-",
               f"{wi['step_s']:.2f}" if wi else "-",
               f"{r['strategies']['cad']['step_s']:.2f}" if "cad" in r["strategies"] else "-",
               f"{r['cad_efficiency']:.3f}" if "cad_efficiency" in r else "-",
               f"{sp:.3f}x" if sp else "-",
               r.get("best_baseline", {}).get("strategy", "-"),
               f"{r['speedup_vs_best_baseline']:.3f}x" if "speedup_vs_best_baseline" in r else "-"]
        if paper:
            lo, hi = PAPER_SPEEDUP_NO_PP.get(c["dist"], (None, None))
            row.append(f"{lo:.2f}-{hi:.2f}x" if lo else "-")
        lines.append("| " + " | ".join(row) + " |")
    if paper:
        lines += ["", "## Predicted range against the paper's", ""]
        lines.append("| model | dist | predicted min-max | paper, no PP (reported) |")
        lines.append("|---|---|---|---|")
        groups: dict[tuple, list] = {}
        for r in results:
            if r.get("speedup"):
                groups.setdefault((r["config"]["model"], r["config"]["dist"]), []).append(r["speedup"])
        for (m, d), sps in groups.items():
            lo, hi = PAPER_SPEEDUP_NO_PP.get(d, (float("nan"), float("nan")))
            lines.append(f"| {m} | {d} | {min(sps):.3f}-{max(sps):.3f}x | {lo:.2f}-{hi:.2f}x |")
    lines += ["", "Speedup = total step time of WLB-ideal (the best DP x CP of WLB-LLM packing + per-document CP, "
              "fixed over the batches) / total step time of cad (ping-pong overlap), over the same batches. The best "
              "baseline is the least total of WLB-ideal's candidates and Ulysses of every degree that splits the "
              "heads per TP group (ulysses-u{degree}, inside DP groups of WLB-LLM packing).", ""]
    return "\n".join(lines) + "\n"


def write_report(results: list[dict], out_dir, name: str, *, title: str, command: str, assumption: dict,
                 paper: bool = False, plots: bool = True) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"command": command, "predictions": True, "assumptions": assumption, "configs": results}
    if paper:
        payload["paper_speedup_no_pp"] = {k: list(v) for k, v in PAPER_SPEEDUP_NO_PP.items()}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    (out / f"{name}.md").write_text(results_markdown(results, title=title, command=command,
                                                      assumption=assumption, paper=paper))
    files = [str(out / f"{name}.json"), str(out / f"{name}.md")]
    if plots:
        files += write_plots(results, out)
    return {"files": files}


def paper_report(out_dir, base: SimConfig = SimConfig(), *, profile=None, overrides=None, command: str = "",
                 eps_sweep=None, grid: dict | None = None, progress=None) -> dict:
    """Simulate the paper's grid (no PP) and write ``sim_paper_scale.{md,json}`` and plots into ``out_dir``."""
    g = {**PAPER_GRID, **(grid or {})}
    configs = expand(replace(base, tp=8, gpus_per_node=8), models=g["models"], dists=g["dists"],
                     max_doc_lens=g["max_doc_lens"], gpus=g["gpus"])
    results = simulate_many(configs, profile=profile, eps_sweep=eps_sweep, overrides=overrides, progress=progress)
    assumption = assumptions(configs, profile=profile, overrides=overrides)
    speedups = [r["speedup"] for r in results if r.get("speedup")]
    info = write_report(results, out_dir, "sim_paper_scale", title="Predicted speedup at the DistCA paper's scales (no pipeline parallelism)",
                        command=command, assumption=assumption, paper=True)
    info["speedup_range"] = [float(np.min(speedups)), float(np.max(speedups))] if speedups else None
    return info
