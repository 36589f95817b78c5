#!/usr/bin/env python3
"""GPU check of the distributed core-attention runtime (NCCL, a GPU kernel backend, bf16).

exact  (under torchrun, 2 or 4 GPUs): outputs and gradients of core_attention for
       local / percp / cad plans against a float32 single-process reference on
       the same bf16 values (whole documents, reference backend); bytes counted
       against the plan's prediction. Pass: relative error <= 2e-2.
fused  (one GPU): all CA-tasks each server of a cad plan runs, one flash call per
       server, against whole-document attention of the same documents in one
       call; TFLOP/s from causal pairs (forward 4*D*H_q*pairs, backward 2.5x).
       Target: fused >= 90% of whole-document throughput at 128K tokens per GPU.

Usage on the GPU machine (from the repository root):
  PYTHONPATH=src torchrun --nproc_per_node 4 bench/gpu_runtime.py exact --out DIR
  PYTHONPATH=src python3 bench/gpu_runtime.py fused --out DIR
--attention-backend (default auto: fa4 where flash_attn.cute runs, else flash) picks the kernel;
--quick (under 2 minutes): exact one case and one head layout, fused 32K tokens per server, one
batch, fewer repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib

import numpy as np
import torch

from attnpool.bench.timing import cuda_median_s
import torch.distributed as dist

from attnpool import core_attention, plan_attention
from attnpool.comm import comm_stats
from attnpool.data.lengths import sample_batches
from attnpool.kernels import attention, get_backend
from attnpool.plan import AttentionShape, PieceTable, causal_pairs, linear_layout
from attnpool.plan.cost import attention_flops

TOLERANCE = 2e-2


def rel_err(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def doc_tensors(doc_lens, heads, dim, seed, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    T = sum(doc_lens)
    return [torch.randn(T, h, dim, generator=g).to(device=device, dtype=torch.bfloat16) for h in heads]


def exact(out_dir: str, backend_name: str, quick: bool) -> int:
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    rng = np.random.default_rng(7)
    cases = {
        "mixed": rng.integers(1, 6000, size=4 * world).tolist() + [world * 5000 + 17],
        "prolong-sample": sample_batches("prolong", world * 16384, 1, 1)[0],
    }
    if quick:
        cases.pop("prolong-sample")
    backend = get_backend(backend_name, dev, torch.bfloat16)
    records = []
    for case, lens in cases.items():
        pieces = linear_layout(lens, world)
        table = PieceTable.from_pieces(pieces)
        doc_start = np.r_[0, np.cumsum(lens)[:-1]]
        rows = torch.as_tensor(np.concatenate([np.arange(doc_start[p.doc_id] + p.start, doc_start[p.doc_id] + p.end)
                                               for p in pieces[rank]]), device=dev)
        for n_q, n_kv in ((32, 8),) if quick else ((32, 8), (16, 16)):
            q, k, v, dout = doc_tensors(lens, (n_q, n_kv, n_kv, n_q), 128, zlib.crc32(case.encode()) + n_q, dev)
            # Reference: whole documents, float32, reference backend, autograd.
            cu = torch.as_tensor(np.r_[0, np.cumsum(lens)], dtype=torch.int32, device=dev)
            qr, kr, vr = (t.float().requires_grad_(True) for t in (q, k, v))
            out_ref, _ = attention(qr, kr, vr, cu, cu, max(lens), max(lens), backend="reference")
            out_ref.backward(dout.float())
            ref = {"out": out_ref.detach()[rows], "dq": qr.grad[rows], "dk": kr.grad[rows], "dv": vr.grad[rows]}
            del qr, kr, vr, out_ref
            for strategy in ("local", "percp", "cad"):
                plan = plan_attention(table, strategy, shape=AttentionShape(n_q, n_kv, 128, 2))
                ql, kl, vl = (t[rows].clone().requires_grad_(True) for t in (q, k, v))
                comm_stats.reset()
                out = core_attention(ql, kl, vl, plan, backend=backend)
                out.backward(dout[rows])
                torch.cuda.synchronize()
                errs = {"out": rel_err(out, ref["out"]), "dq": rel_err(ql.grad, ref["dq"]),
                        "dk": rel_err(kl.grad, ref["dk"]), "dv": rel_err(vl.grad, ref["dv"])}
                shape = AttentionShape(n_q, n_kv, 128, 2)
                remote = plan.task_server != plan.task_home
                x = plan.kv_transfers()
                predicted = (int(plan.task_len[remote & (plan.task_home == rank)].sum()) * shape.q_bytes
                             + int(x.length[(x.src != x.server) & (x.src == rank)].sum()) * shape.kv_bytes)
                sent = comm_stats.by_tag.get("dispatch", [0, 0, 0])[1]
                records.append(dict(case=case, heads=f"{n_q}/{n_kv}", strategy=strategy, rank=rank, world=world,
                                    errors=errs, bytes_sent=sent, bytes_predicted=predicted,
                                    ok=max(errs.values()) <= TOLERANCE and sent == predicted))
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    ok = all(r["ok"] for recs in gathered for r in recs)
    if rank == 0:
        flat = [r for recs in gathered for r in recs]
        with open(os.path.join(out_dir, f"runtime_exact_{world}gpu.json"), "w") as f:
            json.dump({"world": world, "torch": torch.__version__, "device": torch.cuda.get_device_name(),
                       "backend": backend.name, "quick": quick, "tolerance": TOLERANCE, "ok": ok, "records": flat},
                      f, indent=1)
        print(f"\nexactness on {world} GPUs, {backend.name} backend (bf16 vs float32 reference, worst over ranks):")
        print(f"{'case':16s} {'heads':6s} {'strategy':8s} {'out':>8s} {'dq':>8s} {'dk':>8s} {'dv':>8s}  bytes=plan")
        keys = sorted({(r["case"], r["heads"], r["strategy"]) for r in flat})
        for key in keys:
            rs = [r for r in flat if (r["case"], r["heads"], r["strategy"]) == key]
            worst = {n: max(r["errors"][n] for r in rs) for n in ("out", "dq", "dk", "dv")}
            same = all(r["bytes_sent"] == r["bytes_predicted"] for r in rs)
            print(f"{key[0]:16s} {key[1]:6s} {key[2]:8s} " + " ".join(f"{worst[n]:8.2e}" for n in worst) + f"  {same}")
        print("PASS" if ok else "FAIL")
    dist.destroy_process_group()
    return 0 if ok else 1


def median_ms(fn, warmup=2, iters=7) -> float:
    return 1e3 * cuda_median_s(fn, warmup=warmup, reps=iters)


def time_call(backend, q, k, v, cu_q, cu_k, max_q, max_k, iters=7):
    """(forward ms, forward+backward ms) of one kernel call."""
    def fwd():
        return backend.forward(q, k, v, cu_q, cu_k, max_q, max_k)

    out, lse = fwd()
    dout = torch.randn_like(out)

    def fwd_bwd():
        o, l = backend.forward(q, k, v, cu_q, cu_k, max_q, max_k)
        backend.backward(dout, q, k, v, o, l, cu_q, cu_k, max_q, max_k)

    return median_ms(fwd, iters=iters), median_ms(fwd_bwd, iters=iters)


def fused(out_dir: str, backend_name: str, quick: bool) -> int:
    dev = torch.device("cuda")
    backend = get_backend(backend_name, dev, torch.bfloat16)
    n_q, n_kv, dim = 32, 8, 128
    servers, tokens = 4, (32 if quick else 128) * 1024
    iters = 3 if quick else 7
    batches = [("prolong", 0)] if quick else [(name, seed) for name in ("prolong", "pretrain") for seed in range(2)]
    results = []
    for dist_name, seed in batches:
        lens = sample_batches(dist_name, servers * tokens, 1, seed)[0]
        q, k, v = doc_tensors(lens, (n_q, n_kv, n_kv), dim, seed, dev)
        cu = torch.as_tensor(np.r_[0, np.cumsum(lens)], dtype=torch.int32, device=dev)
        pairs_total = int(sum(causal_pairs(0, L) for L in lens))
        whole_f, whole_fb = time_call(backend, q, k, v, cu, cu, max(lens), max(lens), iters)
        plan = plan_attention(linear_layout(lens, servers), "cad")
        doc_start = np.r_[0, np.cumsum(lens)[:-1]]
        fused_f = fused_fb = 0.0
        for s in range(servers):
            g, n, b = plan.kernel_segments(s)  # the segments of the runtime's kernel call
            a = b - n
            qrows = np.concatenate([np.arange(doc_start[d] + x, doc_start[d] + y) for d, x, y in zip(g, a, b)])
            krows = np.concatenate([np.arange(doc_start[d], doc_start[d] + y) for d, y in zip(g, b)])
            qi = torch.as_tensor(qrows, device=dev)
            ki = torch.as_tensor(krows, device=dev)
            cu_q = torch.as_tensor(np.r_[0, np.cumsum(b - a)], dtype=torch.int32, device=dev)
            cu_k = torch.as_tensor(np.r_[0, np.cumsum(b)], dtype=torch.int32, device=dev)
            f, fb = time_call(backend, q[qi], k[ki], v[ki], cu_q, cu_k, int((b - a).max()), int(b.max()), iters)
            fused_f += f
            fused_fb += fb
        flops_f = float(attention_flops(pairs_total, n_q, dim, "fwd"))
        flops_fb = float(attention_flops(pairs_total, n_q, dim, "fwd+bwd"))
        rec = dict(dist=dist_name, seed=seed, servers=servers, tokens_per_server=tokens, num_docs=len(lens),
                   max_doc=max(lens), num_shards=plan.num_tasks, min_shard=int(plan.task_len.min()),
                   whole_fwd_tflops=flops_f / whole_f / 1e9, whole_fwdbwd_tflops=flops_fb / whole_fb / 1e9,
                   fused_fwd_tflops=flops_f / fused_f / 1e9, fused_fwdbwd_tflops=flops_fb / fused_fb / 1e9)
        rec["ratio_fwd"] = rec["fused_fwd_tflops"] / rec["whole_fwd_tflops"]
        rec["ratio_fwdbwd"] = rec["fused_fwdbwd_tflops"] / rec["whole_fwdbwd_tflops"]
        results.append(rec)
        del q, k, v
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "runtime_fused.json"), "w") as f:
        json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "backend": backend.name,
                   "quick": quick, "results": results}, f, indent=1)
    print(f"\nfused CA-task calls vs whole documents, {backend.name} backend ({servers} servers x {tokens} tokens, "
          "32/8 heads x 128, bf16), TFLOP/s:")
    print(f"{'dist':9s} {'seed':>4s} {'docs':>5s} {'shards':>6s} {'whole f':>8s} {'fused f':>8s} {'ratio':>6s} {'whole fb':>9s} {'fused fb':>9s} {'ratio':>6s}")
    for r in results:
        print(f"{r['dist']:9s} {r['seed']:4d} {r['num_docs']:5d} {r['num_shards']:6d} {r['whole_fwd_tflops']:8.1f} "
              f"{r['fused_fwd_tflops']:8.1f} {r['ratio_fwd']:6.3f} {r['whole_fwdbwd_tflops']:9.1f} "
              f"{r['fused_fwdbwd_tflops']:9.1f} {r['ratio_fwdbwd']:6.3f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("exact", "fused"))
    parser.add_argument("--out", default=".")
    parser.add_argument("--attention-backend", default="auto", choices=("auto", "fa4", "flash"),
                        help="the kernel backend (default auto: fa4 where it runs, else flash)")
    parser.add_argument("--quick", action="store_true", help="smaller cases and fewer repeats: under 2 minutes")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    run = exact if args.mode == "exact" else fused
    return run(args.out, args.attention_backend, args.quick)


if __name__ == "__main__":
    sys.exit(main())
