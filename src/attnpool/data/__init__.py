"""Data: length distributions, document sources, and batch assembly. NumPy; torch only in ``to_torch``."""

from attnpool.data.batch import IGNORE_INDEX, DocumentStream, GlobalBatch, RankBatch, RankTensors
from attnpool.data.lengths import DISTRIBUTIONS, LengthSampler, SamplingOptions, load_lengths, sample_batches
from attnpool.data.registry import SOURCES, make_source
from attnpool.data.sources import DocumentSource, JsonlSource, NpySource, SyntheticSource, TextFileSource, stdlib_corpus

__all__ = [
    "IGNORE_INDEX", "DocumentStream", "GlobalBatch", "RankBatch", "RankTensors",
    "DISTRIBUTIONS", "LengthSampler", "SamplingOptions", "load_lengths", "sample_batches",
    "SOURCES", "DocumentSource", "JsonlSource", "NpySource", "SyntheticSource", "TextFileSource",
    "make_source", "stdlib_corpus",
]
