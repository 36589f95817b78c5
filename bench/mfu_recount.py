#!/usr/bin/env python3
"""MFU of recorded runs counted again with attention's backward as 2 forwards (attnpool.train.flops since
2026-11-29), where the run counted FlashAttention's 2.5 (3.5 forwards in all): the linear part is unchanged, the
attention part scales by 3 / 3.5. Reads a run's metrics.jsonl (its ``model_flops``, ``tokens`` and ``mfu`` per
step); ``--prolong-batches N``: the ratio of the two counts on N packed batches of the prolong distribution.

    PYTHONPATH=src python3 bench/mfu_recount.py --metrics bench/results/2026-11-28-h200-mfu-metrics.jsonl \
        --model llama3-8b --n-layers 4 --steady-from 3
    PYTHONPATH=src python3 bench/mfu_recount.py --model llama3-8b --prolong-batches 6 --prolong-tokens 512K
"""

from __future__ import annotations

import argparse
import json
import statistics

OLD_FORWARDS, NEW_FORWARDS = 3.5, 3.0


def recounted(model_flops: float, linear_flops: float) -> float:
    """A step's model FLOPs counted with attention's backward as 2 forwards, from the old count."""
    return linear_flops + (model_flops - linear_flops) * NEW_FORWARDS / OLD_FORWARDS


def main() -> int:
    from attnpool.data.lengths import sample_batches
    from attnpool.model import model_config
    from attnpool.sizes import parse_size
    from attnpool.train.flops import linear_flops_per_token, step_flops

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--metrics", help="a run's metrics.jsonl, counted the old way")
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--n-layers", type=int, default=None)
    ap.add_argument("--steady-from", type=int, default=3, help="the summary's median starts at this step")
    ap.add_argument("--prolong-batches", type=int, default=0)
    ap.add_argument("--prolong-tokens", type=parse_size, default=4 * 131072, help="tokens per packed batch")
    args = ap.parse_args()
    cfg = model_config(args.model, **({"n_layers": args.n_layers} if args.n_layers else {}))
    if args.metrics:
        with open(args.metrics) as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        steady = [r for r in rows if r["step"] >= args.steady_from and r.get("mfu") is not None]
        old = [r["mfu"] for r in steady]
        new = [r["mfu"] * recounted(r["model_flops"], linear_flops_per_token(cfg) * r["tokens"]) / r["model_flops"]
               for r in steady]
        print(f"{args.metrics}: MFU median of steps {args.steady_from}+: {statistics.median(old):.3f} counted with "
              f"3.5 forwards, {statistics.median(new):.3f} with 3")
    for i, lens in enumerate(sample_batches("prolong", args.prolong_tokens, args.prolong_batches, seed=0)):
        now = step_flops(cfg, lens)
        linear = linear_flops_per_token(cfg) * sum(lens)
        before = linear + (now - linear) * OLD_FORWARDS / NEW_FORWARDS
        print(f"prolong batch {i} ({len(lens)} documents, longest {max(lens)}): the old count {before / now:.3f}x "
              f"the new")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
