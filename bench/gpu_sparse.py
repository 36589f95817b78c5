#!/usr/bin/env python3
"""GPU check and benchmark of the sparse (vertical-slash) backend against flash.

1. Exactness: Triton kernels (bf16) against the CPU-twin math run on the GPU in
   float32 on the same values: forward out/lse, backward dq/dk/dv, relative
   error max|a - b| / max|b| <= 2e-2; the backward both ways (``SLASH_BACKWARD``:
   the Gluon pass where it runs, and the Triton passes). Cases: a packed batch with an estimated
   pattern (sparse, dense-short and sparse-long documents), CA-task shards of one
   document (partial first blocks, several tasks of one doc in one call; once with
   lengths that are multiples of 4, once with odd ones), and a vertical-heavy random
   pattern; GQA 32/8 x 128. Plus the float32 kernels
   (``--precision fp32``; 8/2 heads of 32) against the twin in float64, <= 1e-4.
2. Speed: one document of 128K (32 query / 8 KV heads of 128) and of 512K
   (8 / 2 heads, so dense flash stays within the time budget), bf16. q/k are
   RoPE-like synthetic: per head the query is the key direction rotated by a few
   fixed offsets (0 and 3 log-uniform ones in [256, L/2]) with a per-head
   sharpness, plus unit noise, plus 4 sink keys -- so attention has slashes at
   those offsets, a local band, sinks and noise. The pattern is estimated online
   (timed) at coverage 0.9 and 0.95. Reported: forward and backward time of sparse
   and flash, speedup, backward/forward ratio, work sparsity (1 - computed pairs /
   causal pairs, computed = slash tiles x 128^2 + gathered columns x 128). The
   backward kernels are tuned first (warps, stages, sub-tile per kernel). The
   backward is timed both ways: ``bwd`` the default (the Gluon pass on Hopper),
   ``bwd_triton`` the Triton passes.
3. Cost model: fits t = a * slash_tiles + b * bar_tiles + c per phase over the
   speed runs plus random patterns of different slash/vertical mix and CA-task
   shards; prints each sample's error and writes the coefficients
   (``sparse_cost_coefficients.json``, :class:`SparseCoefficients` format).

Usage: PYTHONPATH=src python3 bench/gpu_sparse.py --out DIR [--quick]
(about 2-3 minutes on one H200; --quick: small sizes, a smoke test).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pathlib
import platform
import sys
import time
import traceback
from unittest import mock

import numpy as np
import torch

from attnpool.bench.timing import cuda_median_s

from attnpool.kernels import flash
from attnpool.kernels import sparse as sk
from attnpool.sparse import SparseConfig, VerticalSlashPattern, estimate_vertical_slash
from attnpool.sparse.cost import SparseCoefficients, fit_coefficients

TOLERANCE = 2e-2
FP32_TOLERANCE = 1e-4
DEV = "cuda"


# --- inputs ---

def rope_qk(L, Hq, Hk, D, seed=0, sharp=(1.5, 3.5), peaks=3, noise=1.0, base=10000.0, dtype=torch.bfloat16):
    """RoPE-like synthetic q/k of one document (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    inv = (1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float64) / D))).to(DEV)
    G = Hq // Hk
    w = torch.randn(Hk, D, generator=g)
    u = w.repeat_interleave(G, 0) + 0.5 * torch.randn(Hq, D, generator=g)
    u = u / u.norm(dim=-1, keepdim=True) * math.sqrt(D)
    alpha = torch.linspace(sharp[0], sharp[1], Hq)
    offs = torch.exp(torch.empty(Hq, peaks).uniform_(math.log(256), math.log(max(L // 2, 512)), generator=g)).round()
    offs = torch.cat([torch.zeros(Hq, 1), offs], 1).to(DEV)
    wts = torch.cat([torch.ones(Hq, 1), 0.6 * torch.ones(Hq, peaks)], 1)
    vecs = [(alpha[:, None] * wts[:, m:m + 1] * u).to(DEV) for m in range(peaks + 1)]
    w = w.to(DEV)

    def rot(x, pos):
        ang = (pos.double()[..., None] * inv[None, None]).float()
        c, s = torch.cos(ang), torch.sin(ang)
        a, b = x[..., ::2], x[..., 1::2]
        return torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2)

    q = torch.empty(L, Hq, D, dtype=dtype, device=DEV)
    k = torch.empty(L, Hk, D, dtype=dtype, device=DEV)
    gd = torch.Generator(device=DEV).manual_seed(seed)
    step = 1 << 15
    for s0 in range(0, L, step):
        e = min(L, s0 + step)
        pos = torch.arange(s0, e, device=DEV)
        qa = rot(noise * torch.randn(e - s0, Hq, D, device=DEV, generator=gd), pos[:, None].expand(-1, Hq))
        for m, vec in enumerate(vecs):
            qa += rot(vec[None].expand(e - s0, -1, -1), pos[:, None] - offs[:, m][None, :])
        q[s0:e] = qa.to(dtype)
        k[s0:e] = rot(w[None] + noise * torch.randn(e - s0, Hk, D, device=DEV, generator=gd),
                      pos[:, None].expand(-1, Hk)).to(dtype)
    k[:4] += (3.0 * w[None]).to(dtype)
    return q, k


def cu(lengths):
    return torch.tensor([0] + np.cumsum(lengths).tolist(), dtype=torch.int32, device=DEV)


def time_cuda(fn, reps=3, warmup=1):
    return cuda_median_s(fn, warmup=warmup, reps=reps)


def rel(a, b):
    a, b = a.float(), b.float()
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("inf")
    a, b = a[fin], b[fin]
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) if b.numel() else 0.0


# --- 1. exactness ---

def exact_case(name, pattern, segs, seg_doc, Hq=32, Hk=8, D=128, seed=0, views=False, dtype=torch.bfloat16,
               tolerance=TOLERANCE):
    """``views``: q, k and v as strided views of larger tensors (the kernels' TMA descriptors must use
    the strides). The twin runs on the same values in float32, or float64 for float32 inputs."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    Tq, Tk = sum(s[0] for s in segs), sum(s[1] for s in segs)
    if views:
        q = torch.randn(Tq, Hq + 1, D, device=DEV, generator=g).to(dtype)[:, 1:]
        kv = torch.randn(Tk, 2, Hk, D, device=DEV, generator=g).to(dtype)
        k, v = kv[:, 0], kv[:, 1]
    else:
        q = torch.randn(Tq, Hq, D, device=DEV, generator=g).to(dtype)
        k = torch.randn(Tk, Hk, D, device=DEV, generator=g).to(dtype)
        v = torch.randn(Tk, Hk, D, device=DEV, generator=g).to(dtype)
    do = torch.randn(Tq, Hq, D, device=DEV, generator=g).to(dtype)
    cu_q, cu_k = cu([s[0] for s in segs]), cu([s[1] for s in segs])
    mq, mk = max(s[0] for s in segs), max(s[1] for s in segs)
    sd = None if seg_doc is None else torch.tensor(seg_doc, device=DEV)
    o, l = sk.forward(q, k, v, cu_q, cu_k, mq, mk, pattern=pattern, seg_doc=sd, impl="triton")
    f = lambda x: x.double() if dtype == torch.float32 else x.float()
    o_ref, l_ref = sk.forward(f(q), f(k), f(v), cu_q, cu_k, mq, mk, pattern=pattern, seg_doc=sd, impl="twin")
    g_ref = sk.backward(f(do), f(q), f(k), f(v), o_ref, l_ref, cu_q, cu_k, mq, mk, pattern=pattern, seg_doc=sd,
                        impl="twin")
    errs = {"out": rel(o, o_ref), "lse": rel(l, l_ref)}
    paths = {"": "triton"}
    if sk.gluon_problem(q, pattern.block) is None:
        paths = {"": "gluon", "triton ": "triton"}
    for prefix, path in paths.items():
        with slash_backward(path):
            grads = sk.triton_backward(do, q, k, v, o, l, cu_q, cu_k, mq, mk, pattern=pattern, seg_doc=sd)
        errs.update({prefix + name: rel(a, b) for name, a, b in zip(("dq", "dk", "dv"), grads, g_ref)})
    ok = all(e <= tolerance for e in errs.values())
    print(f"  {name:34s} " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()) + ("  ok" if ok else "  FAIL"), flush=True)
    return {"case": name, "backward": list(paths.values()), "errors": errs, "ok": ok}


def slash_backward(path):
    """``with slash_backward("triton"):`` runs the backward's slash tiles that way (sk.SLASH_BACKWARD)."""
    return mock.patch.object(sk, "SLASH_BACKWARD", path)


def exactness(quick):
    print("exactness (Triton bf16 vs twin fp32 on the same values):", flush=True)
    out = []
    # a) packed batch, estimated pattern: sparse, dense (short), sparse.
    lens = [2500, 700, 4096] if not quick else [1500, 300]
    q, k = rope_qk(sum(lens), 32, 8, 128, seed=1)
    c = cu(lens)
    cfg = SparseConfig(min_doc_len=1024, vertical_cap=256, slash_cap=256)
    pat = estimate_vertical_slash(q, k, c, c, cfg)
    out.append(exact_case("packed docs, estimated pattern", pat, [(L, L) for L in lens], None))
    # b) CA-task shards of one 5000-token document (partial blocks), two docs in one call.
    g = torch.Generator().manual_seed(3)
    pat2 = VerticalSlashPattern.random([5000, 3000], 32, 128, n_slash=6, n_vertical=300, generator=g, device=DEV)
    segs = [(1000, 1000), (1500, 2500), (2500, 5000), (700, 3000), (100, 1700)]
    out.append(exact_case("CA-task shards (partial blocks)", pat2, segs, [0, 0, 0, 1, 1]))
    out.append(exact_case("the same, q/k/v strided views", pat2, segs, [0, 0, 0, 1, 1], views=True))
    # c) vertical-heavy.
    pat3 = VerticalSlashPattern.random([3000], 32, 128, n_slash=0, n_vertical=1500, generator=g, device=DEV)
    out.append(exact_case("vertical-heavy random", pat3, [(3000, 3000)], None))
    # d) float32 (--precision fp32): IEEE products against float64, at head_dim 32: IEEE kernels compile for
    # minutes at 64 (bench/kernel_resources.py --dtype fp32 --head-dim 64 shows they fit).
    pat4 = VerticalSlashPattern.random([3000, 1200], 8, 128, n_slash=4, n_vertical=200, generator=g, device=DEV)
    out.append(exact_case("float32, shards, against float64", pat4, [(1000, 3000), (1200, 1200)], [0, 1], Hq=8,
                          Hk=2, D=32, dtype=torch.float32, tolerance=FP32_TOLERANCE))
    # e) shards of odd lengths: rows and shard starts off multiples of 4, as in training (the Gluon pass reads
    # LSE and delta by TMA, which takes only 16-byte aligned coordinates: sparse._tma_rows).
    pat5 = VerticalSlashPattern.random([5003, 3001], 32, 128, n_slash=6, n_vertical=300, generator=g, device=DEV)
    segs = [(1001, 1001), (1501, 2502), (2501, 5003), (701, 3001), (101, 1701)]
    out.append(exact_case("CA-task shards, odd lengths", pat5, segs, [0, 0, 0, 1, 1]))
    return out


# --- 2. speed, 3. cost samples ---

def run_sparse(q, k, v, do, cu_q, cu_k, mq, mk, pattern, seg_doc=None, reps=3):
    """Forward time, backward time, slash and bar tiles."""
    idx = sk.SparseIndex.build(pattern, cu_q, cu_k, q.shape[0], k.shape[0], mq, seg_doc)
    fwd = lambda: sk.forward(q, k, v, cu_q, cu_k, mq, mk, pattern=pattern, seg_doc=seg_doc, impl="triton", index=idx)
    o, l = fwd()
    t_f = time_cuda(fwd, reps)
    t_b = time_cuda(lambda: sk.triton_backward(do, q, k, v, o, l, cu_q, cu_k, mq, mk, pattern=pattern,
                                               seg_doc=seg_doc, index=idx), reps)
    n_sl, n_bar = idx.tiles()
    return t_f, t_b, int(n_sl), int(n_bar)


def tune_backward(q, k, v, do, c, L, pattern):
    """Pick warps and sub-tile per backward kernel on this pattern (per-kernel CUDA-event times)."""
    from triton.runtime.errors import OutOfResources

    idx = sk.SparseIndex.build(pattern, c, c, q.shape[0], k.shape[0], L)
    o, l = sk.forward(q, k, v, c, c, L, L, pattern=pattern, impl="triton", index=idx)
    results = {}
    launched = {}
    sk.triton_backward(do, q, k, v, o, l, c, c, L, L, pattern=pattern, index=idx, timings=launched)
    # The dQ pass is "dq" beside the Triton dK/dV pass, "dq_vertical" (the columns only) after the Gluon pass;
    # kernels the default path does not launch keep their committed CONFIG.
    for kernel, sub, label in (("dq", "SUB_N", "dq"), ("dq_vertical", "SUB_N", "dq_vertical"), ("dkdv", "SUB_M", "dkdv_slash"),
                               ("vert", "SUB_M", "dkdv_vertical")):
        if label not in launched:
            continue
        best = None
        for warps, stages, tile in itertools.product((4, 8), (1, 2), (32, 64)):  # 128: slower everywhere
            sk.CONFIG[kernel] = dict(num_warps=warps, num_stages=stages, **{sub: tile})
            name = f"{kernel} warps={warps} stages={stages} {sub}={tile}"
            t = {}
            run = lambda **kw: sk.triton_backward(do, q, k, v, o, l, c, c, L, L, pattern=pattern, index=idx, **kw)
            try:
                run()  # compile
            except OutOfResources as error:  # e.g. shared memory of this tile and stage count
                results[name] = str(error)
                continue
            for _ in range(2):
                run(timings=t)
            ms = t[label] / 2 * 1e3
            results[name] = ms
            if best is None or ms < best[0]:
                best = (ms, dict(sk.CONFIG[kernel]))
        if best is None:
            raise RuntimeError(f"no launch configuration of {kernel} fits this GPU: {results}")
        sk.CONFIG[kernel] = best[1]
        print(f"  tuned {kernel}: {best[1]} ({best[0]:.1f} ms)", flush=True)
    return results, {k: dict(v) for k, v in sk.CONFIG.items()}


def speed(quick, report):
    rows, samples = [], []
    configs = [(32768, 8, 2)] if quick else [(131072, 32, 8), (524288, 8, 2)]
    for L, Hq, Hk in configs:
        torch.cuda.empty_cache()
        q, k = rope_qk(L, Hq, Hk, 128, seed=0)
        g = torch.Generator(device=DEV).manual_seed(1)
        v = torch.randn(L, Hk, 128, device=DEV, generator=g).bfloat16()
        do = torch.randn(L, Hq, 128, device=DEV, generator=g).bfloat16()
        c = cu([L])
        reps = 2 if L > 200_000 else 3
        o, l = flash.forward(q, k, v, c, c, L, L)
        tf_dense = time_cuda(lambda: flash.forward(q, k, v, c, c, L, L), reps)
        tb_dense = time_cuda(lambda: flash.backward(do, q, k, v, o, l, c, c, L, L), reps)
        o = l = None  # freed before the next allocations
        pairs = Hq * L * (L + 1) / 2
        for cov in (0.9, 0.95):
            cfg = SparseConfig(coverage=cov)
            t_est = time_cuda(lambda: estimate_vertical_slash(q, k, c, c, cfg), 2)
            pat = estimate_vertical_slash(q, k, c, c, cfg)
            if "tuning" not in report:
                report["tuning"], report["kernel_config"] = tune_backward(q, k, v, do, c, L, pat)
            t_f, t_b, n_sl, n_bar = run_sparse(q, k, v, do, c, c, L, L, pat, reps=reps)
            with slash_backward("triton"):
                t_b_triton = run_sparse(q, k, v, do, c, c, L, L, pat, reps=reps)[1]
            parts = {}
            o, l = sk.forward(q, k, v, c, c, L, L, pattern=pat, impl="triton")
            sk.triton_backward(do, q, k, v, o, l, c, c, L, L, pattern=pat, timings=parts)
            o = l = None
            computed = n_sl * 128 * 128 + n_bar * 128 * 64
            row = dict(L=L, heads=f"{Hq}/{Hk}", coverage=cov, sparsity=1 - computed / pairs,
                       slash_tiles=n_sl, bar_tiles=n_bar, t_est=t_est, fwd=t_f, bwd=t_b,
                       fwd_dense=tf_dense, bwd_dense=tb_dense, speedup_fwd=tf_dense / t_f, speedup_bwd=tb_dense / t_b,
                       speedup_fwd_bwd=(tf_dense + tb_dense) / (t_f + t_b), bwd_over_fwd=t_b / t_f,
                       bwd_path="gluon" if sk.gluon_problem(q, pat.block) is None else "triton",
                       bwd_triton=t_b_triton, bwd_triton_over_fwd=t_b_triton / t_f,
                       bwd_kernels_ms={name: t * 1e3 for name, t in parts.items()})
            print(f"  L={L} cov={cov}: sparsity {row['sparsity']:.3f}, est {t_est*1e3:.1f} ms, "
                  f"fwd {t_f*1e3:.1f} ms (dense {tf_dense*1e3:.1f}), bwd {t_b*1e3:.1f} ms (dense {tb_dense*1e3:.1f}), "
                  f"bwd/fwd {t_b / t_f:.2f} (Triton passes {t_b_triton*1e3:.1f} ms, {t_b_triton / t_f:.2f}); bwd kernels " + ", ".join(f"{n} {t*1e3:.1f}" for n, t in parts.items()) + " ms",
                  flush=True)
            rows.append(row)
            samples.append(dict(kind=f"estimated L={L} cov={cov}", slash=n_sl, bars=n_bar, fwd=t_f, bwd=t_b))
            # CA-task shards of the same document: tail quarter and head half, one call.
            segs = [(L // 2, L // 2), (L // 4, L)]
            Tq = sum(s[0] for s in segs)
            qs = torch.cat([q[:L // 2], q[3 * L // 4:]])
            ks, vs = torch.cat([k[:L // 2], k]), torch.cat([v[:L // 2], v])
            t_f, t_b, n_sl, n_bar = run_sparse(qs, ks, vs, do[:Tq], cu([s[0] for s in segs]), cu([s[1] for s in segs]),
                                               L // 2, L, pat, torch.tensor([0, 0], device=DEV), reps=reps)
            samples.append(dict(kind=f"shards L={L} cov={cov}", slash=n_sl, bars=n_bar, fwd=t_f, bwd=t_b))
            pat = qs = ks = vs = None
        q = k = v = do = None
    return rows, samples


def mix_samples(quick):
    """Random patterns of different slash / vertical mix, for the cost fit."""
    out = []
    L, Hq, Hk = (16384, 8, 2) if quick else (65536, 32, 8)
    g = torch.Generator(device=DEV).manual_seed(5)
    q = torch.randn(L, Hq, 128, device=DEV, generator=g).bfloat16()
    k = torch.randn(L, Hk, 128, device=DEV, generator=g).bfloat16()
    v = torch.randn(L, Hk, 128, device=DEV, generator=g).bfloat16()
    do = torch.randn(L, Hq, 128, device=DEV, generator=g).bfloat16()
    c = cu([L])
    gh = torch.Generator().manual_seed(6)
    for n_slash, n_vert in ((8, 0), (64, 0), (0, 1024), (0, 3072), (24, 1024), (128, 2048)):
        pat = VerticalSlashPattern.random([L], Hq, 128, n_slash=n_slash, n_vertical=n_vert, generator=gh, device=DEV)
        t_f, t_b, n_sl, n_bar = run_sparse(q, k, v, do, c, c, L, L, pat)
        out.append(dict(kind=f"random L={L} slash={n_slash} vert={n_vert}", slash=n_sl, bars=n_bar, fwd=t_f, bwd=t_b))
        print(f"  {out[-1]['kind']}: slash tiles {n_sl}, bar tiles {n_bar}, fwd {t_f*1e3:.2f} ms, bwd {t_b*1e3:.2f} ms",
              flush=True)
    return out


def fit(samples):
    res = {}
    for phase in ("fwd", "bwd"):
        s = np.array([x["slash"] for x in samples], dtype=np.float64)
        b = np.array([x["bars"] for x in samples], dtype=np.float64)
        t = np.array([x[phase] for x in samples], dtype=np.float64)
        a_, b_, c_ = fit_coefficients(s, b, t)
        pred = a_ * s + b_ * b + c_
        err = np.abs(pred - t) / t
        res[phase] = dict(a=a_, b=b_, c=c_, mean_rel_error=float(err.mean()), max_rel_error=float(err.max()))
        for x, e in zip(samples, err):
            x[f"{phase}_fit_error"] = float(e)
    coef = SparseCoefficients(res["fwd"]["a"], res["fwd"]["b"], res["fwd"]["c"], res["bwd"]["a"], res["bwd"]["b"],
                              res["bwd"]["c"], source=f"bench/gpu_sparse.py on {torch.cuda.get_device_name()}")
    return res, coef


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for gpu_sparse.json and the fitted coefficients")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    args = parser.parse_args()
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                  command=" ".join(sys.argv), quick=args.quick)
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError:
        pass
    failed = False
    try:
        report["exactness"] = exactness(args.quick)
        failed |= not all(x["ok"] for x in report["exactness"])
    except Exception:
        traceback.print_exc()
        report["exactness_error"] = traceback.format_exc()
        failed = True
    print(f"[{time.time() - t0:.0f} s] speed:", flush=True)
    rows, samples = speed(args.quick, report)
    print(f"[{time.time() - t0:.0f} s] cost-model samples:", flush=True)
    samples += mix_samples(args.quick)
    fitted, coef = fit(samples)
    report.update(speed=rows, cost_samples=samples, cost_fit=fitted, coefficients=coef.to_json(),
                  seconds=time.time() - t0)
    (out_dir / "gpu_sparse.json").write_text(json.dumps(report, indent=2))
    (out_dir / "sparse_cost_coefficients.json").write_text(json.dumps(coef.to_json(), indent=2))

    print("\ncost fit (t = a*slash_tiles + b*bar_tiles + c, per head-tile):")
    for phase, r in fitted.items():
        print(f"  {phase}: a = {r['a']*1e9:.2f} ns, b = {r['b']*1e9:.2f} ns, c = {r['c']*1e6:.1f} us; "
              f"mean error {r['mean_rel_error']*100:.1f}%, max {r['max_rel_error']*100:.1f}%")
    print(f"\n{report['device']}, torch {torch.__version__}, {time.time() - t0:.0f} s; exactness "
          f"{'FAILED' if failed else 'ok'} (tolerance {TOLERANCE})")
    head = f"{'L':>7} {'heads':>5} {'cov':>5} {'sparsity':>8} {'est ms':>7} {'fwd ms':>8} {'dense':>8} {'x':>5} " \
           f"{'bwd ms':>8} {'dense':>8} {'x':>5} {'bwd/fwd':>7} {'fwd+bwd x':>9} {'Triton bwd/fwd':>14}"
    print(head)
    for r in rows:
        print(f"{r['L']:>7} {r['heads']:>5} {r['coverage']:>5} {r['sparsity']:>8.3f} {r['t_est']*1e3:>7.1f} "
              f"{r['fwd']*1e3:>8.1f} {r['fwd_dense']*1e3:>8.1f} {r['speedup_fwd']:>5.1f} {r['bwd']*1e3:>8.1f} "
              f"{r['bwd_dense']*1e3:>8.1f} {r['speedup_bwd']:>5.1f} {r['bwd_over_fwd']:>7.2f} {r['speedup_fwd_bwd']:>9.1f} "
              f"{r['bwd_triton_over_fwd']:>14.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
