"""How well cad balances sparse work when the planning prior keeps one pattern size for every document length
against one size per length class (attnpool.sparse.cost.SparsePrior), and with --kernels what every rank's kernels
then ran, on one device (issue 45).

Batches of synthetic prolong at TOKENS per rank over RANKS ranks; each step's vertical-slash patterns estimated from
random queries and keys (an untrained model's: attention spreads, so the caps set the sizes), HEADS heads of 128
dimensions; cad planned by each prior (with --cost-model pairs, the default: the `pairs` dense model and the sparse
kernels' pair coefficients; with `table`, seconds: the shipped H200 table of the flash kernel and the sparse kernels'
H200 calibration, as training plans), its busiest server measured by the step's real patterns
(SparseCost.from_pattern) in the planning unit and in (query, key) pairs, what training's `sparse_imbalance_measured`
and `sparse_imbalance_measured_pairs` report, and each prior updated with the step's statistics as training updates it.

With --kernels, each step's plan under the by-length prior (training's) is also run: every rank's kernel call built
as training's server builds it (runtime.sparse: its served documents' patterns, the sparse kernel for their segments
and the dense backend for the short documents'), forward and backward on random inputs on --device, --repeats times
after an untimed pass; reported per rank are what training's SparseStats measures, served pairs, served work priced
as planned, and kernel seconds (the median of the repeats), and their max/mean, with the kernel seconds' parts: the
sparse kernel's, the dense kernel's and the rest of the split call (its row copies and allocations). The ranks run in
turn on one device, from another rank each step: the kernels' balance, without the exchanges or another GPU's clocks.
On a GPU, patterns are estimated there. The record also fits the sparse kernel's seconds to the slash tiles and bars
served and a constant per call (least squares over every call; `sparse_kernel_fit`, beside the calibration's prices),
and again with the query blocks served (`sparse_kernel_fit_with_blocks`): a calibration's check, where the terms are
far enough from collinear. With --cost-model table the next plans' tile prices then follow the kernel seconds as
training's do (`sparse.cost.SparsePrior.update_kernel_scale`; each row's "price scale" is what its plan used);
--price-from-kernels fits them (training's price_from_kernels=true), for an A/B against the calibration's.

    PYTHONPATH=src python3 bench/sparse_prior_by_length.py --slash-cap 192 --vertical-cap 1024 --steps 10 --out DIR
    PYTHONPATH=src python3 bench/sparse_prior_by_length.py --cost-model table --kernels --device cuda --heads 32 \
        --kv-heads 8 --steps 12 --out DIR
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import numpy as np
import torch

from attnpool.data import DocumentStream
from attnpool.kernels.registry import get_backend
from attnpool.plan import linear_table, load_cost_model, plan_attention
from attnpool.plan.metrics import imbalance
from attnpool.runtime.sparse import KernelClock, PatternRoutes, SparseStats, served_backend
from attnpool.sparse import SparseConfig
from attnpool.sparse.cost import LayerMixCost, SparseCost, SparsePrior
from attnpool.sparse.pattern import estimate_untrained, pack_pattern, unpack_patterns
from attnpool.train.config import TrainConfig
from attnpool.train.data_source import build_source
from attnpool.train.spec import model_spec

PRIORS = ("one size", "by length")
SERVED = ("pairs", "work", "kernel s")  # SparseStats' three measures of what a rank served
# where a rank's kernel seconds went: the sparse kernel's calls, the dense kernel's, and the rest of the split call
# (its row copies, and its allocations and whatever else runs between the kernels)
PARTS = ("sparse kernel s", "dense kernel s", "split copies s")
# what it served: x heads (query blocks: of its sparse segments), and the short documents' spans priced
TILES = ("slash tiles", "bars", "query blocks", "tiles work", "dense work")  # tiles work: at the calibration's prices
FIT_KEYS = {"slash tiles": "slash_s", "bars": "bar_s", "query blocks": "query_block_s", "call": "call_s"}


def prolong_stream(ranks: int, tokens: int) -> DocumentStream:
    """The batches of training's synthetic prolong source (Llama-3-8B's tokenizer), ``tokens`` per rank."""
    config = TrainConfig(model="llama3-8b", data="synthetic", data_args={"dist": "prolong"}, tokens_per_rank=tokens,
                         nproc=ranks)
    return DocumentStream(build_source(config, model_spec("llama3-8b")), ranks, tokens, config.data.seed,
                          config.data.max_doc_len)


def served_by_rank(plan, pattern, sparse, price, dense, head_dim, kv_heads, repeats, device, first=0) -> dict:
    """Each rank's served pairs, served work and kernel seconds of one sparse layer (``SERVED``), and the kernel
    seconds' parts (``PARTS``: the sparse kernel's, the dense kernel's, and the rest, the split call's row copies):
    its kernel call built as training's server builds it (``pattern``: the batch's, on ``device``), run forward and
    backward on random bf16 inputs (float32 on the CPU) once untimed (compiling) and ``repeats`` times timed, each
    time with a fresh backend (whose first call builds its kernel index, as every layer's does); the medians of the
    repeats' seconds. The ranks run in turn from rank ``first`` (vary it between steps, so that a drift of the device's
    clocks over a step does not look like one rank's load). Values (ranks,) by name, in rank order."""
    heads = pattern.num_heads
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    rows = {}
    for rank in np.roll(np.arange(plan.num_ranks), -first).tolist():
        routes = PatternRoutes.build(plan, rank, heads, sparse, device)
        served = None
        if len(routes.served_docs):  # the served documents' rows of the batch's pattern, as the exchange leaves them
            served = unpack_patterns(pack_pattern(pattern, routes.served_docs, routes.served_lens, sparse),
                                     routes.served_lens, heads, sparse)
        stats = SparseStats(price)
        stats.add_served(served, routes, sparse.vertical_chunk)
        _, q_len, k_len = plan.kernel_segments(rank)
        cu = lambda x: torch.tensor(np.r_[0, np.cumsum(x)], dtype=torch.int32, device=device)
        q = torch.randn(int(q_len.sum()), heads, head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(int(k_len.sum()), kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
        dout = torch.randn_like(q)
        args = (cu(q_len), cu(k_len), int(q_len.max(initial=0)), int(k_len.max(initial=0)))
        seconds = []
        for repeat in range(repeats + 1):
            clocks = {kind: KernelClock() for kind in ("whole", "sparse", "dense")}
            backend = clocks["whole"].timed(served_backend(served, routes, dense, sparse,
                                                           wrap=lambda b, kind: clocks[kind].timed(b)))
            out, lse = backend.forward(q, k, v, *args)
            backend.backward(dout, q, k, v, out, lse, *args)
            whole, *parts = (clock.seconds() for clock in clocks.values())  # (each waits for the device)
            if repeat:  # the untimed pass done before the timed ones start
                seconds.append([whole, *parts, whole - sum(parts)])
        pairs, work, _, tiles_work, dense_work = stats.values()[5:10]  # (its clock timed nothing: ours did)
        slash, bars = (0.0, 0.0) if stats.served is None else stats.served[:2].tolist()
        blocks = heads * float((routes.seg_end_block - routes.seg_first_block).sum()) if served is not None else 0.0
        rows[rank] = [pairs, work, *np.median(np.array(seconds), 0), slash, bars, blocks, tiles_work, dense_work]
        del q, k, v, dout, out, lse
    return dict(zip(SERVED + PARTS + TILES, np.array([rows[rank] for rank in sorted(rows)]).T))


def sparse_kernel_fit(rows, terms=("slash tiles", "bars")) -> dict:
    """The sparse kernel's seconds per unit of each of ``terms`` (per head) and per call, fitted by least squares over
    every (step, rank) call that served sparse documents: what the calibration's prices (SparseConfig.coefficients,
    forward + backward: per slash tile and per bar) are to be checked against."""
    calls = np.array([values for r in rows for values in zip(*(r[term] for term in terms), r["sparse kernel s"])
                      if values[-1] > 0]).reshape(-1, len(terms) + 1)
    if len(calls) <= len(terms) + 1:
        return {}
    a, t = np.c_[calls[:, :-1], np.ones(len(calls))], calls[:, -1]
    coefficients, *_ = np.linalg.lstsq(a, t, rcond=None)
    return {**{FIT_KEYS[term]: float(c) for term, c in zip(terms + ("call",), coefficients)}, "calls": len(calls),
            "mean_abs_error": float(np.mean(np.abs(a @ coefficients - t) / t))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slash-cap", type=int, default=192)
    ap.add_argument("--vertical-cap", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256 * 1024, help="tokens per rank")
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--cost-model", choices=("pairs", "table"), default="pairs",
                    help="the planning unit: pairs, or seconds by the shipped H200 table (flash kernel)")
    ap.add_argument("--kv-heads", type=int, help="key and value heads (default: --heads)")
    ap.add_argument("--kernels", action="store_true",
                    help="also run every rank's kernel call of the by-length plans and measure what each served")
    ap.add_argument("--device", default="cpu", help="where patterns are estimated and kernels run")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs of each rank's kernel call (--kernels)")
    ap.add_argument("--price-from-kernels", action="store_true",
                    help="--kernels with --cost-model table: fit the tiles' prices to the kernel seconds as training "
                         "does with price_from_kernels=true, rather than keep the calibration's")
    ap.add_argument("--out", help="write <date>-cpu-sparse-prior-by-length-<caps>[-table][-<ranks>ranks].json here "
                                  "(with --kernels: <date>-<device>-sparse-served-balance-<caps>-<ranks>ranks.json)")
    args = ap.parse_args()
    sparse = SparseConfig(slash_cap=args.slash_cap, vertical_cap=args.vertical_cap,
                          price_from_kernels=args.price_from_kernels)
    stream = prolong_stream(args.ranks, args.tokens)
    pairs = load_cost_model("pairs")
    planning = pairs if args.cost_model == "pairs" else load_cost_model("table", backend="flash")
    priors = {name: SparsePrior(sparse, args.heads, 128, 1) for name in PRIORS}
    kv_heads = args.kv_heads or args.heads
    if args.heads % kv_heads:
        ap.error(f"--kv-heads {kv_heads} must divide --heads {args.heads}")
    if args.kernels:
        dense_backend = get_backend("auto", args.device, torch.bfloat16 if "cuda" in args.device else None)
    rows = []
    for step in range(1, args.steps + 1):
        lens = stream.next_batch().doc_lens
        table = linear_table(lens, args.ranks, args.tokens)
        on_device = estimate_untrained(lens, args.heads, 128, sparse, seed=step, num_kv_heads=kv_heads,
                                       device=args.device,
                                       dtype=torch.float32 if args.device == "cpu" else torch.bfloat16)
        pattern = on_device.to("cpu")
        sums, by_length = SparseStats.of_pattern(pattern)
        row = {"step": step, "docs": int(len(lens)), "longest": int(lens.max()), "density": sums[3] / sums[4]}
        priced = {}  # id(tile prices) -> (them, the step's real patterns priced so): once per price, not per prior

        def priced_by(dense, coefficients):
            if id(coefficients) not in priced:
                priced[id(coefficients)] = (coefficients, LayerMixCost(
                    dense, SparseCost.from_pattern(pattern, coefficients, chunk=sparse.vertical_chunk), 0, 1,
                    lens >= sparse.min_doc_len))
            return priced[id(coefficients)][1]

        for name, prior in priors.items():
            # the step's real patterns, priced in the planning unit (as this prior's plans price tiles) and in pairs
            exact = {unit: priced_by(dense, prior._scaled(model, coefficients))
                     for unit, model in (("measured", planning), ("measured pairs", pairs))
                     for dense, coefficients in [prior._pricing(model)]}
            predicted = prior.cost_model(table.doc_len, planning)
            plan = plan_attention(table, "cad", cost_model=predicted)
            loads = lambda model: np.bincount(plan.task_server, minlength=args.ranks,
                                              weights=model.cost(plan.task_start, plan.task_end, plan.task_doc))
            row[f"{name} planned"] = imbalance(loads(predicted))
            for unit, model in exact.items():
                row[f"{name} {unit}"] = imbalance(loads(model))
            if args.kernels and name == "by length":
                price = prior.served_price(planning)  # as this step's plan priced
                served = served_by_rank(plan, on_device, sparse, price, dense_backend, 128, kv_heads, args.repeats,
                                        args.device, first=step % args.ranks)
                if prior.learns_kernel_scale(planning):  # as training does: the next plans' tile prices
                    row["price scale"] = price.sparse_scale
                    prior.update_kernel_scale(served["kernel s"], served["tiles work"], served["dense work"])
                for measure in SERVED:
                    row[f"served {measure}"] = served[measure].tolist()
                    row[f"served {measure} max/mean"] = imbalance(served[measure])
                row.update({part: served[part].tolist() for part in PARTS + TILES})
            prior.update(*sums[:3], by_length=by_length if name == "by length" else None)
        rows.append(row)
        print(f"step {step:3d}: {row['docs']:3d} docs (longest {row['longest']:6d}), density {row['density']:.3f}  "
              + "  ".join(f"{n}: planned {row[n + ' planned']:.3f} measured {row[n + ' measured']:.3f} "
                          f"(pairs {row[n + ' measured pairs']:.3f})" for n in PRIORS)
              + "".join(f"\n    served {m}: " + " ".join(f"{x:.4g}" for x in row[f"served {m}"])
                        + f"  max/mean {row[f'served {m} max/mean']:.3f}" for m in SERVED if args.kernels)
              + "".join(f"\n    {m}: " + " ".join(f"{x:.4g}" for x in row[m]) for m in PARTS if args.kernels),
              flush=True)
        mean = mean_from_step_3(rows, args.kernels)
        if args.out:  # after every step: a run cut short keeps its steps
            write(args, kv_heads, dense_backend.name if args.kernels else None, mean, rows)
    print("mean from step 3: " + ", ".join(f"{k} {v:.3f}" for k, v in mean.items()))
    for terms in (("slash tiles", "bars"), ("slash tiles", "bars", "query blocks")) if args.kernels else ():
        fit = sparse_kernel_fit(rows, terms)
        if fit:
            print(f"sparse kernel, fitted over {fit['calls']} calls: "
                  + ", ".join(f"{fit[FIT_KEYS[term]] * 1e9:.1f} ns per {term[:-1]}" for term in terms)
                  + f" (per head), {fit['call_s'] * 1e3:.2f} ms per call (mean error {fit['mean_abs_error']:.1%})")


def mean_from_step_3(rows, kernels) -> dict:
    """The measures' means over the steps after the first two, where both priors are still learning."""
    later = rows[2:] or rows
    keys = [f"{n} {kind}" for n in PRIORS for kind in ("planned", "measured", "measured pairs")]
    keys += [f"served {m} max/mean" for m in SERVED] if kernels else []
    return {key: float(np.mean([r[key] for r in later])) for key in keys}


def write(args, kv_heads, dense_backend, mean, rows) -> None:
    os.makedirs(args.out, exist_ok=True)
    command = (f"PYTHONPATH=src python3 bench/sparse_prior_by_length.py --slash-cap {args.slash_cap} "
               f"--vertical-cap {args.vertical_cap} --steps {args.steps} --ranks {args.ranks} --tokens {args.tokens} "
               f"--heads {args.heads} --cost-model {args.cost_model}")
    record = {"command": command, "mean_from_step_3": mean, "rows": rows}
    if args.kernels:
        price = SparseConfig(slash_cap=args.slash_cap, vertical_cap=args.vertical_cap).coefficients().phase("fwd+bwd")
        record["sparse_kernel_fit"] = {**sparse_kernel_fit(rows), "calibration_slash_s": price[0],
                                       "calibration_bar_s": price[1]}
        record["sparse_kernel_fit_with_blocks"] = sparse_kernel_fit(rows, ("slash tiles", "bars", "query blocks"))
    caps = f"{args.slash_cap}-{args.vertical_cap}"
    if args.kernels:
        on_gpu = args.device != "cpu"
        machine = torch.cuda.get_device_name(args.device) if on_gpu else "cpu"
        record.update(command=command + f" --kv-heads {kv_heads} --kernels --device {args.device} "
                                        f"--repeats {args.repeats}"
                                        + (" --price-from-kernels" if args.price_from_kernels else ""),
                      machine=machine, dense_backend=dense_backend, torch=torch.__version__)
        stem = (f"{machine.split()[-1].lower()}-sparse-served-balance-{caps}-{args.ranks}ranks"
                + ("-fitted-prices" if args.price_from_kernels else ""))
    else:
        stem = (f"cpu-sparse-prior-by-length-{caps}" + ("-table" if args.cost_model == "table" else "")
                + (f"-{args.ranks}ranks" if args.ranks != 4 else ""))
    path = os.path.join(args.out, f"{datetime.date.today()}-{stem}.json")
    with open(path, "w") as fh:
        json.dump(record, fh, indent=1)
    print(f"wrote {path}")

if __name__ == "__main__":
    main()
