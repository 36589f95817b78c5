"""``attnpool bench``: the end-to-end training-step benchmark (run it under torchrun)."""

from __future__ import annotations

from attnpool.bench import e2e


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="time full training steps of every strategy on the same batches (torchrun)",
                       description=e2e.__doc__.split("\n\n")[0])
    e2e.add_arguments(p)
    p.set_defaults(func=e2e.run)
