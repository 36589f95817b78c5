#!/usr/bin/env python3
"""RMSNorm on one GPU: the model's ``RMSNorm`` (PyTorch's ``rms_norm``) against the expression it replaced.

The replaced expression, kept here only to time it: x.float(), the mean of squares, rsqrt, a product,
a cast back and the weight product, each its own kernel. Both run forward and backward on
(tokens, 4096) bf16 activations with a bf16 weight, as under FSDP2's bf16 parameters; reported:
median CUDA time of forward+backward, the kernels each launches (torch.profiler), and the largest
difference of outputs and gradients against a float64 reference, next to bf16's resolution.

Usage: PYTHONPATH=src python3 bench/gpu_rmsnorm.py [--out DIR] [--quick]   (under a minute on one H200;
--quick: 32K tokens only, 3 timed runs)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from attnpool.bench.timing import cuda_median_s
from attnpool.model.llama import RMSNorm

DIM, EPS = 4096, 1e-5


def replaced_rmsnorm(x, weight, eps=EPS):
    """The model's RMSNorm before it used ``rms_norm`` (for timing only)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fwd_bwd(fn, x, weight, grad):
    x.grad = weight.grad = None
    fn(x, weight).backward(grad)


def kernels(fn, x, weight, grad):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fwd_bwd(fn, x, weight, grad)
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def errors(fn, x, weight, grad):
    """Max |a - ref| of out, dx, dw against float64, each over max |ref|."""
    xr, wr = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    ref = wr * xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + EPS)
    ref.backward(grad.double())
    xa, wa = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    out = fn(xa, wa)
    out.backward(grad)
    rel = lambda a, b: float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max())
    return {"out": rel(out, ref), "dx": rel(xa.grad, xr.grad), "dw": rel(wa.grad, wr.grad)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="directory for gpu_rmsnorm.json")
    parser.add_argument("--quick", action="store_true", help="32K tokens only, 3 timed runs")
    args = parser.parse_args()
    reps = 3 if args.quick else 10
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    norm = RMSNorm(DIM, EPS).cuda()
    model_rmsnorm = lambda x, w: torch.func.functional_call(norm, {"weight": w}, (x,))  # the module, our weight
    impls = {"replaced": replaced_rmsnorm, "model (rms_norm)": model_rmsnorm}
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for tokens in (32768,) if args.quick else (32768, 65536, 131072):
        x = torch.randn(tokens, DIM, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
        weight = (1 + 0.1 * torch.randn(DIM, device="cuda", generator=g)).bfloat16().requires_grad_()
        grad = torch.randn(tokens, DIM, device="cuda", generator=g, dtype=torch.bfloat16)
        for name, fn in impls.items():
            t = cuda_median_s(lambda: fwd_bwd(fn, x, weight, grad), warmup=2, reps=reps)
            rows.append(dict(tokens=tokens, impl=name, fwd_bwd_ms=t * 1e3, kernels=kernels(fn, x, weight, grad),
                             errors=errors(fn, x, weight, grad)))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; (tokens, {DIM}) bf16, forward+backward, "
          f"median of {reps}; errors against float64 (bf16 resolution 3.9e-3)")
    print(f"{'tokens':>7} {'impl':18} {'ms':>7} {'kernels':>7}  {'out err':>8} {'dx err':>8} {'dw err':>8}")
    for r in rows:
        e = r["errors"]
        print(f"{r['tokens']:>7} {r['impl']:18} {r['fwd_bwd_ms']:>7.2f} {len(r['kernels']):>7}  "
              f"{e['out']:>8.1e} {e['dx']:>8.1e} {e['dw']:>8.1e}")
    for name in impls:
        print(f"kernels of {name}: " + "; ".join(k[:60] for k in rows[[r['impl'] for r in rows].index(name)]["kernels"]))
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_rmsnorm.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(),
                                                              torch=torch.__version__, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
