"""Timing of online vertical-slash estimation (``estimate_vertical_slash``, default config) on random q/k.

Cases: one long document, and a packed batch whose short documents stay dense.
"new": a static bound on the score chunks; "new+host": their exact count from host
lengths (``k_lens_host``, what the runtime passes). With ``--baseline FILE`` also a
former ``attnpool/sparse/pattern.py`` loaded from FILE (for instance
``git show c5361dd:src/attnpool/sparse/pattern.py > old.py``), and the patterns are compared.
``--repeat N``: each estimator (and the baseline) called N times more per case, host lengths or not:
how many of those calls chose another pattern than the first (the estimator should be deterministic).

    .venv/bin/python bench/sparse_estimation.py --device cpu
    python bench/sparse_estimation.py --device cuda --baseline old.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time

import torch

from attnpool.sparse import SparseConfig, estimate_vertical_slash

CASES = {  # (name, segment lengths)
    "1 x 128K": [131072],
    "1 x 256K": [262144],
    "64K + 250 x 256": [65536] + [256] * 250,
}


def timed(fn, device, reps):
    fn()  # warm-up (allocator, kernels)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def peak_mib(fn, device):
    """Memory the call allocates at its peak, above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def load_baseline(path):
    spec = importlib.util.spec_from_file_location("baseline_pattern", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.estimate_vertical_slash


def inputs(args, device, lengths):
    """Random q, k and cu_seqlens of one case (seed 0)."""
    dtype = getattr(torch, args.dtype)
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(sum(lengths), args.heads, args.dim, generator=g, device=device).to(dtype)
    k = torch.randn(sum(lengths), args.kv_heads, args.dim, generator=g, device=device).to(dtype)
    c = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), device=device, dtype=torch.int32)
    return q, k, c


def same_pattern(a, b) -> bool:
    return all(torch.equal(getattr(a, n), getattr(b, n)) for n in ("slash", "vert", "n_vert", "dense"))


def bench_full(args, device, cfg):
    base = load_baseline(args.baseline) if args.baseline else None
    print(f"whole estimator: heads {args.heads}/{args.kv_heads}, dim {args.dim}, {args.dtype}, "
          f"median of {args.reps} (ms)")
    print(f"{'case':24s} {'T_k':>8s} {'old':>10s} {'new':>10s} {'new+host':>10s} {'speedup':>8s} {'+host':>8s} same"
          f" {'peak MiB old':>12s} {'new':>6s} {'new+host':>8s}")
    for name, lengths in CASES.items():
        T = sum(lengths)
        q, k, c = inputs(args, device, lengths)
        new = lambda: estimate_vertical_slash(q, k, c, c, cfg, chunk=args.chunk)
        host = lambda: estimate_vertical_slash(q, k, c, c, cfg, chunk=args.chunk, k_lens_host=lengths)
        t_new = timed(new, device, args.reps)
        t_host = timed(host, device, args.reps)
        t_old, same, m_old = float("nan"), "-", float("nan")
        m_new, m_host = peak_mib(new, device), peak_mib(host, device)
        if base is not None:
            old = lambda: base(q, k, c, c, cfg, chunk=args.chunk)
            t_old = timed(old, device, args.reps)
            m_old = peak_mib(old, device)
            a = old()
            same = all(same_pattern(a, b) for b in (new(), host()))
        print(f"{name:24s} {T:8d} {t_old:10.1f} {t_new:10.1f} {t_host:10.1f} {t_old / t_new:8.1f} "
              f"{t_old / t_host:8.1f} {same} {m_old:12.0f} {m_new:6.0f} {m_host:8.0f}", flush=True)


def repeat(args, device, cfg):
    estimators = {"new": estimate_vertical_slash}
    if args.baseline:
        estimators["old"] = load_baseline(args.baseline)
    print(f"\ndeterminism: of {args.repeat} more calls on the same input, how many chose another pattern")
    print(f"{'case':24s} " + " ".join(f"{name + host:>10s}" for name in estimators for host in ("", "+host")))
    for name, lengths in CASES.items():
        q, k, c = inputs(args, device, lengths)
        counts = []
        for estimator in estimators.values():
            for host in (None, lengths):
                first, *rest = [estimator(q, k, c, c, cfg, chunk=args.chunk, k_lens_host=host)
                                for _ in range(args.repeat + 1)]
                counts.append(sum(not same_pattern(first, p) for p in rest))
        print(f"{name:24s} " + " ".join(f"{n:>10d}" for n in counts), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--baseline", help="a former pattern.py to time the estimator against")
    ap.add_argument("--repeat", type=int, default=0, help="also count calls whose pattern differs from the first's")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = SparseConfig()
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
          f" ({torch.get_num_threads()} threads)")
    bench_full(args, device, cfg)
    if args.repeat:
        repeat(args, device, cfg)


if __name__ == "__main__":
    main()
