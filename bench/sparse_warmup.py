#!/usr/bin/env python3
"""Triton compilations of the sparse kernels over the first steps of training: variants and seconds.

Replays the sparse kernel calls of the first training steps: every server's forward and backward under
`cad` plans of sampled batches (default: prolong, 4 servers, 64K tokens per server, 8 batches,
8/2 heads of 128, bf16, random vertical-slash patterns). It starts from an empty Triton cache, as a
fresh machine does. Reported per kernel module: the variants Triton compiled, the wall time of the
first pass over these calls, and that of a second pass over the same calls with everything compiled.
The difference is what compilation cost the first steps. With ``--baseline`` a former
``sparse_triton.py`` is replayed too, in the same process; each module has its own kernels and cache
entries, so its compilations start from zero as well.

    PYTHONPATH=src python3 bench/sparse_warmup.py --out DIR [--baseline OLD_sparse_triton.py]
"""

from __future__ import annotations

import os
import tempfile

# Before Triton is imported: an empty cache, so that every variant is compiled here.
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from sparse_kernel_ab import Variant, load_module  # noqa: E402

from attnpool.data.lengths import sample_batches  # noqa: E402
from attnpool.kernels import sparse as sk  # noqa: E402
from attnpool.plan import linear_table, plan_attention  # noqa: E402
from attnpool.sparse.pattern import VerticalSlashPattern  # noqa: E402

KERNELS = ("_fwd", "_bwd_delta", "_bwd_dq", "_bwd_dkdv_slash", "_bwd_dkdv_vert")


def server_calls(args):
    """One call per (batch, server) with tasks: (q, k, v, dout, cu_q, cu_k, max_q, max_k, pattern, seg_doc)."""
    g = torch.Generator().manual_seed(args.seed)
    calls = []
    for lens in sample_batches(args.dist, args.servers * args.tokens, args.batches, args.seed):
        table = linear_table(lens, args.servers, args.tokens)
        plan = plan_attention(table, "cad")
        for server in range(args.servers):
            doc, q_len, k_len = plan.kernel_segments(server)
            if not len(doc):
                continue
            docs = sorted(set(doc.tolist()))
            seg_doc = torch.tensor([docs.index(d) for d in doc.tolist()], device="cuda")
            pattern = VerticalSlashPattern.random([int(table.doc_len[d]) for d in docs], args.heads, 128,
                                                  n_slash=args.slash, n_vertical=args.vertical, generator=g,
                                                  device="cuda")
            T_q, T_k = int(q_len.sum()), int(k_len.sum())
            q = torch.randn(T_q, args.heads, 128, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(T_k, args.heads // 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            dout = torch.randn_like(q)
            cu = lambda x: torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
            calls.append((q, k, v, dout, cu(q_len.tolist()), cu(k_len.tolist()), int(q_len.max()),
                          int(k_len.max()), pattern, seg_doc))
    return calls


def replay(calls):
    """Wall seconds of forward + backward over all calls."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for q, k, v, dout, cu_q, cu_k, mq, mk, pattern, seg_doc in calls:
        out, lse = sk.forward(q, k, v, cu_q, cu_k, mq, mk, pattern=pattern, seg_doc=seg_doc, impl="triton")
        sk.backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, pattern=pattern, seg_doc=seg_doc, impl="triton")
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def variants(module):
    """Compiled variants per kernel of ``module`` on the current device."""
    dev = torch.cuda.current_device()
    return {name: len(getattr(module, name).device_caches[dev][0]) for name in KERNELS}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for sparse_warmup.json")
    parser.add_argument("--baseline", help="a former attnpool/kernels/sparse_triton.py, replayed first")
    parser.add_argument("--dist", default="prolong", help="length distribution (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=4, help="servers per batch (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per server (default: %(default)s)")
    parser.add_argument("--batches", type=int, default=8, help="batches replayed (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8, help="query heads; KV heads are a quarter (default: %(default)s)")
    parser.add_argument("--slash", type=int, default=32, help="random block diagonals per head (default: %(default)s)")
    parser.add_argument("--vertical", type=int, default=256, help="random columns per head (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    calls = server_calls(args)
    shapes = sorted({(c[0].shape[0], c[1].shape[0]) for c in calls})
    print(f"{len(calls)} server calls, {len(shapes)} distinct (T_q, T_k); Triton cache {os.environ['TRITON_CACHE_DIR']}",
          flush=True)
    from attnpool.kernels import sparse_triton

    modules = ([("baseline", load_module(args.baseline))] if args.baseline else []) + [("working tree", sparse_triton)]
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, command=" ".join(sys.argv),
                  args=vars(args), calls=len(calls), rows=[])
    for name, module in modules:
        with Variant(name, module, sk.CONFIG):
            first = replay(calls)
            compiled = variants(module)
            second = replay(calls)
        row = dict(module=name, variants=compiled, first_pass_s=first, second_pass_s=second)
        report["rows"].append(row)
        print(f"{name}: {sum(compiled.values())} variants ({compiled}), first pass {first:.1f} s, "
              f"second {second:.2f} s", flush=True)
    (out_dir / "sparse_warmup.json").write_text(json.dumps(report, indent=2))
    print(f"\n{report['device']}, {len(calls)} server calls (forward + backward)")
    print(f"{'module':>14} {'variants':>8} {'first pass s':>12} {'second pass s':>13} {'compile s':>9}")
    for r in report["rows"]:
        print(f"{r['module']:>14} {sum(r['variants'].values()):>8} {r['first_pass_s']:>12.1f} "
              f"{r['second_pass_s']:>13.2f} {r['first_pass_s'] - r['second_pass_s']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
