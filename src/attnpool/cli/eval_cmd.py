"""``attnpool eval``: a trained checkpoint's accuracy on held-out long-range retrieval tasks.

    attnpool eval --run runs/retrieval --contexts 4K,8K,16K --depths 0,0.5,1 --instances 50
    attnpool eval --checkpoint runs/retrieval/checkpoints/step-000300 --tasks passkey --attention dense
    attnpool eval --run runs/retrieval --contexts 64K --attention sparse --sparse-coverage 0.8   # density vs accuracy

Prints a table (task and depth by context), writes ``eval.json`` and ``eval.png`` (a heat map per task) to
``--out`` (default: RUN/eval; attention other than the run's in a folder of its own beside it: RUN/eval-dense for a
sparse run evaluated dense, RUN/eval-sparse for a dense run given patterns, with ``-coverage-C`` and
``-min-doc-len-N`` where those are given).
"""

from __future__ import annotations

import argparse

from attnpool.cli.common import parse_size
from attnpool.errors import ConfigError, check_checkpoint_source

DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="accuracy of a checkpoint on held-out retrieval tasks, by context and depth",
                       description="Evaluate a checkpoint of `attnpool train` on held-out instances of the retrieval "
                                   "tasks (passkey, multikey, vartrack): exact-match accuracy of the answer by context "
                                   "length and needle depth. One process reads the checkpoint, whatever its layout.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", metavar="DIR", help="a run directory: its newest valid checkpoint")
    source.add_argument("--checkpoint", metavar="DIR", help="one checkpoint directory (OUT/checkpoints/step-NNNNNN)")
    p.add_argument("--tasks", default=None, help="comma list of passkey, multikey, vartrack, or all (default: the "
                                                 "run's retrieval tasks but copy, a warm-up not scored, else "
                                                 "passkey)")
    p.add_argument("--contexts", default="4K", help="comma list of context lengths, e.g. 4K,16K,64K (default 4K)")
    p.add_argument("--depths", default=DEFAULT_DEPTHS, help=f"comma list of needle depths in [0, 1] (default {DEFAULT_DEPTHS})")
    p.add_argument("--instances", type=int, default=20, help="held-out instances per (task, context, depth) (default 20)")
    p.add_argument("--attention", choices=("trained", "dense", "sparse"), default="trained",
                   help="attention to evaluate with: the run's (default), dense, or vertical-slash with the run's "
                        "sparse options (a run trained dense: their defaults)")
    p.add_argument("--sparse-coverage", type=float, default=None, metavar="C",
                   help="sparse attention at this coverage instead of the run's (with --attention sparse, a run "
                        "trained dense too: its patterns then exist at evaluation only)")
    p.add_argument("--sparse-min-doc-len", type=parse_size, default=None, metavar="N",
                   help="sparse attention for documents of N+ tokens instead of the run's length")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda where available")
    p.add_argument("--batch-tokens", type=parse_size, default=parse_size("64K"),
                   help="tokens per forward pass: instances of one cell packed as documents (default 64K)")
    p.add_argument("--needle-probe", action="store_true",
                   help="sparse attention: also report how often each layer's pattern lets the answer's first query "
                        "reach the asked value (needle_kept in eval.json)")
    p.add_argument("--seed", type=int, default=0, help="seed of the held-out instances (default 0)")
    p.add_argument("--out", metavar="DIR",
                   help="where eval.json and eval.png go (default RUN/eval; attention other than the run's: "
                        "RUN/eval-dense, or RUN/eval-sparse with -coverage-C and -min-doc-len-N where given)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="read a checkpoint without a manifest (its files' sizes are checked, their bytes cannot be)")
    p.set_defaults(func=run)


def _list(field: str, text: str, parse) -> list:
    try:
        values = [parse(x.strip()) for x in text.split(",") if x.strip()]
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(field, text, f"not a comma list of values ({exc})") from None
    if not values:
        raise ConfigError(field, text, "is empty")
    return values


def run(args: argparse.Namespace) -> int:
    contexts = _list("--contexts", args.contexts, parse_size)
    depths = _list("--depths", args.depths, float)
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ConfigError("--depths", bad[0], "every depth must be in [0, 1]")
    if args.instances < 1:
        raise ConfigError("--instances", args.instances, "must be >= 1")
    if args.seed < 0:
        raise ConfigError("--seed", args.seed, "must be >= 0")
    patterns = {"coverage": args.sparse_coverage, "min_doc_len": args.sparse_min_doc_len}
    for flag, value in (("--sparse-coverage", args.sparse_coverage), ("--sparse-min-doc-len", args.sparse_min_doc_len)):
        if value is not None and args.attention == "dense":
            raise ConfigError(flag, value, "only with sparse attention: --attention dense has no patterns")
    if args.sparse_coverage is not None and not 0.0 < args.sparse_coverage <= 1.0:
        raise ConfigError("--sparse-coverage", args.sparse_coverage, "must be in (0, 1]")
    if args.sparse_min_doc_len is not None and args.sparse_min_doc_len < 1:
        raise ConfigError("--sparse-min-doc-len", args.sparse_min_doc_len, "must be >= 1")
    check_checkpoint_source(args.run, args.checkpoint)  # (a missing one refused at once, before torch loads)
    import os

    import torch  # only once the command runs

    from attnpool.train.evaluate import (check_contexts, check_eval_fits, evaluate_retrieval, evaluated_tasks,
                                         format_table, sparse_config_of, write_results)
    from attnpool.train.export import read_checkpoint_model

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")

    def retrieval_args(settings: dict) -> dict:
        return settings.get("data_args", {}) if settings.get("data") == "retrieval" else {}

    def tasks_of(settings: dict) -> tuple[str, ...]:
        """--tasks, else the run's retrieval tasks (copy left out), else passkey."""
        if args.tasks:
            return evaluated_tasks(args.tasks)
        return evaluated_tasks(retrieval_args(settings).get("task", "passkey"), from_run=True)

    def check(settings: dict, spec) -> None:
        """What the run's settings refuse, before its weights are read."""
        if "eval" in spec.cannot:
            raise ConfigError("run", args.run or args.checkpoint, f"trained {settings['model']}: {spec.cannot['eval']}")
        tasks_of(settings)
        check_contexts(contexts, **{k: v for k, v in retrieval_args(settings).items()
                                    if k in ("key_len", "num_keys", "hops", "filler")})
        sparse_config_of(settings, args.attention, **patterns)
        check_eval_fits(spec.config, contexts, args.batch_tokens, torch.device(device))

    model, spec, settings, path, skipped = read_checkpoint_model(run_dir=args.run, checkpoint=args.checkpoint,
                                                                 allow_unverified=args.allow_unverified, check=check)
    for bad, problem in skipped:
        print(f"skipping {bad}: {problem}")
    data_args = retrieval_args(settings)
    tasks = tasks_of(settings)
    sparse = sparse_config_of(settings, args.attention, **patterns)
    trained = sparse_config_of(settings, "trained")
    trained_dense = trained is None  # (the run's own attention, whatever this evaluation's)
    print(f"attnpool eval: {path} ({settings['model']}, {spec.num_params(model) / 1e6:.1f}M params), "
          f"{'sparse' if sparse else 'dense'} attention"
          + (f" (coverage {sparse.coverage:g} from {sparse.min_doc_len} tokens"
             + ("; the run trained dense: patterns at evaluation only)" if trained_dense else ")") if sparse else "")
          + f", {args.instances} instances per cell on {device}", flush=True)
    shape = {k: data_args[k] for k in ("key_len", "num_keys", "hops", "filler") if k in data_args}
    cells = evaluate_retrieval(model, tasks=tasks, contexts=contexts, depths=depths, instances=args.instances,
                               seed=args.seed, sparse=sparse, device=device, batch_tokens=args.batch_tokens, **shape,
                               needle_probe=args.needle_probe,
                               progress=lambda c: print(f"  {c.task} {c.context} depth {c.depth:g}: {c.accuracy:.2f}"
                                                        + ("" if c.needle_kept is None else
                                                           f" (needle kept in {c.needle_kept:.0%} of layers)"),
                                                        flush=True))
    print(format_table(cells))
    # Attention other than the run's is written beside its own evaluation, not over it (a folder each).
    changed = "".join(f"-{name.replace('_', '-')}-{value:g}" if isinstance(value, float) else
                      f"-{name.replace('_', '-')}-{value}" for name, value in patterns.items() if value is not None)
    folder = ("eval-sparse" + changed if sparse is not None and (trained is None or changed) else
              "eval-dense" if sparse is None and trained is not None else "eval")
    out = args.out or os.path.join(args.run or os.path.dirname(os.path.dirname(os.path.abspath(path))), folder)
    meta = {"checkpoint": path, "model": settings["model"], "attention": "sparse" if sparse else "dense",
            "coverage": sparse.coverage if sparse else None,
            "sparse_min_doc_len": sparse.min_doc_len if sparse else None, "trained_dense": trained_dense,
            "instances": args.instances, "seed": args.seed,
            "filler": shape.get("filler", "random"),
            "title": f"{os.path.basename(path)}: {'sparse' if sparse else 'dense'} attention"
                     + (f", coverage {sparse.coverage:g}" if sparse else "")}
    json_path, png_path = write_results(cells, out, meta)
    print(f"wrote {json_path} and {png_path}")
    return 0
