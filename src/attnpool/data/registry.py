"""Document sources by name: what ``--data KIND`` (and ``make_source``) builds.

The sources are defined on :class:`attnpool.data.sources.DocumentSource` in their own modules; this
registry imports them, never the other way round.
"""

from __future__ import annotations

import inspect

from attnpool.data.retrieval import RetrievalSource
from attnpool.data.sources import DocumentSource, JsonlSource, NpySource, SyntheticSource, TextFileSource, stdlib_corpus
from attnpool.errors import ConfigError

SOURCES = {
    "synthetic": SyntheticSource,
    "text": TextFileSource,
    "npy": NpySource,
    "jsonl": JsonlSource,
    "stdlib": stdlib_corpus,
    "retrieval": RetrievalSource,
}


def make_source(kind: str, **options) -> DocumentSource:
    """Build a source by name (``synthetic``, ``text``, ``npy``, ``jsonl``, ``stdlib``, ``retrieval``, or ``hf``:
    a ``datasets`` dataset, attnpool.data.hf_dataset) from keyword options."""
    if kind == "hf":
        from attnpool.data.hf_dataset import HFDatasetSource as build  # imports datasets only when used
    elif kind not in SOURCES:
        raise ConfigError("source", kind, f"unknown; choose one of {', '.join(SOURCES)}, hf")
    else:
        build = SOURCES[kind]
    try:
        inspect.signature(build).bind(**options)
    except TypeError as exc:
        raise ConfigError(f"source.{kind}", sorted(options), f"bad options: {exc}") from None
    return build(**options)
