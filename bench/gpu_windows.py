#!/usr/bin/env python3
"""GPU check of sliding windows and soft-caps in the flash and fa4 kernels (issue 42).

1. Exactness. Unit-scale bf16 inputs; the reference backend runs in float64 on the same values. Segments
   as the CA-task layout calls the kernel (queries the tail of their keys): windows smaller than, equal to
   and larger than the segments, documents shorter than the window. flash with windows (it has no soft-cap);
   fa4 with windows, soft-caps (Gemma 2's 50, and 5, which caps often) and both. Forward out and lse,
   backward dq, dk, dv. Pass: max |backend - reference| <= 1e-2 x max(1, max |reference|) per tensor.
2. Speed on the 1K-shard layout: one document cut into 1K-token query shards, each a kernel segment with
   its keys copied (one call over every shard, as a server runs a document's shards that do not continue
   each other): causal (keys [0, e)) against a window of w keys (keys [max(0, a - w + 1), e)). TFLOP/s from
   the work each computes (causal pairs, windowed pairs), forward and forward+backward (3.5x the forward's
   FLOPs); the target is windowed >= 0.8x causal per unit of real work.

Usage (one H100/H200; flash_attn.cute importable, or unpacked into DIR as
../shared/recipes/fa4-on-the-device.md says):
    PYTHONPATH=src python3 bench/gpu_windows.py --site DIR --out OUT
    PYTHONPATH=src python3 bench/gpu_windows.py --device cpu --out OUT   # the reference stands in: checks the script
Writes OUT/gpu_windows.json and prints a short table last; exit 1 when an exactness check fails.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import site
import statistics
import sys
import time

import numpy as np
import torch

from attnpool.bench.timing import cuda_median_s
from attnpool.kernels import get_backend, reference
from attnpool.plan.documents import key_start, window_pairs

MAX_ABS = 1e-2
SEGMENTS = [(1, 1), (7, 7), (13, 29), (127, 255), (129, 129), (333, 1000), (3, 700), (1000, 1000), (900, 5000)]
KINDS = [(64, None), (128, None), (700, None), (4096, None), (None, 50.0), (None, 5.0), (256, 50.0)]


def cumulative(lengths, device) -> torch.Tensor:
    return torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32, device=device)


def median_s(fn, device, warmup=3, reps=7) -> float:
    if device.type == "cuda":
        return cuda_median_s(fn, warmup=warmup, reps=reps)
    times = []
    for i in range(warmup + reps):
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def backends(device):
    if device.type == "cpu":
        return {"flash": reference.BACKEND, "fa4": reference.BACKEND}
    return {name: get_backend(name, device) for name in ("flash", "fa4")}


def check(name, backend, window, softcap, device, n_q=32, n_kv=8, dim=128) -> dict:
    gen = torch.Generator().manual_seed(0)
    tq, tk = sum(s[0] for s in SEGMENTS), sum(s[1] for s in SEGMENTS)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, dout = (torch.randn(tq, n_q, dim, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(tk, n_kv, dim, generator=gen).to(dtype) for _ in range(2))
    args = (cumulative([s[0] for s in SEGMENTS], "cpu"), cumulative([s[1] for s in SEGMENTS], "cpu"),
            max(s[0] for s in SEGMENTS), max(s[1] for s in SEGMENTS))
    exact_backend = reference.BACKEND.for_kind(window, softcap)
    q64, k64, v64, d64 = (x.double() for x in (q, k, v, dout))
    out, lse = exact_backend.forward(q64, k64, v64, *args)
    want = (out, lse, *exact_backend.backward(d64, q64, k64, v64, out, lse, *args))
    bound = backend.for_kind(window, softcap)
    dev = [x.to(device) for x in (q, k, v, dout)]
    dargs = (args[0].to(device), args[1].to(device), *args[2:])
    out, lse = bound.forward(*dev[:3], *dargs)
    got = (out, lse, *bound.backward(dev[3], *dev[:3], out, lse, *dargs))
    errors = {}
    for label, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g, w = g.double().cpu(), w.double()
        finite = torch.isfinite(w)
        scale = max(1.0, float(w[finite].abs().max())) if finite.any() else 1.0
        errors[label] = float((g[finite] - w[finite]).abs().max()) / scale if finite.any() else 0.0
    return dict(backend=name, window=window, softcap=softcap, errors=errors,
                ok=all(e <= MAX_ABS for e in errors.values()))


def speed(name, backend, doc_len, shard, window, device, n_q=32, n_kv=8, dim=128) -> dict:
    a = np.arange(0, doc_len, shard)
    e = np.minimum(a + shard, doc_len)
    ks = key_start(a, window)
    q_len, k_len = e - a, e - ks
    kv_rows = torch.as_tensor(np.concatenate([np.arange(s, t) for s, t in zip(ks, e)]), device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q, dout = (torch.randn(doc_len, n_q, dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
    k_doc, v_doc = (torch.randn(doc_len, n_kv, dim, generator=gen, device=device, dtype=dtype) for _ in range(2))
    k, v = k_doc[kv_rows], v_doc[kv_rows]
    args = (cumulative(q_len, device), cumulative(k_len, device), int(q_len.max()), int(k_len.max()))
    bound = backend.for_kind(window, None)

    def forward():
        return bound.forward(q, k, v, *args)

    def forward_backward():
        out, lse = bound.forward(q, k, v, *args)
        return bound.backward(dout, q, k, v, out, lse, *args)

    fwd_flops = 4.0 * dim * n_q * float(window_pairs(a, e, window).sum())
    fwd_ms, fwd_bwd_ms = 1e3 * median_s(forward, device), 1e3 * median_s(forward_backward, device)
    row = dict(backend=name, doc_len=doc_len, shard=shard, window=window, fwd_ms=fwd_ms, fwd_bwd_ms=fwd_bwd_ms,
               fwd_tflops=fwd_flops / fwd_ms / 1e9, fwd_bwd_tflops=3.5 * fwd_flops / fwd_bwd_ms / 1e9,
               key_rows=int(k_len.sum()))
    return row  # (the tensors go with the function's frame)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--site", help="a folder of unpacked wheels to add to sys.path (FA4)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--doc-len", type=int, default=65536)
    parser.add_argument("--shard", type=int, default=1024)
    parser.add_argument("--windows", default="4096,1024")
    args = parser.parse_args(argv)
    if args.site:
        site.addsitedir(args.site)
        site.addsitedir(str(pathlib.Path(args.site) / "nvidia_cutlass_dsl" / "dsl_packages"))
    device = torch.device(args.device)
    doc_len = args.doc_len if device.type == "cuda" else 4096
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(command=" ".join(sys.argv), python=platform.python_version(), torch=torch.__version__,
                  gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", checks=[], speed=[])
    heads = dict(n_q=32, n_kv=8, dim=128) if device.type == "cuda" else dict(n_q=4, n_kv=2, dim=16)
    for name, backend in backends(device).items():
        for window, softcap in KINDS:
            if softcap is not None and not backend.takes_softcap:
                continue
            result["checks"].append(check(name, backend, window, softcap, device, **heads))
    windows = [int(w) for w in args.windows.split(",")]
    for name, backend in backends(device).items():
        for window in [None, *windows]:
            result["speed"].append(speed(name, backend, doc_len, args.shard, window, device, **heads))
    causal = {r["backend"]: r for r in result["speed"] if r["window"] is None}
    for r in result["speed"]:
        base = causal[r["backend"]]
        r["fwd_rate_vs_causal"] = r["fwd_tflops"] / base["fwd_tflops"]
        r["fwd_bwd_rate_vs_causal"] = r["fwd_bwd_tflops"] / base["fwd_bwd_tflops"]
    (out / "gpu_windows.json").write_text(json.dumps(result, indent=1))
    print("exactness (max |error| / max(1, max |reference|)):")
    for c in result["checks"]:
        worst = max(c["errors"].values())
        print(f"  {c['backend']:5s} window={c['window']!s:5s} softcap={c['softcap']!s:5s} {worst:.2e} "
              f"{'ok' if c['ok'] else 'FAIL'}")
    print(f"speed, {doc_len // 1024}K document in {args.shard}-token shards (TFLOP/s of real work):")
    print("  backend window   fwd    fwd+bwd  fwd/causal fwd+bwd/causal")
    for r in result["speed"]:
        print(f"  {r['backend']:6s} {r['window']!s:6s} {r['fwd_tflops']:6.1f} {r['fwd_bwd_tflops']:8.1f} "
              f"{r['fwd_rate_vs_causal']:9.2f} {r['fwd_bwd_rate_vs_causal']:12.2f}")
    return 0 if all(c["ok"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
