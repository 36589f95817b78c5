"""Document-length distributions and seeded batch sampling as the DistCA paper builds batches.

The two shipped samples, ``pretrain`` and ``prolong``, are the document-length
samples published with the core attention disaggregation paper's code
(arXiv 2510.18121, Apache-2.0). Any other JSON list of positive integers loads by path.

Sampling (the paper's recipe):
- up-sampling of long documents: documents of at least ``upsample_threshold``
  tokens are repeated ``long_repeat`` times; only a fraction ``keep_short`` of
  the shorter ones is kept; the pool is then shuffled and drawn in order;
- elongation: every length is multiplied by ``elongate`` (the paper uses
  max context / 65,536 with ``pretrain``);
- ``max_doc_len``: longer documents are cut into pieces of at most that length;
- packing: a batch is filled to exactly its token count; the document that
  overflows is split and its rest starts the next batch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from attnpool.errors import ConfigError, read_json_file

DISTRIBUTIONS = ("pretrain", "prolong")


def load_lengths(name_or_path: str | Path) -> np.ndarray:
    """Lengths of a named distribution or of a JSON file holding a flat list of positive integers."""
    name = str(name_or_path)
    if name in DISTRIBUTIONS:
        text = resources.files("attnpool.resources").joinpath(f"{name}.json").read_text()
        return np.asarray(json.loads(text), dtype=np.int64)
    path = Path(name)
    if not path.suffix and not path.exists():
        raise ConfigError("dist", name, f"unknown distribution; use one of {', '.join(DISTRIBUTIONS)} or a path to a JSON list of lengths")
    data = read_json_file("dist", path)
    check_length_list("dist", name, data)
    return np.asarray(data, dtype=np.int64)


def check_length_list(field: str, where, data) -> None:
    """Refuse anything but a non-empty list of positive integers (document lengths)."""
    if not isinstance(data, list) or not data:
        raise ConfigError(field, where, "must hold a non-empty JSON list of document lengths")
    bad = [x for x in data if not isinstance(x, int) or isinstance(x, bool) or x <= 0]
    if bad:
        raise ConfigError(field, where, f"every length must be a positive integer; found {bad[0]!r}")


@dataclass(frozen=True)
class SamplingOptions:
    """The paper's batch recipe. Defaults follow the paper; ``upsample=False`` draws plainly."""

    upsample: bool = True
    upsample_threshold: int = 65536
    keep_short: float = 0.5
    long_repeat: int = 4
    elongate: float = 1.0
    max_doc_len: int | None = None

    def __post_init__(self):
        if self.upsample_threshold < 1:
            raise ConfigError("upsample_threshold", self.upsample_threshold, "must be positive")
        if not 0.0 < self.keep_short <= 1.0:
            raise ConfigError("keep_short", self.keep_short, "must be in (0, 1]")
        if self.long_repeat < 1:
            raise ConfigError("long_repeat", self.long_repeat, "must be >= 1")
        if not (np.isfinite(self.elongate) and self.elongate > 0):
            raise ConfigError("elongate", self.elongate, "must be a positive finite number")
        if self.max_doc_len is not None and self.max_doc_len < 1:
            raise ConfigError("max_doc_len", self.max_doc_len, "must be positive")


class LengthSampler:
    """A seeded stream of packed batches of document lengths.

    ``next_batch(total_tokens)`` returns lengths that sum to exactly ``total_tokens``;
    the document cut at the end of a batch continues at the start of the next one.
    The same (lengths, options, seed) give the same stream on every machine.
    """

    def __init__(self, lengths: np.ndarray, options: SamplingOptions = SamplingOptions(), seed: int = 0):
        self.options = options
        self.rng = np.random.default_rng(seed)
        lens = np.asarray(lengths, dtype=np.int64)
        if options.elongate != 1.0:
            lens = np.maximum(1, np.round(lens * options.elongate)).astype(np.int64)
        self.base = lens
        self._pool = np.empty(0, dtype=np.int64)
        self._next = 0
        self._carry = 0

    def _refill(self) -> None:
        o = self.options
        lens = self.base
        if o.upsample:
            long_ = lens[lens >= o.upsample_threshold]
            short = lens[lens < o.upsample_threshold]
            short = short[self.rng.random(short.size) < o.keep_short]
            lens = np.concatenate([short, np.repeat(long_, o.long_repeat)])
            if lens.size == 0:
                lens = self.base
        pool = self.rng.permutation(lens)
        if o.max_doc_len is not None:
            # Cut long documents into max_doc_len pieces, each its own document.
            reps = -(-pool // o.max_doc_len)
            starts = np.repeat(np.cumsum(reps) - reps, reps)
            idx = np.arange(reps.sum()) - starts
            full = np.repeat(pool, reps)
            pool = np.minimum(o.max_doc_len, full - idx * o.max_doc_len)
        self._pool, self._next = pool, 0

    def _draw(self) -> int:
        if self._next >= self._pool.size:
            self._refill()
        x = int(self._pool[self._next])
        self._next += 1
        return x

    def next_batch(self, total_tokens: int) -> list[int]:
        if total_tokens < 1:
            raise ConfigError("total_tokens", total_tokens, "must be positive")
        out: list[int] = []
        filled = 0
        while filled < total_tokens:
            length = self._carry or self._draw()
            self._carry = 0
            take = min(length, total_tokens - filled)
            out.append(take)
            filled += take
            if take < length:
                self._carry = length - take
        return out


def sample_batches(dist: str | Path, total_tokens: int, num_batches: int, seed: int = 0,
                   options: SamplingOptions = SamplingOptions()) -> list[list[int]]:
    """``num_batches`` consecutive packed batches of ``total_tokens`` tokens from ``dist``."""
    sampler = LengthSampler(load_lengths(dist), options, seed)
    return [sampler.next_batch(total_tokens) for _ in range(num_batches)]
