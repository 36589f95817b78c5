#!/usr/bin/env python3
"""Triton compilations of the sparse kernels over the first steps of training: variants and seconds.

Replays the sparse kernel calls of the first training steps: every server's forward and backward under
`cad` plans of sampled batches (default: prolong, 4 servers, 64K tokens per server, 8 batches, 8/2
heads of 128, bf16). As in the runtime, a server's sparse call holds the segments of documents of at
least ``min_doc_len`` tokens (8K); shorter ones go to the dense kernel and are left out here. Patterns
are random (``--slash`` diagonals and ``--vertical`` columns per head), not estimated, so their table
widths are not those of a trained model's patterns.

Each kernel module (``--baseline``, a former ``sparse_triton.py`` that takes the launchers' arguments: one
from before the Gluon pass, whose ``_bwd_dq`` lacks ``SLASH`` and ``ACCUMULATED``, does not; then the working
tree's) runs in a process of its own with an empty Triton cache of its own, as on a fresh machine. The process first
builds every call's kernel index and pattern tables (no Triton), then times a first pass over the calls
(compiling what they need) and a second pass (all compiled). Reported per module: the variants Triton
compiled per kernel, both passes' wall time, and their difference, the compilation.

    PYTHONPATH=src python3 bench/sparse_warmup.py --out DIR [--baseline OLD_sparse_triton.py]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

KERNELS = ("_fwd", "_bwd_delta", "_bwd_dq", "_bwd_dkdv_slash", "_bwd_dkdv_vert")


def server_calls(args):
    """One sparse call per (batch, server) with long-document segments:
    (q, k, v, dout, cu_q, cu_k, max_q, max_k, pattern, seg_doc)."""
    import torch

    from attnpool.data.lengths import sample_batches
    from attnpool.plan import linear_table, plan_attention
    from attnpool.sparse.pattern import VerticalSlashPattern

    g = torch.Generator().manual_seed(args.seed)
    cu = lambda x: torch.tensor([0] + torch.tensor(x).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    calls = []
    for lens in sample_batches(args.dist, args.servers * args.tokens, args.batches, args.seed):
        table = linear_table(lens, args.servers, args.tokens)
        plan = plan_attention(table, "cad")
        for server in range(args.servers):
            doc, q_len, k_len = plan.kernel_segments(server)
            sparse = table.doc_len[doc] >= args.min_doc_len
            doc, q_len, k_len = doc[sparse], q_len[sparse], k_len[sparse]
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
            calls.append((q, k, v, torch.randn_like(q), cu(q_len.tolist()), cu(k_len.tolist()), int(q_len.max()),
                          int(k_len.max()), pattern, seg_doc))
    return calls


def measure_module(args):
    """In the child process: replay the calls through one kernel module and write its row as JSON."""
    import torch

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    from sparse_kernel_ab import Variant, load_module

    from attnpool.kernels import sparse as sk

    module = load_module(args.module) if args.module else sk._triton_module()
    calls = server_calls(args)
    indexes = []
    for q, k, v, dout, cu_q, cu_k, mq, mk, pattern, seg_doc in calls:  # everything a call needs but Triton
        indexes.append(sk.SparseIndex.build(pattern, cu_q, cu_k, q.shape[0], k.shape[0], mq, seg_doc))
        sk._pattern_args(pattern, q.device)

    def replay():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for (q, k, v, dout, cu_q, cu_k, mq, mk, pattern, seg_doc), idx in zip(calls, indexes):
            out, lse = sk.triton_forward(q, k, v, cu_q, cu_k, mq, mk, pattern=pattern, seg_doc=seg_doc, index=idx)
            sk.triton_backward(dout, q, k, v, out, lse, cu_q, cu_k, mq, mk, pattern=pattern, seg_doc=seg_doc,
                               index=idx)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    with Variant("module", module, sk.CONFIG):
        first = replay()
        dev = torch.cuda.current_device()
        compiled = {name: len(getattr(module, name).device_caches[dev][0]) for name in KERNELS}
        if sk.gluon_problem(calls[0][0], calls[0][8].block) is None:  # the backward's slash pass on Hopper
            from attnpool.kernels import sparse_gluon

            compiled["_bwd_slash (Gluon)"] = len(sparse_gluon._bwd_slash.device_caches[dev][0])
        second = replay()
    shapes = sorted({(c[0].shape[0], c[1].shape[0]) for c in calls})
    row = dict(module=args.module or "working tree", calls=len(calls), distinct_shapes=len(shapes),
               variants=compiled, first_pass_s=first, second_pass_s=second, device=torch.cuda.get_device_name(),
               torch=torch.__version__)
    pathlib.Path(args.child_out).write_text(json.dumps(row))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for sparse_warmup.json")
    parser.add_argument("--baseline", help="a former attnpool/kernels/sparse_triton.py, replayed first")
    parser.add_argument("--dist", default="prolong", help="length distribution (default: %(default)s)")
    parser.add_argument("--servers", type=int, default=4, help="servers per batch (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens per server (default: %(default)s)")
    parser.add_argument("--batches", type=int, default=8, help="batches replayed (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=8,
                        help="query heads, a multiple of 4; KV heads are a quarter (default: %(default)s)")
    parser.add_argument("--slash", type=int, default=32, help="random block diagonals per head (default: %(default)s)")
    parser.add_argument("--vertical", type=int, default=256, help="random columns per head (default: %(default)s)")
    parser.add_argument("--min-doc-len", type=int, default=8192,
                        help="documents shorter than this go to the dense kernel (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches and patterns (default: %(default)s)")
    parser.add_argument("--module", help=argparse.SUPPRESS)  # child process: the module to replay
    parser.add_argument("--child-out", help=argparse.SUPPRESS)  # child process: where its row goes
    args = parser.parse_args()
    if args.heads < 4 or args.heads % 4:
        parser.error(f"--heads must be a positive multiple of 4, got {args.heads}")
    if args.child_out:
        measure_module(args)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = dict(command=" ".join(sys.argv), args=vars(args), rows=[])
    passed = [a for a in sys.argv[1:]]
    for module in ([args.baseline] if args.baseline else []) + [None]:
        cache = tempfile.mkdtemp(prefix="triton-cache-")
        with tempfile.NamedTemporaryFile(suffix=".json") as row_file:
            cmd = [sys.executable, __file__, *passed, "--child-out", row_file.name]
            cmd += ["--module", str(pathlib.Path(module).resolve())] if module else []
            try:
                subprocess.run(cmd, env=dict(os.environ, TRITON_CACHE_DIR=cache), check=True)
            finally:
                shutil.rmtree(cache, ignore_errors=True)
            row = json.loads(pathlib.Path(row_file.name).read_text())
        report["rows"].append(row)
        print(f"{row['module']}: {sum(row['variants'].values())} variants ({row['variants']}), first pass "
              f"{row['first_pass_s']:.1f} s, second {row['second_pass_s']:.2f} s", flush=True)
    (out_dir / "sparse_warmup.json").write_text(json.dumps(report, indent=2))
    first = report["rows"][0]
    print(f"\n{first['device']}, {first['calls']} sparse server calls ({first['distinct_shapes']} distinct "
          f"(T_q, T_k)), forward + backward, each module from an empty Triton cache")
    print(f"{'module':>14} {'variants':>8} {'first pass s':>12} {'second pass s':>13} {'compile s':>9}")
    for r in report["rows"]:
        name = "baseline" if r["module"] != "working tree" else r["module"]
        print(f"{name:>14} {sum(r['variants'].values()):>8} {r['first_pass_s']:>12.1f} "
              f"{r['second_pass_s']:>13.2f} {r['first_pass_s'] - r['second_pass_s']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
