"""``attnpool bench``: the end-to-end training-step benchmark (run it under torchrun)."""

from __future__ import annotations

from attnpool.bench.e2e_options import add_arguments


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time full training steps of every strategy on the same batches (torchrun)",
                       description="End-to-end benchmark: full training steps of every strategy on the same batches, "
                                   "on the GPUs at hand.")
    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args) -> int:
    from attnpool.bench import e2e  # torch: only once the command runs

    return e2e.run(args)
