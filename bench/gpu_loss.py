#!/usr/bin/env python3
"""The LM head's loss kernels (``--loss-kernel``, attnpool.model.fused_loss) on one GPU: speed, memory and
exactness of each against a float64 reference.

1. Speed: Llama 3's head (dim 4096, vocabulary 128256) on ``--tokens`` tokens (default 128K), bf16, forward
   + backward of the summed loss, median of 5 after 2 warm-ups; the peak memory each adds.
2. Exactness: on 8,192 tokens, the loss and the gradients of the hidden states and of the weight against
   float64 on the same bf16 values (max error over the reference's max).

    PYTHONPATH=src python3 bench/gpu_loss.py --out OUT [--quick]   # liger_kernel importable for its rows
Writes OUT/gpu_loss.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from attnpool.bench.timing import cuda_median_s
from attnpool.model.fused_loss import LOSS_FUNCTIONS
from attnpool.model.loss_kernels import liger_problem
from attnpool.sizes import parse_size

DIM, VOCAB = 4096, 128256


def inputs(tokens: int, device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    h = torch.randn(tokens, DIM, device=device, generator=gen).bfloat16()
    w = (torch.randn(VOCAB, DIM, device=device, generator=gen) * 0.02).bfloat16()
    labels = torch.randint(0, VOCAB, (tokens,), device=device, generator=gen)
    labels[::13] = -100  # some ignored, as document ends are
    return h, w, labels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--tokens", default="128K", help="tokens of the speed test (default 128K)")
    ap.add_argument("--quick", action="store_true", help="16K tokens in the speed test (well under a minute)")
    opts = ap.parse_args()
    if opts.quick:
        opts.tokens = "16K"
    device = torch.device("cuda")
    kernels = [k for k in LOSS_FUNCTIONS if k != "liger" or liger_problem("cuda", 1) is None]
    result = dict(device=torch.cuda.get_device_name(device), torch=torch.__version__, kernels=kernels, speed={},
                  exactness={})

    h0, w0, y = inputs(parse_size(opts.tokens), device, 0)
    for name in kernels:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()

        def step():
            h.grad = w.grad = None
            LOSS_FUNCTIONS[name](h, w, y).backward()

        step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        seconds = cuda_median_s(step, warmup=2, reps=5)
        result["speed"][name] = dict(ms=1e3 * seconds, extra_peak_gib=(torch.cuda.max_memory_allocated() - base) / 2**30)
        del h, w
    del h0, w0, y
    torch.cuda.empty_cache()

    h0, w0, y = inputs(8192, device, 1)
    hd, wd = h0.double().requires_grad_(), w0.double().requires_grad_()
    reference = torch.nn.functional.cross_entropy(hd @ wd.T, y, ignore_index=-100, reduction="sum")
    reference.backward()
    for name in kernels:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = LOSS_FUNCTIONS[name](h, w, y)
        loss.backward()
        result["exactness"][name] = dict(
            loss=abs(loss.item() - reference.item()) / abs(reference.item()),
            dh=((h.grad.double() - hd.grad).abs().max() / hd.grad.abs().max()).item(),
            dw=((w.grad.double() - wd.grad).abs().max() / wd.grad.abs().max()).item())
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "gpu_loss.json").write_text(json.dumps(result, indent=1))
    print(f"{result['device']}: the head {DIM} x {VOCAB} on {opts.tokens} tokens; errors against float64 on 8K tokens")
    print(f"  {'kernel':8s} {'fwd+bwd ms':>10s} {'extra GiB':>9s} {'loss':>8s} {'dh':>8s} {'dW':>8s}")
    for name in kernels:
        s, e = result["speed"][name], result["exactness"][name]
        print(f"  {name:8s} {s['ms']:10.1f} {s['extra_peak_gib']:9.1f} {e['loss']:8.1e} {e['dh']:8.1e} {e['dw']:8.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
