"""Document sources: where the token ids of documents come from.

A source is a sequence of documents: ``len(source)`` documents, ``source[i]`` the
1-D ``np.int64`` token ids of document ``i``, the same on every call and on every
machine (given its seed). ``source.lengths()`` gives every document's length, as
cheaply as the source can. :class:`attnpool.data.batch.DocumentStream` needs only
``len`` and ``[]``: it shuffles, packs and cuts documents itself.

- :class:`SyntheticSource`: lengths from a length distribution via the paper's
  recipe (:mod:`attnpool.data.lengths`), uniformly random token ids.
- :class:`TextFileSource`: text files, one file one document, byte-level tokens.
- :class:`NpySource`: pre-tokenised tokens plus document offsets, two ``.npy`` files.
- :class:`JsonlSource`: JSON lines tokenised with a local Hugging Face tokenizer.
- :func:`stdlib_corpus`: the demo corpus, the running Python's standard library.
- :class:`attnpool.data.retrieval.RetrievalSource`: synthetic long-range tasks (passkey, multi-key
  needle, variable tracking) whose loss is on their answers (``targets``).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from attnpool.data.lengths import LengthSampler, SamplingOptions, load_lengths
from attnpool.errors import ConfigError
from attnpool.plan.layout import validate_doc_lens

BYTE_VOCAB_SIZE = 256


class DocumentSource:
    """Base of all sources: a fixed, indexable sequence of documents."""

    vocab_size: int | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> np.ndarray:
        raise NotImplementedError

    def lengths(self) -> np.ndarray:
        """Token count of every document, (len(self),) int64."""
        return np.asarray([len(self[i]) for i in range(len(self))], dtype=np.int64)

    def targets(self, index: int) -> np.ndarray | None:
        """Which tokens of document ``index`` are to be predicted ((L,) bool), or None for every one (a language
        model's loss). A task source marks its answers, so the loss is the task's (data.retrieval)."""
        return None

    def whole_documents(self) -> tuple[str, int, int] | None:
        """(the option that sets their lengths, its value, the shortest document) for a source whose documents lose
        their meaning when cut (a task's question apart from its key: data.retrieval), so that a batch or
        ``max_doc_len`` too short to hold any of them whole is refused (train.data_source.check_documents_fit);
        None where a cut document is still text to learn from."""
        return None

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self[i]

    def _check_index(self, index) -> int:
        i = int(index)
        if not 0 <= i < len(self):
            raise IndexError(f"document {index} out of range for a source of {len(self)} documents")
        return i


def check_seed(field: str, seed) -> int:
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(field, seed, "must be a non-negative integer")
    return int(seed)


class SyntheticSource(DocumentSource):
    """Documents with lengths from ``dist`` and uniformly random token ids.

    The document set is one pool built by :class:`LengthSampler`'s recipe
    (up-sampling of long documents, elongation, ``max_doc_len`` cuts, shuffle),
    seeded by ``seed``. Document ``i`` draws its tokens from a generator seeded by
    ``(seed, i)``, so any document regenerates on its own, in any order.
    ``dist`` is ``"pretrain"``, ``"prolong"``, a JSON length file, or a list of lengths.
    """

    def __init__(self, dist: str | Path | Sequence[int], vocab_size: int, seed: int = 0,
                 options: SamplingOptions | dict = SamplingOptions()):
        if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool) or vocab_size < 1:
            raise ConfigError("vocab_size", vocab_size, "must be a positive integer")
        self.seed = check_seed("seed", seed)
        self.vocab_size = int(vocab_size)
        if isinstance(options, dict):  # from a YAML file or --data-args
            try:
                options = SamplingOptions(**options)
            except TypeError as exc:
                raise ConfigError("options", sorted(options), f"unknown sampling option: {exc}") from None
        base = load_lengths(dist) if isinstance(dist, (str, Path)) else validate_doc_lens(dist, "dist")
        sampler = LengthSampler(base, options, self.seed)
        # One refill is exactly one pool of the paper's recipe; the stream reshuffles
        # it every epoch, so drawing more pools would only repeat the same lengths.
        sampler._refill()
        self._lengths = sampler._pool.astype(np.int64)

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, index: int) -> np.ndarray:
        i = self._check_index(index)
        rng = np.random.default_rng((self.seed, i))
        return rng.integers(0, self.vocab_size, size=int(self._lengths[i]), dtype=np.int64)

    def lengths(self) -> np.ndarray:
        return self._lengths.copy()


def _normalise_suffixes(suffixes: Sequence[str] | str | None) -> tuple[str, ...] | None:
    if suffixes is None:
        return None
    if isinstance(suffixes, str):
        suffixes = [suffixes]
    out = tuple(s if s.startswith(".") else "." + s for s in suffixes)
    if not out or any(s == "." for s in out):
        raise ConfigError("suffixes", list(suffixes), "need file name endings such as '.py', or None for all files")
    return out


def _walk(root: str, suffixes: tuple[str, ...] | None, exclude_dirs: frozenset[str]) -> list[str]:
    """Files under ``root`` whose names end with a suffix; hidden and excluded directories skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk does not descend; names are checked below root only.
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in exclude_dirs]
        for name in filenames:
            if suffixes is None or name.endswith(suffixes):
                found.append(os.path.join(dirpath, name))
    return found


class TextFileSource(DocumentSource):
    """Text files as documents: one file is one document, tokens are its UTF-8 bytes (vocab 256).

    ``paths`` is a directory (searched recursively for names ending in one of
    ``suffixes``; ``None`` takes every file; hidden directories and names in
    ``exclude_dirs`` are skipped), a glob pattern (``**`` recurses), a file, or a
    list of these. Files are sorted by path, so the order is the same everywhere
    the same files exist; empty files are skipped.
    """

    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self, paths: str | Path | Sequence[str | Path],
                 suffixes: Sequence[str] | str | None = (".py", ".txt", ".md"),
                 exclude_dirs: Sequence[str] = ("__pycache__",)):
        items = [paths] if isinstance(paths, (str, Path)) else list(paths)
        if not items:
            raise ConfigError("paths", [], "need at least one file, directory or glob pattern")
        wanted = _normalise_suffixes(suffixes)
        excluded = frozenset(exclude_dirs)
        files: set[str] = set()
        for item in items:
            path = str(item)
            if os.path.isdir(path):
                files.update(_walk(path, wanted, excluded))
            elif os.path.isfile(path):
                files.add(path)
            elif glob.has_magic(path):
                # A pattern names its files itself: no suffix filter.
                files.update(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            else:
                raise ConfigError("paths", path, "no such file or directory")
        if not files:
            raise ConfigError("paths", [str(p) for p in items],
                              f"matched no files{'' if wanted is None else ' ending in ' + ', '.join(wanted)}")
        ordered = sorted(files)
        sizes = np.asarray([os.path.getsize(p) for p in ordered], dtype=np.int64)
        if not sizes.any():
            raise ConfigError("paths", [str(p) for p in items], f"all {len(ordered)} matched files are empty")
        keep = np.flatnonzero(sizes > 0)
        self.files = [ordered[i] for i in keep]
        self._lengths = sizes[keep]
        _refuse_binary(self.files)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> np.ndarray:
        i = self._check_index(index)
        return np.fromfile(self.files[i], dtype=np.uint8).astype(np.int64)

    def lengths(self) -> np.ndarray:
        """Byte sizes at construction (a byte is a token)."""
        return self._lengths.copy()


# Text files as bytes: a sample of them must be mostly UTF-8 text, or the run would train on binary data.
TEXT_SAMPLE_FILES, TEXT_SAMPLE_BYTES, MAX_NON_TEXT_SHARE = 64, 65536, 0.1


def _refuse_binary(files: list[str]) -> None:
    """Refuse files of which more than MAX_NON_TEXT_SHARE of the bytes are not text (invalid UTF-8, or control
    characters other than tab, newline, carriage return and form feed), judged on the start of up to
    TEXT_SAMPLE_FILES of them spread over the list; names the worst."""
    picked = sorted({files[i] for i in np.linspace(0, len(files) - 1, min(len(files), TEXT_SAMPLE_FILES)).astype(int)})
    worst, worst_share = None, 0.0
    for file in picked:
        with open(file, "rb") as fh:
            head = fh.read(TEXT_SAMPLE_BYTES)
        text = head.decode("utf-8", errors="replace")
        # control characters are the bytes below 32 (UTF-8 encodes nothing else with them)
        codes = np.frombuffer(head, dtype=np.uint8)
        control = int(np.count_nonzero((codes < 32) & ~np.isin(codes, (9, 10, 12, 13))))
        share = (text.count("\ufffd") + control) / max(1, len(text))
        if share > worst_share:
            worst, worst_share = file, share
    if worst_share > MAX_NON_TEXT_SHARE:
        raise ConfigError("data_path", worst, f"{worst_share:.0%} of its first bytes are not UTF-8 text: the text "
                                              "source trains on text files' bytes (npy takes token ids)")


def _load_npy(field: str, path: str | Path, mmap: bool) -> np.ndarray:
    if not os.path.isfile(path):
        raise ConfigError(field, str(path), "no such file")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise ConfigError(field, str(path), f"not a readable .npy array ({exc})") from None
    if not isinstance(arr, np.ndarray) or arr.ndim != 1:
        raise ConfigError(field, str(path), f"must hold a 1-D array; found shape {getattr(arr, 'shape', None)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(field, str(path), f"must hold integers; found dtype {arr.dtype}")
    return arr


class NpySource(DocumentSource):
    """Pre-tokenised documents: ``tokens`` (1-D integer .npy, memory-mapped) cut at ``offsets``.

    Document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``; ``offsets`` starts at
    0, ends at ``len(tokens)`` and strictly increases (no empty documents). Token
    ids are checked per document as they are read (scanning a large file up front
    would cost a full read): negative ids, or ids >= ``vocab_size`` when given, raise.
    """

    def __init__(self, tokens_path: str | Path, offsets_path: str | Path, vocab_size: int | None = None):
        self.tokens = _load_npy("tokens_path", tokens_path, mmap=True)
        offsets = _load_npy("offsets_path", offsets_path, mmap=False).astype(np.int64)
        where = str(offsets_path)
        if offsets.size < 2:
            raise ConfigError("offsets_path", where, f"needs at least 2 offsets (one document); found {offsets.size}")
        if offsets[0] != 0:
            raise ConfigError("offsets_path", where, f"must start at 0; starts at {int(offsets[0])}")
        if offsets[-1] != len(self.tokens):
            raise ConfigError("offsets_path", where,
                              f"must end at len(tokens) = {len(self.tokens)}; ends at {int(offsets[-1])}")
        steps = np.diff(offsets)
        if np.any(steps <= 0):
            i = int(np.flatnonzero(steps <= 0)[0])
            raise ConfigError("offsets_path", where, f"must strictly increase; offsets[{i}] = {int(offsets[i])} "
                                                     f">= offsets[{i + 1}] = {int(offsets[i + 1])}")
        if vocab_size is not None and (not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1):
            raise ConfigError("vocab_size", vocab_size, "must be a positive integer or None")
        self.offsets = offsets
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.tokens_path = str(tokens_path)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        i = self._check_index(index)
        doc = np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]], dtype=np.int64)
        lo, hi = int(doc.min()), int(doc.max())
        if lo < 0 or (self.vocab_size is not None and hi >= self.vocab_size):
            bad = lo if lo < 0 else hi
            raise ConfigError("tokens_path", self.tokens_path,
                              f"document {i} holds token id {bad}, outside [0, {self.vocab_size or 'inf'})")
        return doc

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class JsonlSource(DocumentSource):
    """JSON lines, one object per document, ``text_field`` tokenised by a local Hugging Face tokenizer.

    ``tokenizer_path`` is a local directory (or tokenizer file) that
    ``transformers.AutoTokenizer.from_pretrained`` reads; nothing is downloaded.
    Every line is checked when the source is built (valid JSON, the field present
    and a string), so a bad file fails before training; blank lines and empty
    texts are skipped. Documents are tokenised when read, as the tokenizer frames a
    text (``add_special_tokens``: a Llama's begin-of-text token, say), and end with
    its end-of-text token (``append_eos``): :func:`with_eos`.
    """

    def __init__(self, path: str | Path, tokenizer_path: str | Path, text_field: str = "text",
                 add_special_tokens: bool = True, append_eos: bool = True):
        self.path = str(path)
        if not os.path.isfile(self.path):
            raise ConfigError("path", self.path, "no such file")
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.vocab_size = len(self.tokenizer)
        self.text_field = text_field
        self.add_special_tokens, self.append_eos = bool(add_special_tokens), bool(append_eos)
        # Byte offset of every document's line: the texts stay on disk until read.
        starts = []
        with open(self.path, "rb") as f:
            offset = 0
            for lineno, raw in enumerate(f, start=1):
                if raw.strip():
                    text = self._parse(raw, lineno)
                    if text:
                        starts.append(offset)
                offset += len(raw)
        if not starts:
            raise ConfigError("path", self.path, f"holds no non-empty '{text_field}' texts")
        self._starts = np.asarray(starts, dtype=np.int64)
        self._lengths: np.ndarray | None = None

    def _parse(self, raw: bytes, lineno: int | str) -> str:
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError("path", f"{self.path}:{lineno}", f"not valid JSON ({exc})") from None
        if not isinstance(obj, dict) or self.text_field not in obj:
            raise ConfigError("text_field", self.text_field, f"missing in line {lineno} of {self.path}")
        text = obj[self.text_field]
        if not isinstance(text, str):
            raise ConfigError("text_field", self.text_field,
                              f"line {lineno} of {self.path} holds a {type(text).__name__}, not a string")
        return text

    def __len__(self) -> int:
        return len(self._starts)

    def text(self, index: int) -> str:
        i = self._check_index(index)
        with open(self.path, "rb") as f:
            f.seek(int(self._starts[i]))
            return self._parse(f.readline(), lineno=f"at byte {int(self._starts[i])}")

    def __getitem__(self, index: int) -> np.ndarray:
        ids = self.tokenizer(self.text(index), add_special_tokens=self.add_special_tokens)["input_ids"]
        return np.asarray(with_eos(ids, self.tokenizer, self.append_eos), dtype=np.int64)

    def lengths(self) -> np.ndarray:
        """Tokenises every document once (then cached)."""
        if self._lengths is None:
            self._lengths = super().lengths()
        return self._lengths.copy()


