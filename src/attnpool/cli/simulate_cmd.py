"""``attnpool simulate``: predicted step times of every strategy at cluster scale, from the real planner and a cost model."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace

from attnpool.cli.common import parse_size
from attnpool.console import text_console
from attnpool.data.lengths import DISTRIBUTIONS, check_length_list
from attnpool.errors import ConfigError, read_json_file
from attnpool.kernels.names import GPU_BACKENDS
from attnpool.model.config import MODEL_PRESETS
from attnpool.plan.cost import TOP_LEVEL_BACKEND
from attnpool.sim.costs import DEFAULT_INTER, DEFAULT_INTRA, load_sim_costs
from attnpool.sim.simulate import (DEFAULT_EPS_SWEEP, STRATEGY_GROUPS, SimConfig, assumptions, check_eps, expand,
                                   simulate_config, simulate_many)
from attnpool.sim.steptime import PINGPONG_SCHEDULES


def _list(item_type, what):
    def parse(text: str):
        try:
            values = [item_type(x) for x in str(text).split(",") if x.strip()]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what} ({exc})") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{text!r}: need at least one {what}")
        return values
    return parse


def add_parser(sub) -> None:
    p = sub.add_parser(
        "simulate", help="predict step times of local, wlb, percp, ulysses and cad on any number of GPUs from a calibrated "
                         "cost model",
        description="Sample batches with the paper's recipe, lay them out, plan them with the real planner and time "
                    "every strategy with the cost model (kernel table, linear time per token, network). Comma lists "
                    "sweep: one configuration per combination of --model, --dist, --max-doc-len and --gpus.")
    p.add_argument("--model", type=_list(str, "model presets"), default=None,
                   help=f"model preset(s): {', '.join(k for k in MODEL_PRESETS if k != 'tiny')} (default llama3-8b)")
    p.add_argument("--layers", type=int, default=None, help="override the preset's number of layers (reduced-depth runs)")
    p.add_argument("--sliding-window", type=parse_size, default=None,
                   help="a sliding window of this many keys, e.g. 4K, in every layer or those --layer-types marks")
    p.add_argument("--layer-types", default=None, help='which layers slide: a pattern "S/F" of S sliding layers then F '
                                                       'full ones, repeated (Gemma 3: 5/1; default: every layer)')
    p.add_argument("--recompute", default="none", choices=("none", "linear", "full"),
                   help="linear: activation checkpointing of the linear parts, as attnpool train's keep_attention; "
                        "full: of whole layers (core attention's forward runs again too), as its full")
    p.add_argument("--pingpong-schedule", default="distca", choices=PINGPONG_SCHEDULES,
                   help="ping-pong's order across layers: distca (a nano-batch's MLP runs with its next layer's QKV "
                        "projection, behind which the other's dispatch runs; the default) or layerwise (every "
                        "nano-batch's layer ends before the next begins, as attnpool train runs it)")
    p.add_argument("--gpus", type=_list(int, "GPU counts"), default=None, help="number(s) of GPUs (default 64)")
    p.add_argument("--tp", type=int, default=8, help="tensor-parallel size inside a node; an attention server is one TP group (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--tokens-per-gpu", type=parse_size, default=parse_size("64K"),
                   help="tokens per GPU; a server (TP group) holds tp x this (default 64K)")
    p.add_argument("--dist", type=_list(str, "distributions"), default=None,
                   help=f"length distribution(s): {', '.join(DISTRIBUTIONS)} or a JSON file (default prolong)")
    p.add_argument("--max-doc-len", type=_list(parse_size, "sizes"), default=None,
                   help="maximum document length(s), e.g. 128K,512K (default 512K)")
    p.add_argument("--strategies", type=_list(str, "strategies"), default=list(STRATEGY_GROUPS),
                   help="any of local,wlb,percp,ulysses,cad (default all; WLB-ideal needs wlb and/or percp, "
                        "the best baseline any of wlb, percp, ulysses)")
    p.add_argument("--batches", type=int, default=30, help="batches per configuration (default 30, as in the paper)")
    p.add_argument("--seed", type=int, default=0, help="batch sampling seed (default 0)")
    p.add_argument("--eps", type=float, default=0.02, help="cad's tolerance: max/mean server load <= 1 + eps (default 0.02)")
    p.add_argument("--eps-sweep", type=_list(float, "numbers"), nargs="?", const=list(DEFAULT_EPS_SWEEP), default=None,
                   help=f"also plan cad at these tolerances (alone: {','.join(map(str, DEFAULT_EPS_SWEEP))})")
    p.add_argument("--cp", type=_list(int, "CP degrees"), default=None,
                   help="CP degrees for percp / WLB-ideal (default every divisor of the number of servers)")
    p.add_argument("--memory-cap", type=float, default=1.1, help="WLB-LLM token cap relative to the budget (default 1.1)")
    p.add_argument("--balanced-layout", action="store_true",
                   help="also local and cad over attnpool train's layout balanced (equal tokens, whole documents placed "
                        "to even out attention first): local-balanced, cad-balanced, cad-balanced-serial")
    p.add_argument("--elongate", default="auto", help="length multiplier; 'auto' = max-doc-len / 64K for pretrain, 1 otherwise (paper)")
    p.add_argument("--no-upsample", action="store_true", help="draw documents plainly instead of the paper's long-document up-sampling")
    p.add_argument("--batch-file", help="JSON list of batches (lists of document lengths) instead of sampling")
    p.add_argument("--profile", help="profile / cost-table JSON (default: the packaged H200 table + built-in assumptions)")
    p.add_argument("--attention-backend", choices=GPU_BACKENDS, default=TOP_LEVEL_BACKEND,
                   help="the kernel whose table of the profile costs core attention (flash's stands in for one "
                        f"without a table; default {TOP_LEVEL_BACKEND})")
    p.add_argument("--linear-tflops", type=float, default=None, help="override linear-layer throughput per GPU, TFLOP/s")
    p.add_argument("--intra-bw", type=float, default=None,
                   help=f"intra-node bandwidth per GPU, GB/s (default: profile, else {DEFAULT_INTRA.bandwidth / 1e9:.0f})")
    p.add_argument("--intra-latency-us", type=float, default=None, help=f"intra-node latency per collective, us (default: profile, else {DEFAULT_INTRA.latency * 1e6:.0f})")
    p.add_argument("--inter-bw", type=float, default=None,
                   help=f"inter-node bandwidth per GPU, GB/s (default {DEFAULT_INTER.bandwidth / 1e9:.0f}, the paper's assumption)")
    p.add_argument("--inter-latency-us", type=float, default=None,
                   help=f"inter-node latency per collective, us (default {DEFAULT_INTER.latency * 1e6:.0f})")
    p.add_argument("--hierarchical-exchange", action="store_true",
                   help="also cad with the hierarchical exchange (attnpool train's hierarchical_exchange), as "
                        "cad-hierarchical: KV into a node crosses once, a server there forwards it; "
                        "cad-hierarchical-serial the same without ping-pong")
    p.add_argument("--head-chunks", type=int, default=1,
                   help="core attention in this many groups of heads for local, wlb, cad and percp-plan (attnpool train's "
                        "head_chunks: one group's kernel while another's exchanges are on the wire; default 1)")
    p.add_argument("--price-bytes", action="store_true",
                   help="cad's planner weighs its moves' bytes against the balance they buy at the simulated link "
                        "inside a node (attnpool train's exchange_gibps set to it); default: balance whatever the bytes")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plot-dir", help="write speedup.png, breakdown.png (and eps_sweep.png) here")
    p.add_argument("--report", metavar="DIR",
                   help="simulate the paper's grid (8B and 34B, pretrain and prolong, 128K-512K, 64-512 GPUs; any of "
                        "--model/--dist/--max-doc-len/--gpus narrows it) and write sim_paper_scale.{md,json} + plots to DIR")
    p.set_defaults(func=run)


def _overrides(args) -> dict:
    out = {"attention_backend": args.attention_backend}
    # (either part of a link alone: the other stays the profile's measured one, or the default)
    for link in ("intra", "inter"):
        bw, lat = getattr(args, f"{link}_bw"), getattr(args, f"{link}_latency_us")
        if bw is not None:
            if not bw > 0:
                raise ConfigError(f"--{link}-bw", bw, "must be a positive bandwidth (GB/s per GPU)")
            out[f"{link}_bandwidth"] = bw * 1e9
        if lat is not None:
            if not lat >= 0:
                raise ConfigError(f"--{link}-latency-us", lat, "must be >= 0 microseconds")
            out[f"{link}_latency"] = lat * 1e-6
    if args.linear_tflops is not None:
        out["linear_tflops"] = args.linear_tflops
    return out


def _base(args) -> SimConfig:
    if args.elongate == "auto":
        elongate = None
    else:
        try:
            elongate = float(args.elongate)
        except ValueError:
            raise ConfigError("--elongate", args.elongate, "must be a number or 'auto'") from None
        if not elongate > 0:
            raise ConfigError("--elongate", args.elongate, "must be positive")
    for name in ("tp", "gpus_per_node", "batches"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), "must be positive")
    return SimConfig(layers=args.layers, sliding_window=args.sliding_window, layer_types=args.layer_types,
                     recompute=args.recompute, tp=args.tp, gpus_per_node=args.gpus_per_node, tokens_per_gpu=args.tokens_per_gpu,
                     batches=args.batches, seed=args.seed, eps=args.eps, strategies=tuple(dict.fromkeys(args.strategies)),
                     memory_cap=args.memory_cap, elongate=elongate, upsample=not args.no_upsample,
                     cp_degrees=tuple(args.cp) if args.cp else None, hierarchical=args.hierarchical_exchange,
                     balanced=args.balanced_layout, head_chunks=args.head_chunks, price_bytes=args.price_bytes,
                     pingpong_schedule=args.pingpong_schedule,
                     model=(args.model or ["llama3-8b"])[0], dist=(args.dist or ["prolong"])[0],
                     max_doc_len=(args.max_doc_len or [parse_size("512K")])[0], gpus=(args.gpus or [64])[0])


def _check_lists(args) -> None:
    for m in args.model or []:
        if m not in MODEL_PRESETS:
            raise ConfigError("--model", m, f"unknown preset; known: {', '.join(MODEL_PRESETS)}")
    for g in args.gpus or []:
        if g < 1:
            raise ConfigError("--gpus", g, "must be positive")
    for L in args.max_doc_len or []:
        if L < 1:
            raise ConfigError("--max-doc-len", L, "must be positive")
    check_eps(args.eps, "--eps")
    for e in args.eps_sweep or []:
        check_eps(e, "--eps-sweep")
    if args.batch_file and (len(args.dist or []) > 1 or len(args.max_doc_len or []) > 1):
        raise ConfigError("--batch-file", args.batch_file, "fixes the batches: do not sweep --dist or --max-doc-len with it")


def _load_batch_file(path: str) -> list[list[int]]:
    data = read_json_file("--batch-file", path)
    if not isinstance(data, list) or not data:
        raise ConfigError("--batch-file", path, "must hold a non-empty list of batches (lists of document lengths)")
    for i, batch in enumerate(data):
        check_length_list(f"--batch-file[{i}]", path, batch)
    return data


def run(args: argparse.Namespace) -> int:
    argv = sys.argv[sys.argv.index("simulate"):] if "simulate" in sys.argv else ["simulate", "(in-process call)"]
    command = "attnpool " + shlex.join(argv)
    _check_lists(args)
    base = _base(args)
    overrides = _overrides(args)
    progress = (lambda i, n, r: print(f"[{i}/{n}] {r['label']}: speedup "
                                      + (f"{r['speedup']:.3f}" if r.get("speedup") else "-")
                                      + f" ({r['wall_s']:.1f} s)", file=sys.stderr))
    if args.report:
        from attnpool.sim.report import paper_report

        grid = {k: v for k, v in (("models", args.model), ("dists", args.dist), ("max_doc_lens", args.max_doc_len),
                                  ("gpus", args.gpus)) if v}
        if args.tp != 8 or args.gpus_per_node != 8:
            raise ConfigError("--tp", args.tp, "the paper-scale report uses TP=8 on 8-GPU nodes; drop --tp/--gpus-per-node")
        info = paper_report(args.report, base, profile=args.profile, overrides=overrides, command=command,
                            eps_sweep=args.eps_sweep, grid=grid or None, progress=progress)
        print(json.dumps(info, indent=1) if args.json else
              f"wrote {', '.join(info['files'])}; predicted speedup {info['speedup_range']}")
        return 0
    configs = expand(base, models=args.model, dists=args.dist, max_doc_lens=args.max_doc_len, gpus=args.gpus)
    if args.batch_file:
        if len(configs) > 1:
            raise ConfigError("--batch-file", args.batch_file, "fixes the batches: simulate one --model and --gpus with it")
        batches = _load_batch_file(args.batch_file)
        costs = load_sim_costs(configs[0].model_config(), configs[0].model, args.profile, **overrides)
        results = [simulate_config(replace(configs[0], batches=len(batches)), costs, eps_sweep=args.eps_sweep,
                                   doc_batches=batches)]
    else:
        results = simulate_many(configs, profile=args.profile, eps_sweep=args.eps_sweep, overrides=overrides,
                                progress=progress if len(configs) > 1 else None)
    assumption = assumptions(configs, profile=args.profile, overrides=overrides)
    plots = []
    if args.plot_dir:
        from attnpool.sim.plots import write_plots

        plots = write_plots(results, args.plot_dir)
    if args.json:
        out = {"command": command, "predictions": True, "assumptions": assumption, "configs": results,
               "speedup": results[0]["speedup"] if len(results) == 1 else {r["label"]: r["speedup"] for r in results}}
        if plots:
            out["plots"] = plots
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        print_tables(results, assumption)
        if plots:
            print(f"plots: {', '.join(plots)}")
    return 0


def print_tables(results: list[dict], assumption: dict) -> None:
    from rich.table import Table

    console = text_console()
    for r in results:
        wi = r.get("wlb_ideal")
        sp = r.get("speedup")
        title = (f"{r['label']}: {r['servers']} servers (TP groups) x {r['tokens_per_server']:,} tokens, "
                 f"{r['batches']} batches, ~{r['num_docs_mean']:.0f} docs/batch (longest {r['longest_doc']:,})")
        t = Table(title=title, caption=(f"WLB-ideal = {wi['strategy']} (DP {wi['dp']} x CP {wi['cp']}); " if wi else "")
                  + (f"speedup of cad over WLB-ideal: {sp:.3f}x" if sp else "no speedup (needs cad and wlb/percp)")
                  + (f"; over the best baseline ({r['best_baseline']['strategy']}): "
                     f"{r['speedup_vs_best_baseline']:.3f}x" if "speedup_vs_best_baseline" in r else "")
                  + f"; ideal step {r['ideal_step_s']:.2f} s")
        for col in ("strategy", "step (s)", "linear", "attention", "imbalance", "exposed comm", "attn max/mean",
                    "GiB moved/layer", "vs cad"):
            t.add_column(col, justify="left" if col == "strategy" else "right")
        cad = r["strategies"].get("cad", {}).get("step_s")
        for name, s in r["strategies"].items():
            mark = " *" if wi and name == wi["strategy"] else ""
            t.add_row(name + mark, f"{s['step_s']:.2f}", f"{s['linear_s']:.2f}", f"{s['attention_s']:.2f}",
                      f"{s['imbalance_s']:.2f}", f"{s['comm_exposed_s']:.2f}", f"{s['attention_max_over_mean']:.3f}",
                      f"{s['bytes_moved'] / 2**30:.1f}", f"{s['step_s'] / cad:.3f}" if cad else "-")
        console.print(t)
        if r.get("eps_sweep"):
            e = Table(title=f"{r['label']}: cad tolerance sweep")
            for col in ("eps", "step (s)", "attn max/mean", "GiB moved/layer", "max GiB/server"):
                e.add_column(col, justify="right")
            for p in r["eps_sweep"]:
                e.add_row(f"{p['eps']:g}", f"{p['step_s']:.3f}", f"{p['attention_max_over_mean']:.3f}",
                          f"{p['bytes_moved'] / 2**30:.1f}", f"{p['max_bytes_per_server'] / 2**30:.2f}")
            console.print(e)
    if len(results) > 1:
        s = Table(title="cad over WLB-ideal (predicted)")
        for col in ("configuration", "WLB-ideal", "WLB-ideal (s)", "cad (s)", "speedup"):
            s.add_column(col, justify="left" if col == "configuration" else "right")
        for r in results:
            wi = r.get("wlb_ideal")
            s.add_row(r["label"], f"DP {wi['dp']} x CP {wi['cp']}" if wi else "-", f"{wi['step_s']:.2f}" if wi else "-",
                      f"{r['strategies']['cad']['step_s']:.2f}" if "cad" in r["strategies"] else "-",
                      f"{r['speedup']:.3f}x" if r.get("speedup") else "-")
        console.print(s)
    console.print("[dim]" + "; ".join(f"{k}: {v}" for k, v in assumption["sources"].items()) + "[/dim]")
