#!/usr/bin/env python3
"""A/B of the sparse Triton kernels on one GPU: the working tree's against a former version.

    git show REV:src/attnpool/kernels/sparse_triton.py > sparse_triton_base.py
    PYTHONPATH=src python3 bench/sparse_kernel_ab.py --baseline sparse_triton_base.py --out $OUT

Without ``--baseline`` the baseline is the working tree's kernels at the committed ``CONFIG``: an A/B
of launch configurations alone. A baseline must take the launchers' arguments (the same kernel
signatures: REV no older than the Gluon pass, whose ``_bwd_dq`` gained ``SLASH`` and ``ACCUMULATED``); the
backward's slash tiles run as ``SLASH_BACKWARD`` says, in both variants.

Cases as in bench/gpu_sparse.py's speed section: one document of 128K (32/8 heads of 128) and of
512K (8/2), bf16, RoPE-like q/k, the pattern estimated at coverage 0.9 and 0.95; dQ in its own pass.
Each variant runs with its own launch configuration: the baseline with the committed ``CONFIG``
(tuned for it by bench/gpu_sparse.py), the working tree's tuned here per kernel (per-kernel CUDA
events on the first case, warps x pipeline stages x sub-tile). Timings then alternate between the
variants, round by round, and the medians are reported, with the backward/forward ratio of each.
The two variants' outputs and gradients are compared (they must agree to bf16 rounding).
About 3 minutes on one H200.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_sparse import DEV, cu, rel, rope_qk  # noqa: E402  (the same synthetic inputs)

from attnpool.kernels import sparse as sk  # noqa: E402
from attnpool.sparse import SparseConfig, estimate_vertical_slash  # noqa: E402

# Launch configurations tried for the working tree's kernels (kernel -> list of configs).
SWEEP = {
    "fwd": [dict(num_warps=w, num_stages=s) for w, s in itertools.product((4, 8), (2, 3))],
    "dq": [dict(num_warps=8, num_stages=s, SUB_N=n) for s, n in itertools.product((2, 3), (32, 64))]
    + [dict(num_warps=4, num_stages=2, SUB_N=64)],
    "dkdv": [dict(num_warps=8, num_stages=s, SUB_M=m) for s, m in itertools.product((1, 2, 3), (32, 64))],
    "vert": [dict(num_warps=w, num_stages=s, SUB_M=64) for w, s in ((4, 1), (4, 2), (8, 1))],
    "dq_vertical": [dict(num_warps=w, num_stages=s, SUB_N=64) for w, s in ((4, 1), (4, 2), (8, 1), (8, 2))],
}
# The dQ pass is timed as "dq" beside the Triton dK/dV pass, as "dq_vertical" after the Gluon pass (CONFIG's
# entries of the same names).
TIMING_NAME = {"dq": ("dq",), "dq_vertical": ("dq_vertical",), "dkdv": ("dkdv_slash",), "vert": ("dkdv_vertical",)}


def load_module(path):
    spec = importlib.util.spec_from_file_location("sparse_triton_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


class Variant:
    """A kernel module and its launch configuration, swapped into attnpool.kernels.sparse while it runs."""

    def __init__(self, name, module, config):
        self.name, self.module, self.config = name, module, {k: dict(v) for k, v in config.items()}

    def __enter__(self):
        self._saved = (sk._triton_module, {k: dict(v) for k, v in sk.CONFIG.items()})
        sk._triton_module = lambda: self.module
        sk.CONFIG.update({k: dict(v) for k, v in self.config.items()})
        return self

    def __exit__(self, *exc):
        sk._triton_module, saved = self._saved
        sk.CONFIG.clear()
        sk.CONFIG.update(saved)


def event_ms(fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def tune(variant, case):
    """Best configuration per kernel of ``variant`` on ``case`` (per-kernel event times, 2 runs each)."""
    from triton.runtime.errors import OutOfResources

    q, k, v, do, c, L, pat, idx = case
    log = {}
    with variant:
        o, lse = sk.forward(q, k, v, c, c, L, L, pattern=pat, impl="triton", index=idx)
        for kernel, configs in SWEEP.items():
            best = None
            for cfg in configs:
                sk.CONFIG[kernel] = dict(cfg)
                label = f"{kernel} " + " ".join(f"{a}={b}" for a, b in cfg.items())
                try:
                    if kernel == "fwd":
                        run = lambda: sk.forward(q, k, v, c, c, L, L, pattern=pat, impl="triton", index=idx)
                        run()
                        ms = statistics.median(event_ms(run) for _ in range(2))
                    else:
                        t = {}
                        run = lambda: sk.triton_backward(do, q, k, v, o, lse, c, c, L, L, pattern=pat, index=idx,
                                                         timings=t)
                        run()  # compile
                        t.clear()
                        for _ in range(2):
                            run()
                        timed = [name for name in TIMING_NAME[kernel] if name in t]
                        if not timed:  # not launched on this path (the Triton dK/dV pass beside the Gluon one)
                            break
                        ms = t[timed[0]] / 2 * 1e3
                except OutOfResources as error:
                    log[label] = str(error)
                    continue
                log[label] = ms
                if best is None or ms < best[0]:
                    best = (ms, dict(cfg))
            if best is None:
                print(f"  {kernel}: not launched", flush=True)
                continue
            sk.CONFIG[kernel] = best[1]
            variant.config[kernel] = best[1]
            print(f"  tuned {kernel}: {best[1]} ({best[0]:.2f} ms)", flush=True)
    return log


def make_case(L, Hq, Hk, coverage):
    q, k = rope_qk(L, Hq, Hk, 128, seed=0)
    g = torch.Generator(device=DEV).manual_seed(1)
    v = torch.randn(L, Hk, 128, device=DEV, generator=g).bfloat16()
    do = torch.randn(L, Hq, 128, device=DEV, generator=g).bfloat16()
    c = cu([L])
    pat = estimate_vertical_slash(q, k, c, c, SparseConfig(coverage=coverage))
    idx = sk.SparseIndex.build(pat, c, c, L, L, L)
    return q, k, v, do, c, L, pat, idx


def measure(variants, case, rounds):
    """Median forward and backward ms of each variant (alternating round by round), per-kernel
    backward ms, and the gradients of each variant's last run."""
    q, k, v, do, c, L, pat, idx = case
    times = {var.name: {"fwd": [], "bwd": []} for var in variants}
    kernels, results = {}, {}
    for r in range(rounds + 1):  # round 0 warms up (compiles) and is not counted
        for var in (variants if r % 2 == 0 else variants[::-1]):
            with var:
                fwd = lambda: sk.forward(q, k, v, c, c, L, L, pattern=pat, impl="triton", index=idx)
                o, lse = fwd()
                bwd = lambda: sk.triton_backward(do, q, k, v, o, lse, c, c, L, L, pattern=pat, index=idx)
                tf, tb = event_ms(fwd), event_ms(bwd)
                if r:
                    times[var.name]["fwd"].append(tf)
                    times[var.name]["bwd"].append(tb)
                if r == rounds:
                    t = {}
                    grads = sk.triton_backward(do, q, k, v, o, lse, c, c, L, L, pattern=pat, index=idx,
                                               timings=t)
                    kernels[var.name] = {name: x * 1e3 for name, x in t.items()}
                    results[var.name] = (o, lse) + tuple(grads)
    med = {name: {p: statistics.median(x) for p, x in ts.items()} for name, ts in times.items()}
    return med, kernels, results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a former attnpool/kernels/sparse_triton.py (default: the working "
                                           "tree's, at the committed CONFIG)")
    parser.add_argument("--out", required=True, help="directory for sparse_kernel_ab.json")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per case (default: %(default)s)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from attnpool.kernels import sparse_triton

    base = Variant("baseline", load_module(args.baseline) if args.baseline else sparse_triton, sk.CONFIG)
    new = Variant("new", sparse_triton, sk.CONFIG)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, command=" ".join(sys.argv),
                  baseline_config=base.config, cases=[])
    rows = []
    for L, Hq, Hk in ((131072, 32, 8), (524288, 8, 2)):
        for coverage in (0.9, 0.95):
            torch.cuda.empty_cache()
            case = make_case(L, Hq, Hk, coverage)
            if "tuning" not in report:
                print(f"[{time.time() - t0:.0f} s] tuning the working tree's kernels on L={L} cov={coverage}",
                      flush=True)
                report["tuning"] = tune(new, case)
                report["new_config"] = new.config
            med, kernels, results = measure([base, new], case, args.rounds if L < 300_000 else 3)
            agree = {name: rel(a, b) for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), results["new"],
                                                              results["baseline"])}
            row = dict(L=L, heads=f"{Hq}/{Hk}", coverage=coverage, ms=med, bwd_kernels_ms=kernels,
                       bwd_over_fwd={n: m["bwd"] / m["fwd"] for n, m in med.items()}, new_vs_baseline=agree)
            rows.append(row)
            print(f"[{time.time() - t0:.0f} s] L={L} cov={coverage}: " + "; ".join(
                f"{n} fwd {m['fwd']:.1f} bwd {m['bwd']:.1f} ms (x{m['bwd'] / m['fwd']:.2f})" for n, m in med.items())
                + "; kernels new " + ", ".join(f"{a} {b:.1f}" for a, b in kernels["new"].items())
                + "; agreement " + ", ".join(f"{a} {b:.1e}" for a, b in agree.items()), flush=True)
            del case, results
    report["cases"] = rows
    (out_dir / "sparse_kernel_ab.json").write_text(json.dumps(report, indent=2))
    print(f"\n{report['device']}, torch {torch.__version__}, {time.time() - t0:.0f} s; medians (ms)")
    print(f"{'L':>7} {'cov':>5} {'fwd base':>9} {'fwd new':>8} {'bwd base':>9} {'bwd new':>8} "
          f"{'bwd/fwd base':>12} {'bwd/fwd new':>11} {'max rel diff':>12}")
    for r in rows:
        b, n = r["ms"]["baseline"], r["ms"]["new"]
        print(f"{r['L']:>7} {r['coverage']:>5} {b['fwd']:>9.1f} {n['fwd']:>8.1f} {b['bwd']:>9.1f} {n['bwd']:>8.1f} "
              f"{r['bwd_over_fwd']['baseline']:>12.2f} {r['bwd_over_fwd']['new']:>11.2f} "
              f"{max(r['new_vs_baseline'].values()):>12.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
