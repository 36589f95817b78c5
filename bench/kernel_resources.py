#!/usr/bin/env python3
"""Registers, spills and shared memory of the sparse Triton kernels, compiled offline for a CUDA GPU.

Compiles every launch of the sparse backend at its ``CONFIG`` for the given compute capability, on this
machine (no GPU needed: ``attnpool.kernels.sparse.compile_offline``), and prints what each would use:
registers per thread, its stack frame (bytes per thread; these kernels use the stack only for register
spills), and shared memory per block against Hopper's 227 KB. ``cuobjdump``, which reads the registers and stack from the binary,
ships with Triton.

    PYTHONPATH=src python3 bench/kernel_resources.py [--capability 9.0] [--head-dim 128] [--group 4] [--dtype bf16]
        [--vertical-chunk 64] [--beyond-limits]

The launchers refuse what ``launch_problem`` knows cannot fit (e.g. head_dim 256 in bf16); ``--beyond-limits``
compiles it anyway, to show why.

(float32 kernels take minutes each to compile.)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

from attnpool.errors import ConfigError
from attnpool.kernels import sparse as sk

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def resources(cubin: bytes, cuobjdump: str) -> dict:
    """Registers and stack frame (bytes per thread) of the one kernel in ``cubin``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    return {key: int(re.search(rf"\b{key}:(\d+)", out).group(1)) for key in ("REG", "STACK")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capability", default="9.0", help="compute capability, major.minor (default: %(default)s)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension (default: %(default)s)")
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (default: %(default)s)")
    parser.add_argument("--vertical-chunk", type=int, default=sk.VERTICAL_CHUNK,
                        help="vertical columns per kernel step (default: %(default)s)")
    parser.add_argument("--beyond-limits", action="store_true",
                        help="compile even launches that the launchers refuse (launch_problem)")
    args = parser.parse_args()
    if args.beyond_limits:
        sk.launch_problem = lambda *args, **kwargs: None
    major, minor = (int(x) for x in args.capability.split("."))
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    try:
        compiled = sk.compile_offline((major, minor), head_dim=args.head_dim, group=args.group,
                                      chunk=args.vertical_chunk, dtype=DTYPES[args.dtype])
    except ConfigError as error:
        print(f"the launchers refuse this: {error} (--beyond-limits compiles it anyway)", file=sys.stderr)
        return 2
    print(f"sm_{major}{minor}, head_dim {args.head_dim}, group {args.group}, vertical chunk {args.vertical_chunk}, "
          f"{args.dtype}, Triton {triton.__version__}")
    print(f"{'launch':>11} {'warps':>5} {'stages':>6} {'registers':>9} {'stack frame B':>13} {'shared KB':>9}")
    for name, kernel in compiled.items():
        r = resources(kernel.asm["cubin"], cuobjdump)
        fits = "" if kernel.metadata.shared <= sk.HOPPER_SHARED_MEMORY else "  over Hopper's 227 KB"
        print(f"{name:>11} {kernel.metadata.num_warps:>5} {kernel.metadata.num_stages:>6} {r['REG']:>9} "
              f"{r['STACK']:>13} {kernel.metadata.shared / 1024:>9.1f}{fits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
