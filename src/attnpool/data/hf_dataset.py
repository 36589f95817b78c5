"""``--data hf:NAME_OR_PATH``: a dataset ``datasets`` reads, tokenised once, as a document source.

NAME_OR_PATH is a local json/jsonl/parquet/text/csv file, a directory ``Dataset.save_to_disk`` wrote, a
directory of data files, or a Hub dataset name. Each record's ``text_field`` is one document, tokenised with
a Hugging Face tokenizer as it frames a text (``add_special_tokens``) and ended with its end-of-text token
(``append_eos``; attnpool.data.sources.with_eos); empty texts are skipped.
``streaming`` reads records one batch at a time without converting the whole dataset to Arrow first (for
large ones; ``documents`` stops after that many).

A :class:`DocumentStream` reads documents by index, so the token ids are tokenised up front (int32, plus
offsets). That takes a while for a large dataset, and every rank needs the same ids: they are cached under
``cache_dir`` (default ``~/.cache/attnpool/tokenized``) as .npy files, keyed by the dataset's identity, the
options and the tokenizer, and written atomically, so the launcher tokenises, its ranks memory-map one copy,
and a second run starts at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from attnpool.data.sources import DocumentSource, load_tokenizer, with_eos
from attnpool.errors import ConfigError

# A local file's loader, by its name's ending.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text",
                 ".csv": "csv", ".arrow": "arrow"}
TOKENIZE_BATCH = 1000  # records per tokenizer call (fast tokenizers run a batch in parallel)
CACHE_FORMAT = 1


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attnpool", "tokenized")


class HFDatasetSource(DocumentSource):
    """Documents from ``datasets``, tokenised (see the module docstring). ``progress``: show progress bars
    while loading and tokenising (on one process of a run). ``model_vocab_size``: refuse, before any record
    is read, a tokenizer with more tokens than the model's embedding has rows."""

    def __init__(self, name: str, tokenizer: str, text_field: str = "text", split: str = "train",
                 subset: str | None = None, streaming: bool = False, documents: int | None = None,
                 add_special_tokens: bool = True, append_eos: bool = True, cache_dir: str | None = None,
                 progress: bool = False, model_vocab_size: int | None = None):
        if documents is not None and (isinstance(documents, bool) or not isinstance(documents, int) or documents < 1):
            raise ConfigError("documents", documents, "must be a positive integer (or unset: all)")
        self.name, self.text_field = name, text_field
        self.tokenizer_path = str(tokenizer)
        self.tokenizer = load_tokenizer(tokenizer, field="tokenizer")
        self.vocab_size = len(self.tokenizer)
        if model_vocab_size is not None and self.vocab_size > model_vocab_size:
            raise ConfigError("tokenizer", self.tokenizer_path, f"has {self.vocab_size} tokens but the model's "
                                                                f"vocabulary holds {model_vocab_size}: its ids would "
                                                                "fall outside the embedding")
        dataset = open_dataset(name, split, subset, bool(streaming), progress)
        with reading_errors(f"hf:{name}"):  # (a stream is read, and may fail, only from here)
            _check_text_field(dataset, name, text_field)
            key = _cache_key(dataset, name, split, subset, bool(streaming), text_field, documents,
                             bool(add_special_tokens), bool(append_eos), self.tokenizer)
            cache_entry = os.path.join(cache_dir or default_cache_dir(), key)
            cached = _read_cache(cache_entry)
            if cached is None:
                cached = self._tokenize(dataset, documents, bool(add_special_tokens), bool(append_eos), progress)
                _write_cache(cache_entry, *cached)
        self.tokens, self.offsets = cached
        if len(self.offsets) < 2:
            raise ConfigError("data", f"hf:{name}", f"holds no non-empty '{text_field}' texts")

    def _tokenize(self, dataset, documents: int | None, add_special_tokens: bool, append_eos: bool,
                  progress: bool) -> tuple[np.ndarray, np.ndarray]:
        total = len(dataset) if hasattr(dataset, "__len__") else None
        if documents is not None and total is not None:
            total = min(total, documents)
        pieces, lengths, seen = [], [], 0
        with _TokenizeProgress(progress, total, self.name) as bar:
            for batch in dataset.iter(batch_size=TOKENIZE_BATCH):
                texts = batch[self.text_field]
                if documents is not None:
                    texts = texts[:documents - seen]
                for i, text in enumerate(texts):
                    if not isinstance(text, str):
                        raise ConfigError("text_field", self.text_field, f"record {seen + i} of hf:{self.name} holds "
                                                                         f"a {type(text).__name__}, not a string")
                ids = self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
                for doc in ids:
                    doc = with_eos(doc, self.tokenizer, append_eos)
                    if doc:
                        pieces.append(np.asarray(doc, dtype=np.int32))
                        lengths.append(len(doc))
                seen += len(texts)
                bar.advance(len(texts))
                if documents is not None and seen >= documents:
                    break
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
        return tokens, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        i = self._check_index(index)
        return self.tokens[self.offsets[i]:self.offsets[i + 1]].astype(np.int64)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def open_dataset(name: str, split: str, subset: str | None, streaming: bool, progress: bool = True):
    """The split of NAME_OR_PATH as a ``datasets`` Dataset (IterableDataset when streaming); ``progress``:
    datasets' own bars (download, conversion to Arrow)."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("data", f"hf:{name}", "hf: data needs the datasets package: "
                                                "pip install 'attnpool[data]'") from None
    if progress:
        datasets.enable_progress_bars()
    else:
        datasets.disable_progress_bars()
    value = f"hf:{name}"
    path = Path(name)
    with reading_errors(value):
        if path.is_dir() and any((path / f).is_file() for f in ("dataset_info.json", "dataset_dict.json",
                                                                "state.json")):
            dataset = datasets.load_from_disk(name)  # save_to_disk's memory-mapped Arrow: no need to stream
            if isinstance(dataset, datasets.DatasetDict):
                if split not in dataset:
                    raise ConfigError("split", split, f"not a split of {value}; its splits: {', '.join(dataset)}")
                dataset = dataset[split]
            return dataset
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise ConfigError("data", value, f"a file ending in {path.suffix or '(nothing)'}; datasets reads "
                                                 f"{', '.join(FILE_BUILDERS)} files")
            return datasets.load_dataset(builder, data_files=name, split=split, streaming=streaming)
        if not path.exists() and (name.startswith((".", "/", "~")) or name.count("/") > 1
                                  or path.suffix.lower() in FILE_BUILDERS):
            raise ConfigError("data", value, "no such file or directory")
        if not hub_reachable():
            raise ConfigError("data", value, "not a local file or directory, and the Hugging Face Hub "
                                             f"({HUB_HOST}) cannot be reached from here to look for a dataset of "
                                             "that name")
        return datasets.load_dataset(name, subset, split=split, streaming=streaming)


HUB_HOST = "huggingface.co"


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hub's host answers a connection within ``timeout_s`` (HF_HUB_OFFLINE: no); asked before a
    dataset name goes to ``datasets``, whose requests retry for half a minute where there is no network."""
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("", "0"):
        return False
    try:
        socket.create_connection((HUB_HOST, 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


@contextlib.contextmanager
def reading_errors(value: str):
    """``datasets``' and Arrow's failures to read a dataset (while loading it, or while a stream is read) as one
    ConfigError naming the data: a malformed file, an empty one, an unreachable Hub."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # (its builders log the error this reports)
    try:
        yield
    except ConfigError:
        raise
    except datasets.exceptions.DatasetGenerationError as exc:  # (the builder's failure is its cause)
        cause = exc.__cause__ or exc
        if type(cause).__name__ == "SchemaInferenceError":
            raise ConfigError("data", value, "holds no records") from None
        raise ConfigError("data", value, f"datasets cannot read it ({_first_line(cause)})") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # (Arrow's parse errors are ValueErrors)
        raise ConfigError("data", value, f"datasets cannot load it ({_first_line(exc)})") from None
    finally:
        datasets.logging.set_verbosity(verbosity)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _check_text_field(dataset, name: str, text_field: str) -> None:
    """Refuse a text field the records lack, naming the ones they have."""
    columns = dataset.column_names
    if columns is None:  # a stream whose columns are known only once read
        first = next(iter(dataset), None)
        columns = list(first) if first is not None else []
    if text_field not in columns:
        raise ConfigError("text_field", text_field, f"not a field of hf:{name}; its fields: "
                                                    f"{', '.join(map(str, columns)) or '(none: no records)'}")


def _tokenizer_identity(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{text}".encode()).hexdigest()


def _files_identity(path: str) -> list:
    """(relative name, size, modification time) of a local file or every file under a directory."""
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [(str(p.relative_to(root)) if p != root else p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in files]


def _cache_key(dataset, name, split, subset, streaming, text_field, documents, add_special_tokens, append_eos,
               tokenizer) -> str:
    fingerprint = getattr(dataset, "_fingerprint", None)  # Arrow datasets: a hash of their files and history
    identity = fingerprint if fingerprint is not None and not streaming else (
        _files_identity(name) if os.path.exists(name) else name)
    settings = dict(format=CACHE_FORMAT, dataset=identity, split=split, subset=subset, text_field=text_field,
                    documents=documents, add_special_tokens=add_special_tokens, append_eos=append_eos,
                    tokenizer=_tokenizer_identity(tokenizer))
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read_cache(entry: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached token ids (memory-mapped: the ranks of a machine share one copy in the page cache) and offsets."""
    try:
        return (np.load(os.path.join(entry, "tokens.npy"), mmap_mode="r"),
                np.load(os.path.join(entry, "offsets.npy")))
    except (OSError, ValueError):
        return None


def _write_cache(entry: str, tokens: np.ndarray, offsets: np.ndarray) -> None:
    """Written whole into a directory of its own, then renamed into place: a reader sees all of it or none
    (where two processes race, the first rename wins and the other's copy is dropped)."""
    partial = f"{entry}.{os.getpid()}.partial"
    try:
        os.makedirs(partial, exist_ok=True)
        np.save(os.path.join(partial, "tokens.npy"), tokens)
        np.save(os.path.join(partial, "offsets.npy"), offsets)
        os.rename(partial, entry)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)  # a read-only cache, or another process's copy is in place


class _TokenizeProgress:
    """A rich progress bar of the records tokenised (a count where a stream's length is unknown)."""

    def __init__(self, enabled: bool, total: int | None, name: str):
        self.bar = None
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn(f"[bold]tokenizing[/] hf:{name}"), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), transient=False)
            self.task = self.bar.add_task("tokenize", total=total)

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
        return self

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, n)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()
