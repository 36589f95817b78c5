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
    build = _builder(kind)
    params = inspect.signature(build).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:  # (the option's own name: the caller maps it to what the user typed)
            known = f"its options: {', '.join(sorted(params))}" if params else "it takes none"
            raise ConfigError(unknown[0], options[unknown[0]], f"is not an option of {kind} data; {known}")
    missing = [name for name, p in params.items() if p.default is p.empty and name not in options
               and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if missing:
        raise ConfigError(missing[0], None, f"{kind} data needs it")
    return build(**options)


def _builder(kind: str):
    """What ``make_source(kind, ...)`` calls."""
    if kind == "hf":
        from attnpool.data.hf_dataset import HFDatasetSource  # imports datasets only when used
        return HFDatasetSource
    if kind not in SOURCES:
        raise ConfigError("source", kind, f"unknown; choose one of {', '.join(SOURCES)}, hf")
    return SOURCES[kind]


def source_options(kind: str) -> set[str]:
    """The options ``make_source(kind, ...)`` takes (none for a kind it does not know)."""
    return set(inspect.signature(_builder(kind)).parameters) if kind == "hf" or kind in SOURCES else set()