def with_eos(ids: list[int], tokenizer, append_eos: bool) -> list[int]:
    """A document's token ids ending with the tokenizer's end-of-text token where ``append_eos`` and it has one
    (once: not after one the tokenizer added itself), so that a model learns where documents end; empty stays
    empty (a skipped document)."""
    eos = tokenizer.eos_token_id if append_eos else None
    return [*ids, eos] if eos is not None and ids and ids[-1] != eos else list(ids)


def load_tokenizer(tokenizer_path: str | Path, field: str = "tokenizer_path"):
    """A Hugging Face tokenizer from a local path; transformers is imported only here. ``field``: the
    setting that named the path, for the error."""
    path = str(tokenizer_path)
    if not os.path.exists(path):
        raise ConfigError(field, path, "no such file or directory (tokenizers load from a local path only)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(field, path, "tokenising text needs transformers: pip install 'attnpool[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(field, path, f"not a loadable tokenizer ({first_line})") from None


# Test suites are code written to provoke edge cases (and are large), and
# site-packages is whatever happens to be installed: neither is "the standard library".
STDLIB_EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")


def stdlib_corpus() -> TextFileSource:
    """The demo corpus: every ``*.py`` file of the running Python's standard library, one file one document.

    Real code of very uneven length (from a few bytes to a few hundred KB) on
    every machine with nothing downloaded. Directories named in
    ``STDLIB_EXCLUDED_DIRS`` (test suites, site-packages, caches) are skipped. The
    files differ between Python versions, so all ranks must run the same Python.
    """
    return TextFileSource(sysconfig.get_paths()["stdlib"], suffixes=(".py",), exclude_dirs=STDLIB_EXCLUDED_DIRS)
